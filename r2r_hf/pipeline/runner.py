"""``label``: run the labeling steps over a prompts file, resumably, on one or many processes.

Prompts are cut into shards of ``batch_size``; shard k always holds the same prompts, so
its results do not depend on how many processes share the work. Under ``accelerate
launch`` process i takes shards i, i + n, ... for steps 0-3; the main process then writes
the labels and the summary. Every shard is written atomically and skipped on a rerun.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
)

from ..model.loading import shared_vocab_size
from ..model.tokens import check_same_tokenizer, special_ids, tokenizer_fingerprint
from .continuation import continue_mismatches
from .dataset import write_labels, write_summary
from .prefill import slm_features
from .prompts import Prompt, read_prompts
from .reference import reference_responses
from .sentences import sentence_end_ids
from .store import (
    STEPS,
    WorkDir,
    read_json,
    read_tensors,
    text_hash,
    write_json,
    write_tensors,
)
from .verify import Verifier, verify_shard


@dataclass
class LabelSettings:
    """Everything that decides the labels (recorded in the manifest; a resume must match).

    Args:
        slm, llm: Hub ids or folders of the pair.
        verifier: Hub id or folder of the judge (None: the LLM judges).
        dtype: one compute dtype for every model and step.
        max_new_tokens: bound on the LLM's reference answers.
        batch_size: prompts per shard, also the batch of every batched step.
        num_topk_logits: sorted SLM logits kept per token.
        continuation_max_tokens: bound on a continuation to its sentence end.
        context_tokens: preceding answer tokens the verifier sees.
        verifier_max_new_tokens: bound on the verifier's answer.
        share_verifier_prefix: compute the verifier instructions' KV cache once.
    """

    slm: str
    llm: str
    verifier: str | None = None
    dtype: str = "bfloat16"
    max_new_tokens: int = 1024
    batch_size: int = 8
    num_topk_logits: int = 100
    continuation_max_tokens: int = 128
    context_tokens: int = 384
    verifier_max_new_tokens: int = 4
    share_verifier_prefix: bool = True

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "num_topk_logits", "continuation_max_tokens",
                     "verifier_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {self.context_tokens}.")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype; use bfloat16, float16 or float32.")


def _load_tokenizer(name: str, role: str):
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise OSError(f"Could not load the {role} tokenizer from {name!r}: {str(err).splitlines()[0]}") from err


def _process_state():
    """(index, count, barrier) of this process; accelerate when launched by it, else a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        # Without GPUs accelerate forms a process group only when told it is on the CPU (gloo).
        # Steps take hours and processes may reach a barrier far apart: wait up to a day, not 30 minutes.
        state = PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(hours=24))
        return state.process_index, state.num_processes, state.wait_for_everyone, state.device
    return 0, 1, (lambda: None), None


class _Models:
    """Loads each model once, on first use."""

    def __init__(self, settings: LabelSettings, device) -> None:
        self.settings, self.device, self._cache = settings, device, {}

    def get(self, name: str):
        if name not in self._cache:
            kwargs: dict[str, Any] = {"dtype": getattr(torch, self.settings.dtype)}
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs).eval()
            if self.device is not None:
                model.to(self.device)
            self._cache[name] = model
        return self._cache[name]


def label(
    settings: LabelSettings,
    prompts_path: str | os.PathLike,
    out: str | os.PathLike,
    limit: int | None = None,
    steps: tuple[str, ...] = STEPS,
    progress: bool = True,
) -> dict | None:
    """Label the SLM/LLM disagreements on a prompts file; returns the summary (main process).

    Args:
        settings: models and settings of the run.
        prompts_path: ``prompts.jsonl`` (``{"id", "prompt"}`` or ``{"id", "messages"}`` per line).
        out: the run folder; an existing one with the same settings is resumed.
        limit: label only the first ``limit`` prompts.
        steps: which of ``responses, features, continuations, verdicts, labels`` to run.
        progress: show tqdm bars.
    """
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise ValueError(f"Unknown step(s) {unknown}; choose from {', '.join(STEPS)}.")
    # Everything that can be wrong with the input is checked before anything is written.
    prompts = read_prompts(prompts_path, limit)
    slm_tok = _load_tokenizer(settings.slm, "SLM")
    llm_tok = _load_tokenizer(settings.llm, "LLM")
    check_same_tokenizer(slm_tok, llm_tok, min(_vocab_size(settings.slm), _vocab_size(settings.llm)), settings.slm,
                         settings.llm)
    verifier_tok = _load_tokenizer(settings.verifier, "verifier") if settings.verifier else llm_tok
    index, count, barrier, device = _process_state()
    work = WorkDir(out)
    manifest = {
        **asdict(settings), "tokenizer_hash": tokenizer_fingerprint(llm_tok),
        "verifier_tokenizer_hash": tokenizer_fingerprint(verifier_tok), "format": 1,
    }
    if index == 0:
        work.check_manifest(manifest)
    barrier()
    if index != 0:
        work.check_manifest(manifest)

    shards = [prompts[i : i + settings.batch_size] for i in range(0, len(prompts), settings.batch_size)]
    mine = [k for k in range(len(shards)) if k % count == index]
    for k in mine:  # a resumed run must see the same prompts in every shard it already answered
        if work.done("responses", k) and read_json(work.shard("responses", k)).get("prompt_hash") != _prompt_hash(shards[k]):
            raise ValueError(
                f"The prompts of shard {k} changed since its answers were written ({work.root}); "
                "use the original prompts file or a new --out folder."
            )
    models = _Models(settings, device)
    context = _Context(settings, work, llm_tok, verifier_tok, models)
    for step in steps[: steps.index("labels") if "labels" in steps else len(steps)]:
        todo = [k for k in mine if not work.done(step, k)]
        for k in tqdm(todo, desc=f"{step} (process {index})" if count > 1 else step, unit="shard",
                      disable=not progress or not todo):
            context.run(step, k, shards[k])
    barrier()
    if index != 0 or "labels" not in steps:
        return None
    missing = [k for k in range(len(shards)) if not work.done("verdicts", k)]
    if missing:
        raise ValueError(f"Cannot write labels: shards {missing[:5]}... lack verdicts; run the earlier steps first.")
    for k in tqdm(range(len(shards)), desc="labels", unit="shard", disable=not progress):
        if not work.done("labels", k):
            write_labels(work, k)
    return write_summary(work)


class _Context:
    """Runs one step on one shard, reading the previous steps' shards."""

    def __init__(self, settings: LabelSettings, work: WorkDir, tokenizer, verifier_tokenizer, models: _Models):
        self.settings, self.work, self.tokenizer, self.verifier_tokenizer = settings, work, tokenizer, verifier_tokenizer
        self.models = models
        self.pad_id, self.eos_ids = answer_ids(tokenizer, settings.llm)
        self._ends: frozenset[int] | None = None
        self._verifier: Verifier | None = None

    @property
    def ends(self) -> frozenset[int]:
        if self._ends is None:
            self._ends = sentence_end_ids(self.tokenizer)
        return self._ends

    def _require(self, step: str, k: int) -> Path:
        path = self.work.shard(step, k)
        if not path.exists():
            raise ValueError(f"Shard {k} has no {step} yet; run the '{step}' step first.")
        return path

    @torch.no_grad()
    def run(self, step: str, k: int, prompts: list[Prompt]) -> None:
        s = self.settings
        if step == "responses":
            result = reference_responses(self.models.get(s.llm), self.tokenizer, prompts, s.max_new_tokens,
                                         self.pad_id, self.eos_ids)
            result["prompt_hash"] = _prompt_hash(prompts)
            write_json(self.work.shard(step, k), result)
            return
        samples = read_json(self._require("responses", k))["samples"]
        if step == "features":
            slm, llm = self.models.get(s.slm), self.models.get(s.llm)
            tensors, meta = slm_features(slm, samples, s.num_topk_logits, shared_vocab_size(slm, llm))
            write_tensors(self.work.shard(step, k), tensors, meta)
        elif step == "continuations":
            features, _ = read_tensors(self._require("features", k), ["sample", "position", "slm_token", "real_token"])
            result = continue_mismatches(
                self.models.get(s.llm), self.tokenizer, samples, features, self.ends, self.eos_ids, self.pad_id,
                s.batch_size, s.continuation_max_tokens, s.context_tokens,
            )
            write_json(self.work.shard(step, k), result)
        elif step == "verdicts":
            mismatches = read_json(self._require("continuations", k))["mismatches"]
            write_json(self.work.shard(step, k), verify_shard(self.verifier, mismatches))

    @property
    def verifier(self) -> Verifier:
        if self._verifier is None:
            s = self.settings
            self._verifier = Verifier(self.models.get(s.verifier or s.llm), self.verifier_tokenizer,
                                      s.verifier_max_new_tokens, s.batch_size, s.share_verifier_prefix)
        return self._verifier


def _prompt_hash(prompts: list[Prompt]) -> str:
    return text_hash([(p.id, p.prompt, p.messages) for p in prompts])


def answer_ids(tokenizer, llm: str) -> tuple[int, list[int]]:
    """(pad id, end-of-answer ids) of the LLM's answers: its generation config's, else the tokenizer's."""
    try:
        generation = GenerationConfig.from_pretrained(llm)
    except OSError:
        generation = None
    pad, eos = special_ids(tokenizer, generation)
    if not eos:
        raise ValueError(f"{llm!r} defines no EOS token; R2R labeling needs one to end answers.")
    return pad, eos


def _vocab_size(name: str) -> int:
    """The vocabulary size a model's config declares (its lm_head width), read without loading weights."""
    try:
        return int(AutoConfig.from_pretrained(name).get_text_config().vocab_size)
    except (OSError, ValueError) as err:
        raise OSError(f"Could not read the config of {name!r}: {str(err).splitlines()[0]}") from err
