"""The server's fast path: slot reads and the router captured once per shape bucket and replayed.

On a GPU an eager step is launch-bound (an eager 1.5B step 18.5 ms against ~1 ms of weight reads). A slot read
(``layouts/slot_cache.py``) becomes a fixed-shape step once its shapes are fixed: the slots it reads are the first ``k``
of a rows bucket (1, 2, 4, 8, 16 ... up to the batch: a read pads to the bucket holding its highest slot, and
the slots it does not read get no tokens: their padding goes to the spare column), its width is a tokens
bucket (``static_reads.BUCKETS``: 1 ... 64), and it attends a span bucket: the columns its rows fill, rounded up
to a power of two (at least 256, at most the capacity: ``fused.attended``, as ``generate``'s reads attend). So
every read of the decoding loop — the SLM's step, a prompt's chunk, the LLM's catch-up — is a few replays of
captured steps, and so is the router on the proposals (per rows bucket). vLLM and SGLang capture per batch
size the same way.

Everything is captured at start-up (``warm``: the time and, on CUDA, the graph memory are reported), with
inputs that write nothing (every row padding), so capturing leaves the slots as they were. How a step is
captured is the model's ``CaptureStore``'s (CUDA graphs; the CPU emulation in tests) or ``torch.compile``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from .static_reads import BUCKETS, bucket_for
from ..staging import in_order, staged
from ..features import slm_proposals
from ..layouts.model_calls import layer_kinds, route_scores
from .fused import attended
from .fused_reads import Regions, capture_fused, regions_for, slot_read
from .drafts import CapturedDrafts, idle_inputs
from .graphs import Step
from .packed_reads import PackedSteps
from ..layouts.reads import PaddedReads, SlotPath
from .router_copy import Scorer, folded, stateless
from ..layouts.slot_cache import SlotCache, forward_piece, piece, piece_inputs

logger = logging.getLogger(__name__)


def span_buckets(capacity: int) -> tuple[int, ...]:
    """The spans a read of slots of ``capacity`` columns attends (``fused.attended`` of each count of filled columns:
    at most ``capacity`` - 1, as a slot keeps one column free past its answer's end: ``RunningBatch.join``)."""
    out = [attended(1, capacity)]
    while out[-1] < capacity - 1:
        out.append(attended(out[-1] + 1, capacity))
    return tuple(out)


def row_buckets(slots: int) -> tuple[int, ...]:
    """1, 2, 4, ... and ``slots`` itself: the row counts a captured read pads to."""
    out, k = [], 1
    while k < slots:
        out.append(k)
        k *= 2
    return tuple(out + [slots])


def captured_steps(slots: int, capacity: int, speculate: bool) -> int:
    """How many steps ``capture_slots`` captures: each model's reads per rows x tokens x span bucket, the LLM's
    gathering reads of every rows bucket below the largest (and, speculating, each of its reads again keeping every
    position's logits), the router per rows bucket."""
    rows, per = row_buckets(slots), len(BUCKETS) * len(span_buckets(capacity))
    llm = (2 * len(rows) - 1) * per * (2 if speculate else 1)
    return len(rows) * per + llm + len(rows)


class PaddedSteps:
    """One model's slot reads, captured per (rows bucket, tokens bucket) over a static ``SlotCache``.

    Args:
        model: the SLM or the LLM.
        cache: its slot cache (allocated, static: its capacity never grows).
        capture: turns a step and example inputs into a captured step.
        hidden: also return the post-norm hidden state (the SLM's, for the router).
        regions: capture fused reads over these regions (``fused_reads.regions_for``); None: HF's forward.
    """

    def __init__(self, model: torch.nn.Module, cache: SlotCache, capture: Callable[[Step, dict], Step],
                 hidden: bool, regions: Regions | None = None, gather: bool = False,
                 fold: Callable[[Step], Step] | None = None) -> None:
        self.model, self.cache, self.capture, self.hidden, self.gather = model, cache, capture, hidden, gather
        self.fold = fold  # the router on each read's argmax proposal, in the same captured step (the SLM's reads)
        self.regions = regions
        self.rows = row_buckets(cache.slots)
        self.spans = span_buckets(cache.capacity)
        # (rows, tokens, span) bucket, whether it keeps every position's logits, whether it gathers its rows ->
        # its captured read
        self.steps: dict[tuple[int, int, int, bool, bool], Step] = {}
        device = model.get_input_embeddings().weight.device
        self.index = {k: torch.arange(k, device=device) for k in self.rows}

    packed = False  # (``packed_reads.PackedSteps`` are)

    @property
    def piece(self) -> int:
        """The widest piece one replay reads."""
        return BUCKETS[-1]

    def _fn(self, rows: int, span: int, every: bool, gathered: bool) -> Step:
        cache, model, hidden, index = self.cache, self.model, self.hidden and not every, self.index[rows]

        def read(ids, position, column, real, slots=None):
            cache.plan(None if gathered else list(range(rows)), column, span, index=slots if gathered else index)
            return forward_piece(model, cache, ids, position, column, real, span, hidden, every)

        return read

    def step(self, rows: int, width: int, span: int, example: dict[str, torch.Tensor], every: bool = False,
             gathered: bool = False) -> Step:
        """The captured read of ``rows`` x ``width`` attending ``span`` columns (with ``every``: every position's
        logits, HF's forward: the fused head keeps the last only; ``gathered``: of the slots its input names, not
        the first ``rows``); captured on first use, over inputs that write nothing (a capture runs the step, and a
        recurrent state would advance twice: ``layouts/slot_state.py``)."""
        key = (rows, width, span, every, gathered)
        if key not in self.steps:
            example = {**example, "real": torch.zeros_like(example["real"]),
                       "column": torch.full_like(example["column"], self.cache.trash)}
            then = self.fold if self.fold is not None and not every else (lambda read: read)
            if self.regions is not None and not every:
                step = capture_fused(self.capture, lambda: self.function(rows, span), example,
                                     type(self.model).__name__)
                if step is not None:
                    self.steps[key] = step
                    return step
                self.regions = None  # every bucket, those captured already too: one kind of read per model
                self.steps = {key: step for key, step in self.steps.items() if key[3]}
            self.steps[key] = self.capture(then(self._fn(rows, span, every, gathered)), example)
        return self.steps[key]

    def function(self, rows: int, span: int) -> Step:
        """The (uncaptured) read of the first ``rows`` slots attending ``span`` columns, fused where the reads are,
        folding the router where they do: what ``step`` captures, and what a draft block runs inside its own."""
        then = self.fold if self.fold is not None else (lambda read: read)
        if self.regions is not None:
            return then(slot_read(self.model, self.cache, self.hidden, self.regions, span))
        return then(self._fn(rows, span, False, False))

    @property
    def fused(self) -> bool:
        """Whether the captured reads are fused ones."""
        return self.regions is not None

    def reads(self, stepwise: bool = False) -> PaddedReads:
        """The layout's reads of this model replaying these steps (``layouts/reads.py``; a model with recurrent layers
        reads every row of a forward at one tokens bucket: no row padded; ``stepwise``: one token a forward past a
        row's first read, ``Abilities.continues``)."""
        widths = BUCKETS if "recurrent" in layer_kinds(self.model) or stepwise else None
        computed = lambda rows, counts: math.prod(self.shape(rows, counts)[:2])  # noqa: E731
        # (``read`` looked up at each call, not bound here: the GPU check's read log wraps the class's method)
        forward = lambda *args, **kwargs: self.read(*args, **kwargs)  # noqa: E731
        return PaddedReads(forward, self.piece, self.cache, computed, steps=self, widths=widths, stepwise=stepwise)

    def shape(self, rows: list[int], counts: list[int]) -> tuple[int, int, bool]:
        """The rows and tokens buckets a read of ``rows`` replays, and whether it gathers: a read of the first slots
        pads to the bucket holding its highest slot (slots 3 and 12 of 16: a 16-row read); where gathering its rows
        makes a smaller bucket, a gathering read takes them (and slots it does not read, writing nothing, up to the
        bucket)."""
        k = next(b for b in self.rows if b > max(rows))
        fewer = next(b for b in self.rows if b >= len(rows))
        gathers = self.gather and fewer < k
        return (fewer if gathers else k), bucket_for(max(counts)), gathers

    def _inputs(self, tokens: torch.Tensor, rows: list[int], starts: list[int], counts: list[int], width: int):
        """The read's rows bucket, its inputs, and whether it gathers (``shape``)."""
        k, _, gathers = self.shape(rows, counts)
        if gathers:
            taken = set(rows)
            fillers = [s for s in range(self.cache.slots) if s not in taken][: k - len(rows)]
            inputs, index = piece(tokens, rows + fillers, starts + [0] * len(fillers), counts + [0] * len(fillers),
                                  width, self.cache.trash)
            return k, {**inputs, "slots": index}, True
        full_starts, full_counts = [0] * k, [0] * k
        for r, s, n in zip(rows, starts, counts):
            full_starts[r], full_counts[r] = s, n
        return k, piece_inputs(tokens, list(range(k)), full_starts, full_counts, width, self.cache.trash), False

    def read(self, tokens: torch.Tensor, rows: list[int], starts: list[int], counts: list[int], every: bool = False):
        """Like ``slot_cache.read_piece`` (at most ``piece`` tokens per row): the logits [k, V], hidden [k, H] or
        None, and where the reads fold the router, its scores [k] of each row's argmax proposal, else None (with
        ``every``: the logits [k, width, V] after each token of the right-aligned piece, None and None)."""
        width = bucket_for(max(counts))
        span = attended(max(s + n for s, n in zip(starts, counts)), self.cache.capacity)  # the columns filled
        k, inputs, gathered = self._inputs(tokens, rows, starts, counts, width)
        out = self.step(k, width, span, inputs, every, gathered).run(**inputs)  # each kept row copied out once
        if gathered:
            self.cache.count_gathered(k, span)  # here, on the host: a replay runs no Python
            kept = [value[: len(rows)].clone() for value in out]
        elif in_order(rows) and len(rows) == k:
            kept = [value.clone() for value in out]
        else:
            picked = staged(rows, out[0].device)
            kept = [value.index_select(0, picked) for value in out]
        folded = self.fold is not None and not every
        return kept[0], (kept[1] if self.hidden and not every else None), (kept[-1] if folded else None)

    def warm(self, tokens: torch.Tensor, every: bool = False) -> int:
        """Capture every (rows, tokens) bucket with inputs that write nothing (and with ``every``, the reads that
        keep every position's logits: speculative resolutions; where the reads gather, the gathering ones of every
        bucket below the largest); the number captured. Largest first: the smaller graphs then reuse the blocks the
        larger ones left in the pool (vLLM captures in that order too)."""
        for k in reversed(self.rows):
            for width in reversed(BUCKETS):
                for gathered in (False, True) if self.gather and k < self.rows[-1] else (False,):
                    inputs = piece_inputs(tokens, list(range(k)), [0] * k, [0] * k, width, self.cache.trash)
                    if gathered:
                        inputs["slots"] = self.index[k]
                    for span in reversed(self.spans):
                        for kind in (False, True) if every else (False,):
                            self.step(k, width, span, inputs, kind, gathered)
        return len(self.steps)


class CapturedRouter:
    """The router on the proposals, captured per rows bucket (inputs padded with zeros).

    With ``router_dtype="model"`` it scores with a copy of the router in the SLM's dtype (``router_copy.py``),
    checked against the router on the first real proposals: past the tolerance it captures the router itself.
    """

    def __init__(self, slm, router, num_topk: int, capture: Callable[[Step, dict], Step], slots: int,
                 router_dtype: str = "float32") -> None:
        self.slm, self.router, self.num_topk, self.capture = slm, router, num_topk, capture
        self.scorer = Scorer(router, slm.dtype, router_dtype)
        self.rows = row_buckets(slots)
        self.steps: dict[int, Step] = {}

    def __call__(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        # The first real proposals check the copy (warming scores zeros: it does not check).
        if self.scorer.check(self.slm, self.num_topk, (logits, hidden, token)):
            self.steps = {}  # captured again, over the router itself, on first use
        return self._scores(logits, hidden, token)

    def folding(self, vocab: int) -> Callable[[Step], Step]:
        """What folds the router into an SLM read (``router_copy.folded``), once the copy it scores with is checked
        on the SLM's own features over a probe sequence (the folded reads are captured over the checked router)."""
        if not self.scorer.checked:
            device = self.slm.get_input_embeddings().weight.device
            probe = (torch.arange(32, device=device)[None] * 7919) % vocab  # ids spread over the vocabulary
            self.scorer.check(self.slm, self.num_topk, slm_proposals(self.slm, probe, vocab))
        return lambda read: folded(read, self.slm, self.scorer.module, self.num_topk, vocab)

    def _scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        k = next(b for b in self.rows if b >= len(token))
        pad = k - len(token)
        inputs = {"logits": logits, "hidden": hidden, "token": token}
        if pad:  # (a padded copy is a new tensor: copied in; the same tensor as last time holds the same values)
            inputs = {"logits": torch.nn.functional.pad(logits, (0, 0, 0, pad)),
                      "hidden": torch.nn.functional.pad(hidden, (0, 0, 0, pad)),
                      "token": torch.nn.functional.pad(token, (0, pad))}
        if k not in self.steps:
            slm, router, num_topk = self.slm, self.scorer.module, self.num_topk
            self.steps[k] = self.capture(lambda logits, hidden, token: (
                route_scores(slm, router, num_topk, logits, hidden, token),), inputs)
        return self.steps[k](**inputs)[0][: len(token)]

    def warm(self, vocab: int, width: int, device: torch.device, dtype: torch.dtype) -> int:
        for k in reversed(self.rows):  # largest first, as ``PaddedSteps.warm``
            logits, hidden = (torch.zeros(k, n, dtype=dtype, device=device) for n in (vocab, width))
            self._scores(logits, hidden, torch.zeros(k, dtype=torch.long, device=device))
        return len(self.steps)


def capture_slots(layout, capture: Callable[[Step, dict], Step], warm: bool = True, fuse: bool | str = False,
                  router_dtype: str = "float32", speculate: int = 0, block: int = 1, gains: bool = False) -> dict:
    """From now on every read of the slot ``layout`` (a ``layouts.slot_layout.SlotLayout``) replays a captured call:
    the slots become static (their current size), every bucket is captured now with ``warm`` (with ``speculate``
    pending positions per row, also the LLM's reads that keep their logits), fused reads where ``fuse`` and the model
    can be fused (its ``Abilities.fuse``; the LLM's packed: ``packed_reads.py``; ``"plain"``: the fused regions
    uncompiled, for tests), the router in ``router_dtype`` (``router_copy.py``), and with ``block`` > 1 and the
    router folded, draft blocks of that many steps (``drafts.py``; ``gains``: they end drafts by the expected-gain
    rule where rows ask, ``WaitPolicy.draft_cost``). The layout is handed the captured ``SlotPath``
    once it is built; what it took."""
    p = layout.pair
    for model, cache in ((p.slm, layout.slm_cache), (p.llm, layout.llm_cache)):  # allocate outside any capture
        inputs = piece_inputs(layout.tokens, list(range(layout.slots)), [0] * layout.slots, [0] * layout.slots, 1,
                              cache.trash)
        cache.plan(list(range(layout.slots)), inputs["column"], 1)
        forward_piece(model, cache, **inputs, used=1, hidden=False)
    router = CapturedRouter(p.slm, p.router, p.num_topk, capture, layout.slots, router_dtype)
    capturable = getattr(p.router, "capturable", True)
    foldable = stateless(p.router) and capturable  # (``router_copy`` says why)
    fold = router.folding(p.vocab_size) if foldable else None
    slm = PaddedSteps(p.slm, layout.slm_cache, capture, hidden=True, regions=regions_for(p.slm, fuse, p.abilities.slm.fuse),
                      fold=fold)
    llm = _llm_steps(p.llm, layout, capture, regions_for(p.llm, fuse, p.abilities.llm.fuse), speculate)
    drafts = None
    if block > 1 and fold is not None:
        drafts = CapturedDrafts(lambda span: slm.function(layout.slots, span), capture, block, p.vocab_size,
                                layout.slm_cache.trash, layout.tokens, gains)
    report = {"slots": layout.slots, "columns": layout.capacity, "steps": 0, "seconds": 0.0}
    if warm:
        start = time.perf_counter()
        report["steps"] = slm.warm(layout.tokens)
        llm, steps = _warm_llm(llm, layout, capture, speculate)
        report["steps"] += steps
        if drafts is not None:
            report["steps"] += drafts.warm(span_buckets(layout.capacity), idle_inputs(layout))
        head = p.slm.get_output_embeddings().weight
        if capturable:
            report["steps"] += router.warm(head.shape[0], p.slm.config.hidden_size, head.device, head.dtype)
        report["seconds"] = time.perf_counter() - start
    stepwise = {role: getattr(p.abilities, role).continues is not None for role in ("slm", "llm")}
    llm_reads = llm.reads(stepwise["llm"]) if isinstance(llm, PaddedSteps) else llm.reads()
    layout.use(SlotPath(slm.reads(stepwise["slm"]), llm_reads, router if capturable else layout.path.route, drafts,
                        static=True))
    report["fused"] = {"slm": slm.fused, "llm": llm.fused}  # after warming: what ran
    report["packed"] = isinstance(llm, PackedSteps)
    report["folded"] = fold is not None
    report["block"] = block if drafts is not None else 1
    return report


def _llm_steps(llm, layout, capture, regions: Regions | None, speculate: int):
    """The LLM's captured steps: packed where its reads are fused (over ``regions``), else HF's forward in padded,
    gathering reads."""
    if regions is None:
        return PaddedSteps(llm, layout.llm_cache, capture, hidden=False, gather=True)
    kept = {False: layout.slots, True: layout.slots * (speculate + 1)}
    return PackedSteps(llm, layout.llm_cache, regions, kept, capture)


def _warm_llm(steps, layout, capture, speculate: int):
    """Capture the LLM's steps, and how many; where a packed read does not compile, the LLM's reads are HF's forward
    in padded steps instead (said once)."""
    if isinstance(steps, PaddedSteps):
        return steps, steps.warm(layout.tokens, speculate > 0)
    try:
        return steps, steps.warm(layout.tokens, span_buckets(layout.capacity))
    except RuntimeError as err:
        logger.warning("R2R captures the LLM's HF forward in padded reads: %s.", err)
        steps = PaddedSteps(steps.model, layout.llm_cache, capture, hidden=False, gather=True)
        return steps, steps.warm(layout.tokens, speculate > 0)
