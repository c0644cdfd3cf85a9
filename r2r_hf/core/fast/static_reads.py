"""The fast path: the loop's fixed-shape model calls, captured once and replayed.

A decoding step on a GPU is launch-bound when run eagerly: a 1.5B SLM step costs ~18 ms of
kernel launches for ~1 ms of weight reads. With ``cache_implementation="static"`` every model
call of the loop can be given a fixed shape, so it is captured once and replayed:

* a model reading new tokens (the SLM's one-token step, a prompt, the LLM's catch-up) reads them in
  pieces of ``BUCKETS`` tokens: full 64-token pieces, then the rest padded up to its bucket. The
  padding sits at the end of the piece, no real token attends to it, only the last real token's
  logits (and, for the SLM, hidden state) are kept, and the cache's length is wound back so the next
  piece overwrites the padding. So every read, however long, is a few replays of at most seven shapes;
* the router on the SLM's proposal (top-k logits, the proposal's embedding, the hidden state): its own captured
  step, or folded into the SLM's read where the proposal is the raw argmax, in the models' dtype or fp32
  (``router_copy.py``).

How a step is captured (a CUDA graph of its eager forward, or ``torch.compile``) is ``graphs.py``; which calls run on
what is ``CapturedCalls``; the static caches and captured calls of one batch size live in a ``CapturedState``, which
a model's ``CaptureStore`` keeps between generate calls (as HF keeps its static cache) and lends to one call at a time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from transformers.cache_utils import StaticCache

from ...compat import cache_argument
from ..layouts.model_calls import EagerCalls, route_scores
from ..layouts.model_calls import static_cache as full_static_cache
from ..features import output_device, slm_proposals
from .fused import attended
from .fused_reads import Regions, capture_fused, static_read
from .graphs import CompiledStep, Step, compile_options
from .router_copy import Scorer, folded, stateless
from ..layouts.rectangle import Committed

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SLACK = BUCKETS[-1]  # a padded piece may run this far past the committed tokens


def bucket_for(tokens: int) -> int:
    """The smallest bucket holding ``tokens`` (at most ``BUCKETS[-1]``)."""
    return next(b for b in BUCKETS if b >= tokens)


def pieces(tokens: int) -> list[tuple[int, int]]:
    """(real tokens, bucket) of each piece a read of ``tokens`` new tokens is split into."""
    full, rest = divmod(tokens, BUCKETS[-1])
    return [(BUCKETS[-1], BUCKETS[-1])] * full + ([(rest, bucket_for(rest))] if rest else [])


# ------------------------------------------------------------------ the fixed-shape calls
def read_fn(model: torch.nn.Module, cache: StaticCache, hidden: bool, every: bool = False) -> Step:
    """A model reading a padded piece: (ids, positions [B, b], mask [B, L], last [1], rewind []) -> outputs.

    Outputs: the logits [B, V] at the piece's last real token ``last``, and with ``hidden`` the
    post-norm hidden state [B, H] there (from ``output_hidden_states``: a hook does not survive
    compilation); with ``every``, ``last`` [n] lists the positions whose logits [B, n, V] are kept (a speculative
    resolution's read: the positions it judges). The padding after the last real token is written to the cache, then
    the cache's length is wound back by ``rewind`` so that the next piece overwrites it; no real token attends to it.
    """

    def read(ids, positions, mask, last, rewind):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_argument(cache), use_cache=True,
                    logits_to_keep=last, output_hidden_states=hidden and not every, return_dict=True)
        for layer in cache.layers:
            layer.cumulative_length.sub_(rewind)
        if every:
            return (out.logits,)
        if not hidden:
            return (out.logits[:, -1],)
        return out.logits[:, -1], out.hidden_states[-1].index_select(1, last)[:, -1]

    return read


def router_fn(slm: torch.nn.Module, router: torch.nn.Module, k: int) -> Step:
    """The router on the SLM's proposal: (logits, hidden, token) -> scores [B]."""

    def route(logits, hidden, token):
        return (route_scores(slm, router, k, logits, hidden, token),)

    return route


@contextlib.contextmanager
def kept_lengths(*caches: StaticCache) -> Iterator[None]:
    """Restore the caches' lengths afterwards: capturing runs the step (warm-up) without committing it. What the
    warm-up wrote lies past the committed tokens, where the next real step writes again."""
    saved = [[layer.cumulative_length.clone() for layer in cache.layers] for cache in caches]
    try:
        yield
    finally:
        for cache, lengths in zip(caches, saved):
            for layer, length in zip(cache.layers, lengths):
                layer.cumulative_length.copy_(length)


def read_memory(*modules: torch.nn.Module) -> tuple[int, ...]:
    """Where every parameter and buffer the captured steps read lives (the models', the router's): one replaced
    rather than written in place (``weight.data = ...``, ``load_state_dict(assign=True)``, ``.to(dtype)``) moves, and
    graphs captured over the old memory would read freed weights."""
    return tuple(t.data_ptr() for m in modules for t in (*m.parameters(), *m.buffers()))


def static_cache(model: torch.nn.Module, batch: int, length: int, captured: bool = True) -> StaticCache:
    """A static cache, allocated up front where ``model`` is ``captured`` so that no capture ever allocates it (an
    uncaptured LLM, a Mamba-2, may have no attention shape; the private hook: tests/test_hf_internals.py)."""
    cache = full_static_cache(model.config, length)
    if (shape := model._get_static_cache_init_shape() if captured else None) is not None:
        cache.early_initialization(batch, *shape, dtype=model.dtype, device=output_device(model))
    return cache


# ------------------------------------------------------------------ one batch size's captures
class CapturedState:
    """Static caches for one batch size and capacity, and the calls captured over them.

    Captures happen on first use of each shape, so a call pays only for the shapes it meets.

    Args:
        slm, llm, router, num_topk: what the steps run.
        capture: turns a step and example inputs into a captured step (``CaptureStore.capturer``).
        batch, capacity: the shapes (capacity = longest sequence + ``SLACK``).
        capture_llm: False keeps the LLM's reads eager (it cannot be captured).
        key: what the state was built for (``CaptureStore`` compares it).
        fused: each model's fused regions (SLM, LLM; ``fused_reads.regions_for``), its captured reads fused over
            them, or None: HF's forward.
        vocab: the ids both models write (a folded read proposes the argmax among them).
        router_dtype: ``"model"`` scores with a copy of the router in the SLM's dtype, ``"float32"`` with the
            router itself (``router_copy.py``).
    """

    def __init__(self, slm, llm, router, num_topk: int, capture: Callable[[Step, dict], Step], batch: int,
                 capacity: int, capture_llm: bool, key: tuple = (), fused: tuple[Regions | None, Regions | None] = (None, None),
                 vocab: int | None = None,
                 router_dtype: str = "float32") -> None:
        self.slm, self.llm, self.router, self.num_topk = slm, llm, router, num_topk
        self.vocab = vocab if vocab is not None else slm.get_output_embeddings().weight.shape[0]
        self.scorer = Scorer(router, slm.dtype, router_dtype)
        self.batch, self.capacity, self.capture_llm, self.key = batch, capacity, capture_llm, key
        self.capture = capture
        self.slm_cache, self.llm_cache = static_cache(slm, batch, capacity), static_cache(llm, batch, capacity,
                                                                                          capture_llm)
        self.reads: dict[tuple, Step] = {}  # (role, bucket, span, folded, logits kept: 0 the last) -> captured read
        self.fused = dict(zip(("slm", "llm"), fused))
        self.router_step: Step | None = None
        self.weights = read_memory(slm, llm, router)  # where the weights lived when last lent (``CaptureStore``)
        # Views of this tensor give a piece's ``last`` index and ``rewind`` count without a host copy; the same view
        # object for the same count, so a captured read skips copying it in again (``CudaGraphStep.run``).
        self.counts = torch.arange(SLACK + 1, device=output_device(llm))
        self.lasts = [self.counts[n : n + 1] for n in range(SLACK)]
        self.rewinds = [self.counts[n] for n in range(SLACK + 1)]

    def reset(self) -> None:
        """Empty both caches in place (captured calls keep pointing at the same memory); the cast router follows
        the router's current values."""
        self.slm_cache.reset()
        self.llm_cache.reset()
        self.scorer.refresh()

    def check_router(self, seq: Committed) -> None:
        """Before anything scores (``Scorer.check``): the SLM's features over the last (at most 32) committed tokens
        of the row that holds the most; none where every row is padding."""
        mask = seq.mask[:, : seq.length].bool()
        row = int(mask.sum(1).argmax())
        ids = seq.ids[row, : seq.length][mask[row]][-32:][None]
        features = slm_proposals(self.slm, ids, self.vocab) if ids.shape[1] else None
        self.scorer.check(self.slm, self.num_topk, features)

    @property
    def buckets(self) -> set[tuple[str, int]]:
        """(role, tokens bucket) of every read captured so far."""
        return {(role, bucket) for role, bucket, *_ in self.reads}

    def span(self, filled: int) -> int:
        """The columns a read attends once the cache holds ``filled`` (fused reads attend fewer than the capacity)."""
        return attended(filled, self.capacity)

    def read(self, role: str, bucket: int, span: int, fold: bool = False, kept: int = 0,
             **inputs: torch.Tensor) -> tuple:
        """``role``'s model reads one piece of ``bucket`` columns attending ``span`` (captured on first use); with
        ``fold`` (the SLM) the read also scores its argmax proposal (``router_copy.folded``); with ``kept`` it gives
        the logits after that many positions (``last`` lists them: a resolution's read), else after the last."""
        fused = self.fused[role] is not None
        key = (role, bucket, span if fused else self.capacity, fold, kept)
        if key not in self.reads:
            key = self._capture(role, key, span, inputs)
        return self.reads[key](**inputs)

    def _capture(self, role: str, key: tuple, span: int, inputs: dict) -> tuple:
        model, cache = (self.slm, self.slm_cache) if role == "slm" else (self.llm, self.llm_cache)
        hidden, regions, fold, every = role == "slm", self.fused[role], key[3], key[4] > 0
        with kept_lengths(cache):
            if regions is not None:
                build = lambda: self._then(static_read(model, cache, hidden, span, regions, every), fold)  # noqa: E731
                step = capture_fused(self.capture, build, inputs, f"the {role.upper()}")
                if step is not None:
                    self.reads[key] = step
                    return key
                self.fused[role] = None  # every read of this model from now on, those captured already too
                self.reads = {k: step for k, step in self.reads.items() if k[0] != role}
            key = (role, key[1], self.capacity, fold, key[4])
            if key not in self.reads:
                self.reads[key] = self.capture(self._then(read_fn(model, cache, hidden, every), fold), inputs)
        return key

    def _then(self, read: Step, fold: bool) -> Step:
        """The read, and with ``fold`` the router on its argmax proposal after it."""
        return folded(read, self.slm, self.scorer.module, self.num_topk, self.vocab) if fold else read

    def route(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.router_step is None:
            self.router_step = self.capture(router_fn(self.slm, self.scorer.module, self.num_topk), inputs)
        return self.router_step(**inputs)

    def read_new(self, role: str, seq: Committed, start: int, fold: bool = False) -> tuple[torch.Tensor, ...]:
        """``role``'s model reads ``seq[start:]`` piece by piece; the outputs at its last token."""
        out: tuple[torch.Tensor, ...] = ()
        for tokens, bucket in pieces(seq.length - start):
            out = self.read(role, bucket, self.span(start + bucket), fold, ids=seq.ids[:, start : start + bucket],
                            positions=seq.positions[:, start : start + bucket], mask=seq.mask,
                            last=self.lasts[tokens - 1], rewind=self.rewinds[bucket - tokens])
            start += tokens
        return out

    def predict(self, seq: Committed, start: int, end: int, keep: list[int]) -> torch.Tensor:
        """The LLM reads columns ``start:end`` piece by piece (captured): its logits [B, n, V] after each column of
        ``keep``, computed there only (a piece keeps a bucket of positions, the last repeated to fill it)."""
        found, wanted = {}, set(keep)
        for tokens, bucket in pieces(end - start):
            inputs = dict(ids=seq.ids[:, start : start + bucket], positions=seq.positions[:, start : start + bucket],
                          mask=seq.mask, rewind=self.rewinds[bucket - tokens])
            columns = [c for c in range(start, start + tokens) if c in wanted] or [start + tokens - 1]  # (catch-up)
            kept = bucket_for(len(columns))
            at = [c - start for c in columns + columns[-1:] * (kept - len(columns))]  # (the last repeated)
            last = torch.tensor(at, device=self.counts.device)
            logits = self.read("llm", bucket, self.span(start + bucket), kept=kept, last=last, **inputs)[0]
            found.update({c: logits[:, j] for j, c in enumerate(columns)})
            start += tokens
        return torch.stack([found[c] for c in keep], dim=1)


def compiled(compile_config) -> Callable[[Step, dict], Step]:
    """A capturer that compiles each step with the options of an HF ``CompileConfig``."""
    options = compile_options(compile_config)
    return lambda fn, example: CompiledStep(fn, options)


class CapturedCalls:
    """The loop's calls for one generate call over a lent ``CapturedState`` (see the module docstring). What cannot
    be captured (a stateful router, an LLM that cannot be captured) runs on the eager engine over the
    same caches. ``close`` gives the state back to its store.

    Args:
        state, release: the lent state, and what gives it back.
        fold: the call's proposal is the SLM's raw argmax (``router_copy.proposal_is_argmax``): each SLM read
            scores it too, and ``route_scores`` of those very logits returns those scores.
        rollback: the most tokens the call's rollbacks cut the caches back by (the eager engine records that).
        stepwise: per model, why it reads one token at a time past its prompt (``model_calls.cached_forward``).
    """

    def __init__(self, state: CapturedState, release: Callable[[], None], fold: bool = False,
                 rollback: int = 0, stepwise: dict[str, str | None] | None = None) -> None:
        self.state, self.capacity, self._release = state, state.capacity, release
        self.eager = EagerCalls(state.slm, state.llm, state.router, state.num_topk, "static", state.capacity,
                                caches=(state.slm_cache, state.llm_cache), rollback=rollback, stepwise=stepwise)
        self.capture_router = getattr(state.router, "capturable", True)
        self.fold = fold and self.capture_router and stateless(state.router)
        self._folded: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, their scores) of the last read

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.state.scorer.checked and self.capture_router:
            self.state.check_router(seq)
        if not self.fold:
            return self.state.read_new("slm", seq, start)
        logits, hidden, scores = self.state.read_new("slm", seq, start, fold=True)
        self._folded = logits, scores
        return logits, hidden

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        if not self.capture_router:  # a stateful baseline (the random router) runs eagerly
            return self.eager.route_scores(logits, hidden, token)
        if self._folded is not None and self._folded[0] is logits:  # scored in the read that gave these logits
            return self._folded[1]
        return self.state.route(logits=logits, hidden=hidden, token=token)[0]

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor:
        if not self.state.capture_llm:
            return self.eager.llm_read(seq, start)
        return self.state.read_new("llm", seq, start)[0]

    def llm_predict(self, seq: Committed, start: int, end: int, keep: list[int]) -> torch.Tensor:
        """A speculative resolution's read (logits after several columns), captured like every read."""
        if not self.state.capture_llm:
            return self.eager.llm_predict(seq, start, end, keep)
        return self.state.predict(seq, start, end, keep)

    def keep(self, role: str) -> None:
        self.eager.keep(role)

    def crop(self, slm_tokens: int, llm_tokens: int, restore: tuple[str, ...] = ()) -> None:
        self.eager.crop(slm_tokens, llm_tokens, restore)  # the static layers' device lengths move back: graphs stay valid

    def close(self) -> None:
        release, self._release = self._release, None
        self.eager.close()  # (the lent caches stop recording this call's past)
        if release is not None:
            self.state.weights = read_memory(self.state.slm, self.state.llm, self.state.router)  # (fused reads pack)
            release()
