"""The pieces of the speed benchmark: a router with a forced schedule, timing,
component costs (eager and captured) and the cost model they add up to."""

from __future__ import annotations

import math
import time

import torch
from transformers.cache_utils import DynamicCache

from r2r_hf.compat import cache_argument
from r2r_hf.core.fast.static_reads import BUCKETS, CapturedState, kept_lengths, pieces, read_fn, static_cache
from r2r_hf.core.features import lm_forward
from r2r_hf.core.fast.fused import attended
from r2r_hf.core.fast.fused_reads import static_read
from r2r_hf.router import Router

CHUNKS = (1, 2, 5, 10, 20, 64)  # catch-up chunk lengths whose eager cost is measured


def forced_rows(step: int, rows: int, share: float, per_row: bool, generator: torch.Generator) -> torch.Tensor:
    """Which rows ``ForcedRouter`` routes at ``step``: every row where floor((t+1)p) > floor(tp), or each row w.p. p."""
    if per_row:
        return torch.rand(rows, generator=generator) < share
    due = math.floor((step + 1) * share) > math.floor(step * share)
    return torch.full((rows,), due, dtype=torch.bool)


def schedule(share: float, rows: int, steps: int, per_row: bool, seed: int = 0) -> torch.Tensor:
    """[steps, rows] the forced decisions of a call (the cost model replays the same ones)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([forced_rows(t, rows, share, per_row, generator) for t in range(steps)])


class ForcedRouter(Router):
    """Runs a real router (its cost is paid) and routes on a fixed schedule instead of its scores.

    The schedule lives on the device and ``step`` (called eagerly once per decoding step) copies
    the step's row into ``due``, so ``scores`` stays a pure tensor function that the fast path
    captures like any router.

    Args:
        inner: the real router.
        rows, steps: the batch size and the longest call it routes.
    """

    def __init__(self, inner: Router, rows: int, steps: int) -> None:
        super().__init__()
        self.inner, self.step_index = inner, 0
        device = next(inner.parameters()).device
        self.register_buffer("table", torch.zeros(steps + 1, rows, dtype=torch.bool, device=device))
        self.register_buffer("due", torch.zeros(rows, dtype=torch.bool, device=device))

    def set_schedule(self, decisions: torch.Tensor) -> None:
        """Route as ``decisions`` [steps, rows] says (in place: captured steps keep reading the same memory)."""
        self.table.zero_()
        self.table[: len(decisions)] = decisions.to(self.table.device)

    def reset(self) -> None:
        self.step_index = 0

    def step(self) -> None:
        # Past the schedule it starts again: a speculating call takes more steps than it writes tokens (rollbacks)
        self.due.copy_(self.table[self.step_index % len(self.table)])
        self.step_index += 1

    def scores(self, topk_logits, token_embedding, hidden):
        real = self.inner.scores(topk_logits, token_embedding, hidden)
        return self.due.float() + 0 * real  # keeps the dependency on the real scores


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int, reset=None) -> float:
    """Best wall time of ``repeats`` runs after one warm-up; ``reset`` runs untimed after each run."""
    best = math.inf
    for run in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if run:
            best = min(best, time.perf_counter() - start)
        if reset is not None:
            reset()
    return best


def first_call(fn, device: str) -> float:
    """Seconds of one call (the first: compiles and captures happen here)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


@torch.no_grad()
def eager_components(slm, llm, router, batch: int, prompt: int, context: int, device: str, repeats: int) -> dict:
    """Eager seconds: t_SLM (one-token step), t_router, the SLM's prompt prefill, t_LLM(g) per chunk of g tokens.

    Steps and chunks run at ``context`` tokens of cache (mid-generation); prefills from an empty cache.
    """
    ids = torch.randint(0, 1000, (batch, context + 64), device=device)

    def forward_after(model, past: int, new: int, runs: int = repeats) -> float:
        if not past:  # a fresh cache per run, made outside the timed forward
            caches = [DynamicCache(config=model.config) for _ in range(runs + 1)]
            return timed(lambda: model(ids[:, :new], **cache_argument(caches.pop()), logits_to_keep=1), device, runs)
        cache = DynamicCache(config=model.config)
        model(ids[:, :past], **cache_argument(cache), logits_to_keep=1)
        return timed(lambda: model(ids[:, past : past + new], **cache_argument(cache), logits_to_keep=1),
                     device, runs, reset=lambda: cache.crop(-new))  # back to ``past`` tokens, untimed

    hidden = slm.config.hidden_size
    features = (torch.randn(batch, 100, device=device), torch.randn(batch, hidden, device=device),
                torch.randn(batch, hidden, device=device))
    out = {"t_slm": forward_after(slm, context, 1, repeats * 5),
           "t_router": timed(lambda: router.scores(*features), device, repeats * 5)}
    out["t_slm_prompt"] = forward_after(slm, 0, prompt)  # the SLM's own prefill, paid once per call
    out["t_llm"] = {g: forward_after(llm, context, g, repeats * 3) for g in CHUNKS}
    out["t_llm"][prompt] = forward_after(llm, 0, prompt)  # the first catch-up reads the prompt too
    return out


@torch.no_grad()
def captured_components(state: CapturedState, context: int, repeats: int, device: str) -> dict:
    """Seconds of each captured call of ``state`` at ``context`` tokens of cache (one replay each).

    Every timed read is wound back whole (``rewind`` = its bucket), so warm-ups, captures and
    repeats all write the same columns after ``context``: nothing runs past the cache
    (``context + BUCKETS[-1]`` must fit in it).
    """
    batch, capacity = state.batch, state.capacity
    if context + BUCKETS[-1] > capacity:
        raise ValueError(f"context {context} + the largest bucket {BUCKETS[-1]} exceeds the cache ({capacity}).")
    state.reset()
    ids = torch.randint(0, 1000, (batch, capacity), device=device)
    positions = torch.arange(capacity, device=device).expand(batch, capacity)
    mask = torch.ones(batch, capacity, dtype=torch.long, device=device)
    for model, cache in ((state.slm, state.slm_cache), (state.llm, state.llm_cache)):  # fill to ``context``
        model(ids[:, :context], attention_mask=mask[:, :context], position_ids=positions[:, :context],
              **cache_argument(cache), logits_to_keep=1)

    def piece(bucket: int) -> dict:
        return dict(ids=ids[:, context : context + bucket], positions=positions[:, context : context + bucket],
                    mask=mask, last=state.counts[bucket - 1 : bucket], rewind=state.counts[bucket])

    logits, hidden = state.read("slm", 1, state.span(context + 1), **piece(1))
    route = dict(logits=logits, hidden=hidden, token=logits.argmax(-1))
    out = {"t_slm": timed(lambda: state.read("slm", 1, state.span(context + 1), **piece(1)), device, repeats * 5),
           "t_router": timed(lambda: state.route(**route), device, repeats * 5), "t_llm": {}}
    for bucket in BUCKETS:
        chunk = piece(bucket)
        span = state.span(context + bucket)
        state.read("llm", bucket, span, **chunk)  # captured on first use, outside the timing
        out["t_llm"][bucket] = timed(lambda: state.read("llm", bucket, span, **chunk), device, repeats * 3)
    out["t_llm_every"] = {}  # a speculative resolution's read keeping every position's logits (captured)
    for bucket in BUCKETS:
        chunk = {**piece(bucket), "last": state.counts[:bucket]}
        state.read("llm", bucket, state.capacity, kept=bucket, **chunk)
        out["t_llm_every"][bucket] = timed(lambda: state.read("llm", bucket, state.capacity, kept=bucket, **chunk),
                                           device, repeats * 3)
    state.reset()
    return out


@torch.no_grad()
def graph_decode_per_token(model, prompt: torch.Tensor, tokens: int, graph_step, device: str, repeats: int,
                           regions=None) -> float:
    """Seconds per token of greedy decoding with ``model`` alone, its one-token step replayed as a graph.

    The compile-free baseline of the GPU check: an eager prefill of ``prompt`` [B, P] into a static
    cache, then ``tokens`` replays of the captured one-token read (the fast path's own ``read_fn``, or with
    ``regions`` its fused read ``fused_reads.static_read``, one graph per attended span as ``generate``
    captures them), each token fed back on the device: no host synchronisation at all, so a lower bound for
    the LLM alone. The graphs are captured in the first (untimed) run.
    """
    batch, length = prompt.shape
    capacity = length + tokens + BUCKETS[-1]
    cache = static_cache(model, batch, capacity)
    ids = torch.zeros(batch, capacity, dtype=torch.long, device=device)
    ids[:, :length] = prompt
    positions = torch.arange(capacity, device=device).expand(batch, capacity)
    mask = torch.ones(batch, capacity, dtype=torch.long, device=device)
    counts = torch.arange(2, device=device)
    pool, steps = graph_step.new_pool(device), {}

    def inputs(t: int) -> dict:
        return dict(ids=ids[:, t : t + 1], positions=positions[:, t : t + 1], mask=mask, last=counts[0:1],
                    rewind=counts[0])

    def step(t: int):
        span = attended(t + 1, capacity) if regions is not None else capacity
        if span not in steps:
            read = read_fn(model, cache, hidden=False) if regions is None else static_read(model, cache, False, span,
                                                                                             regions)
            with kept_lengths(cache):
                steps[span] = graph_step(read, inputs(t), pool)
        return steps[span]

    def run() -> None:
        cache.reset()
        logits = lm_forward(model, prompt, None, positions[:, :length], cache)[:, -1]
        for t in range(length, length + tokens):
            ids[:, t] = logits.argmax(-1)
            logits = step(t)(**inputs(t))[0]

    return timed(run, device, repeats) / tokens


def t_llm_at(chunk: float, table: dict[int, float], captured: dict[int, float] | None = None) -> float:
    """Catch-up cost of ``chunk`` tokens: its captured pieces' replays, else eager, interpolated between sizes."""
    if captured is not None:
        return sum(captured[bucket] for _, bucket in pieces(math.ceil(chunk)))
    sizes = sorted(table)
    if chunk <= sizes[0]:
        return table[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if chunk <= high:
            return table[low] + (table[high] - table[low]) * (chunk - low) / (high - low)
    low, high = sizes[-2], sizes[-1]
    return table[high] + (table[high] - table[low]) * (chunk - high) / (high - low)


def llm_call_steps(decisions: torch.Tensor) -> list[int]:
    """The steps at which some row routes (the LLM runs for the whole batch there)."""
    return decisions.any(1).nonzero().flatten().tolist()


def ideal_per_token(calls: list[int], parts: dict, eager: dict, prompt: int, tokens: int) -> float:
    """The cost model per generated token: t_SLM + t_router, plus the LLM's catch-up forwards.

    ``parts`` gives t_SLM, t_router (and, for the captured path, the bucket replays in
    ``parts["t_llm"]``); ``eager`` gives the SLM's prompt prefill and the eager chunk costs. The
    prefill is spread over the generated tokens, as in ``slm.generate``. At each step in ``calls``
    the LLM reads every token since its previous call (the first call also reads the prompt).
    """
    captured = parts["t_llm"] if parts is not eager else None
    seen, total = 0, 0.0
    for step in calls:
        total += t_llm_at(prompt + step - seen, eager["t_llm"], captured)
        seen = prompt + step
    return parts["t_slm"] + parts["t_router"] + eager["t_slm_prompt"] / tokens + total / tokens
