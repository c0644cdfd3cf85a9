"""R2R as a LogitsProcessor, for code that owns its own ``slm.generate(...)`` call.

    proc = R2RLogitsProcessor(llm=llm, router=r2r_model)          # or router=Router, slm=slm
    out = slm.generate(**inputs, logits_processor=[proc], do_sample=False)
    proc.routed, proc.llm_token_rate

At each step the processor reads the SLM's features (captured by hooks on the SLM's
lm_head), scores the SLM's greedy proposal, and for routed rows lets the LLM catch
up on the tokens it has not seen and replaces the row's scores with the LLM's logits.

Where HF's own processors run (transformers 5.23, ``GenerationMixin._get_logits_processor``):

* Its logits processors (repetition penalty, no-repeat n-grams, min length, bad words...)
  run *before* user processors: they shape the SLM's scores only, and a routed row gets
  the LLM's raw logits instead.
* Its sampling warpers (temperature, top-k, top-p, min-p, typical...) run *after* user
  processors, so they shape routed rows too: with those alone (and SLM and LLM of one
  vocabulary width), always routing samples exactly as ``llm.generate`` does with the same seed.

What it cannot do that ``R2RForCausalLM.generate`` does:

* Exact equality with ``llm.generate`` holds only without HF logits processors (above).
* The router sees the SLM's argmax, not the token a sampler would draw.
* It sees no attention mask: it treats leading pad tokens of each prompt as padding.
* It cannot stop routing finished rows before HF pads them; it skips rows whose last
  token was an EOS id.
* It sees ``generate`` calls only through the SLM's forwards. A call starts fresh records
  when the SLM's first forward runs on an empty cache (every call that does not pass
  ``past_key_values``) or when its ids do not extend the previous step's by one token. A call
  with ``use_cache=False`` or with the previous call's ``past_key_values`` whose prompt is the
  previous output cannot be told from a continuation: call ``reset()`` before it.
* It keeps hooks on the SLM until ``close()`` (or use it as a context manager). The hooks keep
  what each thread's forwards show apart, but its records are one call's: one processor serves
  one ``generate`` call at a time.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch
from transformers import LogitsProcessor, PreTrainedModel
from transformers.cache_utils import DynamicCache

from ..compat import cache_is_empty, cache_of
from ..config import DEFAULT_NUM_TOPK, DEFAULT_THRESHOLD
from ..core.features import positions_from_mask, read_features, score
from ..core.layouts.model_calls import cached_forward, piece_mask
from ..core.routing import check_threshold
from ..router import Router
from .tokens import special_ids


class R2RLogitsProcessor(LogitsProcessor):
    """Routes tokens of a plain ``slm.generate`` call to ``llm``.

    Args:
        llm: the large model that writes routed tokens.
        router: an ``R2RForCausalLM`` (its router, SLM, top-k and threshold are used)
            or a bare ``Router`` (then pass ``slm``).
        threshold: route where score >= threshold (default: the router config's).
        slm: the small model whose generate call this processor joins.
        num_topk_logits: logits the router reads (default: the router config's, else 100).
        pad_token_id: leading pad tokens of a prompt are masked for the LLM.
        eos_token_id: rows whose last token is one of these are finished and never routed.
    """

    def __init__(
        self,
        llm: PreTrainedModel,
        router: torch.nn.Module,
        threshold: float | None = None,
        slm: PreTrainedModel | None = None,
        num_topk_logits: int | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> None:
        config = getattr(router, "config", None)
        if isinstance(router, Router):
            if slm is None:
                raise ValueError("R2RLogitsProcessor with a bare Router needs slm=<the model that calls generate>.")
            self.router = router
        else:
            self.router = router.router
            slm = slm if slm is not None else router.slm
        self.slm, self.llm = slm, llm
        default = config.threshold if config else DEFAULT_THRESHOLD
        self.threshold = check_threshold(threshold if threshold is not None else default)
        self.num_topk_logits = num_topk_logits or (config.num_topk_logits if config else DEFAULT_NUM_TOPK)
        generation = llm.generation_config
        self.pad_token_id, eos = special_ids(generation_config=SimpleNamespace(
            pad_token_id=generation.pad_token_id if pad_token_id is None else pad_token_id,
            eos_token_id=generation.eos_token_id if eos_token_id is None else eos_token_id,
        ))
        self.eos_token_ids = torch.tensor(eos, dtype=torch.long)
        head = slm.get_output_embeddings()
        self._hooks = [
            slm.register_forward_pre_hook(self._saw_slm_forward, with_kwargs=True),
            head.register_forward_pre_hook(lambda m, args: setattr(self._hooked, "hidden", args[0][:, -1])),
            head.register_forward_hook(lambda m, args, out: setattr(self._hooked, "logits", out[:, -1])),
        ]
        # What the hooks saw, per thread: another thread running the same SLM (an R2R generate call, a
        # server) never overwrites the features of the call this processor is part of.
        self._hooked = threading.local()
        self._hooked.prefilled = False
        self._last_ids: torch.Tensor | None = None
        self._routed: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []

    # ------------------------------------------------------------ records
    @property
    def routed(self) -> torch.Tensor:
        """bool [B, steps]: True where the LLM wrote the token, in the last generate call."""
        return torch.stack(self._routed, dim=1) if self._routed else torch.zeros(0, 0, dtype=torch.bool)

    @property
    def llm_token_rate(self) -> float:
        """Routed tokens / generated tokens of unfinished rows, in the last generate call."""
        if not self._routed:
            return 0.0
        live = torch.stack(self._live, dim=1)
        return self.routed.sum().item() / max(live.sum().item(), 1)

    def reset(self) -> None:
        """Make the next step start a new generate call (fresh records and LLM cache)."""
        self._last_ids = None

    def close(self) -> None:
        """Remove the hooks on the SLM."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> R2RLogitsProcessor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the step
    def _start_call(self, input_ids: torch.Tensor) -> None:
        """A new generate call: fresh LLM cache and records; mask leading pads of the prompt."""
        self._cache = DynamicCache(config=self.llm.config)
        self._seen = 0
        self._prompt_len = input_ids.shape[1]
        if self.pad_token_id is None:
            self._prompt_mask = torch.ones_like(input_ids)
        else:
            self._prompt_mask = ((input_ids != self.pad_token_id).long().cumsum(-1) > 0).long()
        self._routed, self._live = [], []

    def _saw_slm_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # HF's prefill is the first forward of a generate call, and the only one on an empty cache (a reused
        # static cache is reset first); latched, because a chunked prefill runs several forwards.
        cache = cache_of(kwargs)
        if cache is not None and hasattr(cache, "layers") and cache_is_empty(cache):
            self._hooked.prefilled = True

    def _is_continuation(self, input_ids: torch.Tensor) -> bool:
        last = self._last_ids
        return (
            not getattr(self._hooked, "prefilled", False)
            and last is not None
            and input_ids.shape[0] == last.shape[0]
            and input_ids.shape[1] == last.shape[1] + 1
            and torch.equal(input_ids[:, :-1], last)
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self._hooks:
            raise ValueError("This R2RLogitsProcessor was closed; create a new one.")
        if not self._is_continuation(input_ids):
            self._start_call(input_ids)
        self._hooked.prefilled = False
        self._last_ids = input_ids.clone()
        batch, length = input_ids.shape
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        if length > self._prompt_len and len(self.eos_token_ids):
            generated = input_ids[:, self._prompt_len :]
            finished = torch.isin(generated, self.eos_token_ids.to(input_ids.device)).any(-1)

        seen = self._hooked
        features = read_features(self.slm, seen.logits, seen.hidden, scores.argmax(-1), self.num_topk_logits)
        router_scores = score(self.router, features).to(scores.device)
        routed = (router_scores >= self.threshold) & ~finished
        self._routed.append(routed.cpu())
        self._live.append((~finished).cpu())
        if not routed.any():
            return scores

        mask = torch.cat([self._prompt_mask, self._prompt_mask.new_ones(batch, length - self._prompt_len)], dim=1)
        positions = positions_from_mask(mask)
        full, seen = None if bool(mask.all()) else mask, self._seen
        llm_logits = cached_forward(
            self.llm, input_ids[:, seen:], positions[:, seen:], self._cache, 1,
            lambda i, j: piece_mask(self.llm, None if full is None else full[:, : seen + j], seen + i, seen + j),
        )[:, -1].to(scores.device, scores.dtype)
        self._seen = length
        width = min(scores.shape[-1], llm_logits.shape[-1])
        replaced = torch.full_like(scores, -float("inf"))
        replaced[:, :width] = llm_logits[:, :width]
        return torch.where(routed[:, None], replaced, scores)
