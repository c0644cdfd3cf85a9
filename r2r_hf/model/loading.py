"""Loading the SLM and LLM a router names, and checking that the three fit together."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..config import R2RConfig
from .hub import HUB_KWARGS
from .sources import Unavailable, local_home, resolve
from .tokens import check_same_tokenizer, stored_tokenizer

# Keyword arguments that place or shape model weights; at top level they apply to the SLM and LLM.
MODEL_KWARGS = ("dtype", "torch_dtype", "device_map", "attn_implementation", "max_memory", "offload_folder")

# Padded vocabularies (e.g. 151,936 vs 152,064 for Qwen2.5 sizes) differ by a few hundred rows;
# a larger gap means two different tokenizers.
MAX_VOCAB_PADDING = 1024


def load_base_model(
    role: str,
    name_or_path: str | None,
    revision: str | None,
    kwargs: dict[str, Any],
    hint: str | None = None,
) -> PreTrainedModel:
    """Load the SLM or LLM with ``AutoModelForCausalLM``, turning failures into one clear sentence.

    A name the Hub cannot serve here is read from the Hugging Face cache or a registered local copy, or
    refused at once (``sources.resolve``): no retried requests.

    Args:
        role: ``"slm"`` or ``"llm"`` (used in messages).
        name_or_path: Hub id or local folder.
        revision: Hub revision, or None for the default branch.
        kwargs: extra ``from_pretrained`` arguments (device_map, dtype, quantization_config...).
        hint: what to do, said when it fails (default: pass ``{role}=`` or fix the router's config).
    """
    what = role.upper() if role in ("slm", "llm") else role
    if not name_or_path:
        raise ValueError(f"The router config names no {what}; pass {role}= (a Hub id, a local folder or a loaded model).")
    kwargs = dict(kwargs)
    if revision and "revision" not in kwargs:
        kwargs["revision"] = revision
    hint = hint or f"pass {role}= (a local folder or an already-loaded model), or fix {role}_name_or_path in the " \
                   "router's config"
    hub = {k: kwargs.pop(k) for k in (*HUB_KWARGS, "revision") if k in kwargs}
    try:
        name_or_path, hub = resolve(name_or_path, f"the {what}", hub)
    except Unavailable as err:
        raise OSError(f"Could not load the {what} {name_or_path!r}: {err.reason}; {hint}.") from None
    kwargs.update(hub)
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"Could not load the {what} {name_or_path!r} ({reason}); {hint}.") from err


# ------------------------------------------------------------------ the CPU dtype, measured
# Whether bfloat16 or float32 decodes faster on a CPU depends on its kernels (no AVX-512: a reference bf16 kernel,
# ~80x slower; AVX512-BF16: often faster) and on memory bandwidth, which a CPU flag does not tell: it is measured.
CPU_DTYPE_FILE = "cpu_dtype.json"
DEFAULT_WIDTH = 896  # Qwen2.5-0.5B's hidden size, for callers that know no SLM
PROBE_WEIGHT_BYTES = 128e6  # float32 weights in the probe: past the last-level cache, as a real decode step is
_CHOICES: dict[str, DtypeChoice] = {}  # this process's measurements, by machine_key


@dataclass(frozen=True)
class DtypeChoice:
    """The faster of a low-precision dtype and float32 for decoding on this CPU, and what was measured."""

    dtype: torch.dtype
    seconds: dict[str, float]  # dtype name -> seconds per probe decode step
    width: int
    threads: int
    cached: str | None = None  # where an earlier measurement was read from, or None if measured now

    @property
    def line(self) -> str:
        """One line: what was measured and chosen."""
        times = " and ".join(f"{1e3 * s:.1f} ms in {name}" for name, s in self.seconds.items())
        source = f" (measured earlier, cached in {self.cached}; delete it to re-measure)" if self.cached else ""
        return (f"dtype 'auto' on this CPU: one decode step at the SLM's width {self.width} took {times} "
                f"({self.threads} threads){source}: loading the models in {_name(self.dtype)} (a dtype given, or "
                "--dtype on the command line, overrides).")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def machine_key(width: int, low: torch.dtype, threads: int | None = None) -> str:
    """What a measurement depends on: this machine's CPU, torch, the thread count, the width and the dtypes."""
    import platform

    threads = torch.get_num_threads() if threads is None else threads
    return (f"{platform.node()}|{platform.machine()}|{_cpu_model()}|torch {torch.__version__}"
            f"|{torch.backends.cpu.get_cpu_capability()}|{threads} threads|width {width}|{_name(low)} vs float32")


def _cpu_model() -> str:
    """The CPU's model name where Linux tells it (``platform.processor()`` often says only the architecture)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def decode_step_seconds(width: int, dtypes: tuple[torch.dtype, ...], rounds: int = 6) -> dict[str, float]:
    """Seconds per decode step of a few decoder layers of hidden size ``width`` in each dtype (the fastest round).

    A layer: RMS norm, a QKV projection, attention of one token over 256 cached positions, the output projection
    and a gated MLP of 4x the width, on random weights (a private generator: the global seed is untouched). The
    dtypes alternate round by round, so load from other processes hits both alike; a dtype more than 5x slower
    than another after a round is not timed further. About half a second at width 896.
    """
    import torch.nn.functional as F

    layers = min(8, max(1, math.ceil(PROBE_WEIGHT_BYTES / (64 * width * width))))
    heads = max(1, width // 64)
    gen = torch.Generator().manual_seed(0)
    shapes = ((3 * width, width), (width, width), (8 * width, width), (width, 4 * width))
    base = [[torch.randn(*shape, generator=gen) * 0.02 for shape in shapes] for _ in range(layers)]
    cache = torch.randn(2, 1, heads, 256, width // heads, generator=gen)
    start = torch.randn(1, 1, width, generator=gen)
    cast = {d: ([[w.to(d) for w in layer] for layer in base], cache.to(d), start.to(d)) for d in dtypes}

    def step(dtype: torch.dtype) -> float:
        weights, kv, x = cast[dtype]
        began = time.perf_counter()
        with torch.no_grad():
            for qkv, out, up, down in weights:
                q = F.linear(F.rms_norm(x, (width,)), qkv)[..., :width].view(1, 1, heads, -1).transpose(1, 2)
                attended = F.scaled_dot_product_attention(q, kv[0], kv[1]).transpose(1, 2).reshape(1, 1, width)
                x = x + F.linear(attended, out)
                gate, value = F.linear(F.rms_norm(x, (width,)), up).chunk(2, -1)
                x = x + F.linear(F.silu(gate) * value, down)
        return time.perf_counter() - began

    for d in dtypes:  # the first call of each warms its kernels up
        step(d)
    best = {d: math.inf for d in dtypes}
    for _ in range(rounds):
        for d in dtypes:
            best[d] = min(best[d], step(d))
        if max(best.values()) > 5 * min(best.values()):
            break
    return {_name(d): s for d, s in best.items()}


def cpu_dtype_choice(width: int = DEFAULT_WIDTH, low: torch.dtype = torch.bfloat16) -> DtypeChoice:
    """The faster dtype for decoding on this CPU, ``low`` or float32, at hidden size ``width``: the one decision.

    Measured once per process and machine (``decode_step_seconds``); the result is kept in ``cpu_dtype.json`` in
    r2r_hf's folder (``$R2R_HF_CACHE``) by ``machine_key``, so later commands on this machine reuse it.
    """
    key = machine_key(width, low)
    if key in _CHOICES:
        return _CHOICES[key]
    path = local_home() / CPU_DTYPE_FILE
    stored = _stored_seconds(_read_json(path).get(key), low)
    if stored is not None:
        choice = DtypeChoice(getattr(torch, stored[0]), stored[1], width, torch.get_num_threads(), cached=str(path))
    else:
        seconds = decode_step_seconds(width, (low, torch.float32))
        choice = DtypeChoice(low if seconds[_name(low)] < seconds["float32"] else torch.float32, seconds, width,
                             torch.get_num_threads())
        _write_entry(path, key, {"dtype": _name(choice.dtype), "seconds": seconds,
                                 "measured": time.strftime("%Y-%m-%d %H:%M:%S")})
    _CHOICES[key] = choice
    return choice


def _stored_seconds(entry: Any, low: torch.dtype) -> tuple[str, dict[str, float]] | None:
    """(dtype name, seconds by dtype) of a cached measurement, or None when the entry is damaged (hand-edited, or
    written by another version): a damaged entry is measured again rather than trusted or crashing the load."""
    names = {_name(low), "float32"}
    if not isinstance(entry, dict) or entry.get("dtype") not in names:
        return None
    seconds = entry.get("seconds")
    if not isinstance(seconds, dict) or set(seconds) != names:
        return None
    if not all(type(v) in (int, float) and 0 < v < math.inf for v in seconds.values()):  # bool, NaN, str: damaged
        return None
    return entry["dtype"], {k: float(v) for k, v in seconds.items()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_entry(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add one measurement to the file, atomically; a folder that cannot be written keeps it for this process only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**_read_json(path), key: entry}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


def bf16_is_slow_here(device: str | torch.device = "cpu") -> bool:
    """Whether float32 decodes faster than bfloat16 on ``device`` (measured on a CPU: ``cpu_dtype_choice``; never on
    an accelerator)."""
    if torch.device(device).type != "cpu":
        return False
    return cpu_dtype_choice().dtype == torch.float32


def split_loading_kwargs(
    kwargs: dict[str, Any], slm_kwargs: dict[str, Any] | None, llm_kwargs: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split ``from_pretrained`` keyword arguments into (router, slm, llm) argument sets.

    Hub arguments go to all three; placement arguments (dtype, device_map...) go to the
    SLM and LLM only, because the router stays in float32 next to the SLM's lm_head.
    """
    if "quantization_config" in kwargs:
        raise ValueError(
            "quantization_config applies to one model: pass it in llm_kwargs (or slm_kwargs), "
            "e.g. llm_kwargs={'quantization_config': BitsAndBytesConfig(load_in_4bit=True)}."
        )
    router_kwargs = dict(kwargs)
    shared = {k: router_kwargs[k] for k in HUB_KWARGS if k in router_kwargs}
    placement = {k: router_kwargs.pop(k) for k in MODEL_KWARGS if k in router_kwargs}
    slm = {**shared, **placement, **(slm_kwargs or {})}
    llm = {**shared, **placement, **(llm_kwargs or {})}
    return router_kwargs, slm, llm


def vocab_size(model: PreTrainedModel) -> int:
    """Width of the model's lm_head (its padded vocabulary)."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    return int(width) if width else int(model.config.get_text_config().vocab_size)


def hidden_size(model: PreTrainedModel) -> int:
    """Width of the hidden state the lm_head reads."""
    head = model.get_output_embeddings()
    width = getattr(head, "in_features", None)
    return int(width) if width else int(model.config.get_text_config().hidden_size)


def shared_vocab_size(slm: PreTrainedModel, llm: PreTrainedModel) -> int:
    """The vocabulary both models can write; refuses pairs that cannot share one tokenizer."""
    slm_vocab, llm_vocab = vocab_size(slm), vocab_size(llm)
    if abs(slm_vocab - llm_vocab) > MAX_VOCAB_PADDING:
        raise ValueError(
            f"R2R needs one tokenizer shared by both models, but the SLM has a vocabulary of {slm_vocab} "
            f"and the LLM of {llm_vocab}; pick an SLM and LLM from the same family."
        )
    shared = min(slm_vocab, llm_vocab)
    slm_tok, llm_tok = stored_tokenizer(slm), stored_tokenizer(llm)
    if slm_tok is not None and llm_tok is not None:  # a model without a stored tokenizer cannot be checked
        check_same_tokenizer(slm_tok, llm_tok, shared, slm.name_or_path, llm.name_or_path)
    return shared


def context_length(slm: PreTrainedModel, llm: PreTrainedModel) -> int | None:
    """The longest sequence both models were built for (the smaller ``max_position_embeddings``), if known."""
    limits = [getattr(m.config.get_text_config(), "max_position_embeddings", None) for m in (slm, llm)]
    limits = [x for x in limits if x]
    return min(limits) if limits else None


def check_router_fits(config: R2RConfig, slm: PreTrainedModel) -> None:
    """Refuse an SLM whose hidden or embedding width differs from what the router was built for."""
    check_router_sizes(
        config, hidden_size(slm), slm.get_input_embeddings().embedding_dim, vocab_size(slm), slm.name_or_path
    )


def check_router_sizes(config: R2RConfig, slm_hidden: int, slm_embed: int, slm_vocab: int, slm_name: str) -> None:
    """The size checks of ``check_router_fits``, from sizes alone (e.g. read from the SLM's config)."""
    if config.router_type != "mlp":
        return
    if config.slm_hidden_size != slm_hidden:
        raise ValueError(
            f"The router reads SLM hidden states of size {config.slm_hidden_size}, but the SLM "
            f"{slm_name!r} has hidden size {slm_hidden}; load the SLM this router was trained for "
            f"({config.slm_name_or_path!r})."
        )
    if config.slm_embedding_size != slm_embed:
        raise ValueError(
            f"The router reads token embeddings of size {config.slm_embedding_size}, but the SLM "
            f"{slm_name!r} has embedding size {slm_embed}; load the SLM this router was trained for "
            f"({config.slm_name_or_path!r})."
        )
    if config.num_topk_logits > slm_vocab:
        raise ValueError(
            f"The router reads the top {config.num_topk_logits} logits but the SLM has only {slm_vocab} tokens; "
            "use a smaller num_topk_logits."
        )


def model_revision(model: PreTrainedModel) -> str | None:
    """The Hub revision a model was loaded from, where transformers recorded it."""
    return getattr(model.config, "_commit_hash", None) or None


def config_from_models(slm: PreTrainedModel, llm: PreTrainedModel, **overrides: Any) -> R2RConfig:
    """An R2RConfig sized from the SLM that names both models (Hub id or folder)."""
    values: dict[str, Any] = dict(
        slm_name_or_path=slm.name_or_path or None,
        llm_name_or_path=llm.name_or_path or None,
        slm_revision=model_revision(slm),
        llm_revision=model_revision(llm),
        slm_hidden_size=hidden_size(slm),
        slm_embedding_size=slm.get_input_embeddings().embedding_dim,
    )
    values.update(overrides)
    return R2RConfig(**values)


def is_loaded_model(value: object) -> bool:
    return isinstance(value, torch.nn.Module)
