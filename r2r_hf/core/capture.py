"""The fast path: the loop's fixed-shape model calls, captured once and replayed.

A decoding step on a GPU is launch-bound when run eagerly: a 1.5B SLM step costs ~18 ms of
kernel launches for ~1 ms of weight reads. With ``cache_implementation="static"`` the shapes
of three calls are fixed, so they are captured and replayed:

* the SLM's one-token step (ids [B, 1], the whole mask buffer, the static cache);
* the router on the SLM's proposal (top-k logits, the proposal's embedding, the hidden state);
* the LLM's catch-up, padded up to a bucket of ``BUCKETS`` tokens: the padding sits at the end of
  the chunk, no real token attends to it, only the last real token's logits are computed, and the
  cache's length is wound back so the next chunk overwrites the padding. Chunks longer than the
  largest bucket (the first one, which holds the prompt) run eagerly.

How: with a ``compile_config``, ``torch.compile`` with its options (as HF's own generate does);
otherwise, on CUDA, plain CUDA-graph capture of the eager forward, which costs one forward
per shape instead of an inductor compile per shape (minutes for a 32B over seven buckets).
Either way the outputs of a replay are copied out before anything else runs: the next replay
overwrites them. The static caches and the captured calls are kept between generate calls in
the model's ``CaptureStore`` (as HF keeps its static cache), and rebuilt when the batch size,
the pair, the router or the compile options change, or a call needs a longer cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator

import torch
from transformers import GenerationConfig
from transformers.cache_utils import StaticCache, StaticLayer

from .engines import EagerSteps, Steps, route_scores
from .features import HiddenStateCapture, input_device, lm_forward, output_device
from .steps import Committed

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SLACK = BUCKETS[-1]  # a padded chunk may run this far past the committed tokens
# Device types on which a static-cache call is captured with plain graphs (no ``compile_config`` needed).
GRAPH_DEVICE_TYPES = ("cuda",)
_COMPILE_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options")


def bucket_for(tokens: int) -> int | None:
    """The smallest bucket holding ``tokens``, or None when the chunk runs eagerly."""
    return next((b for b in BUCKETS if b >= tokens), None)


def capturable(model: torch.nn.Module) -> str | None:
    """Why ``model``'s forward cannot be captured with fixed shapes, or None when it can.

    Capture needs one device, dense weights and a static cache whose layers keep their length
    in a device tensor (sliding-window layers count in Python and would replay a stale length).
    """
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "it is spread over several devices"
    if getattr(model, "hf_quantizer", None) is not None:
        return "it is quantised"
    if input_device(model) != output_device(model):
        return "its input and output layers are on different devices"
    if not all(type(layer) is StaticLayer for layer in StaticCache(config=model.config, max_cache_len=1).layers):
        return "its static cache has sliding-window layers"
    return None


def choose_steps(
    slm, llm, router, num_topk: int, generation_config: GenerationConfig, batch: int, needed: int,
    store: CaptureStore | None,
) -> Steps:
    """The engine one call runs on, decided as HF decides to compile.

    Eager unless ``cache_implementation="static"`` and not ``disable_compile``; then captured
    through ``torch.compile`` when a ``compile_config`` is given, through CUDA graphs on CUDA, and
    eager otherwise (or when the SLM cannot be captured).

    Args:
        slm, llm, router: the pair and the router.
        num_topk: sorted SLM logits the router reads.
        generation_config: the call's generation config.
        batch: rows in the call.
        needed: the call's longest sequence (prompt + max_new_tokens).
        store: the model's ``CaptureStore``, or None to run eagerly.
    """
    kind, compile_config = generation_config.cache_implementation, generation_config.compile_config
    eager = kind != "static" or generation_config.disable_compile or store is None
    if not eager and compile_config is None and output_device(slm).type not in GRAPH_DEVICE_TYPES:
        eager = True
    state = None if eager else store.state_for(slm, llm, router, num_topk, compile_config, batch, needed)
    return EagerSteps(slm, llm, router, num_topk, kind, needed) if state is None else CapturedSteps(state)


# ------------------------------------------------------------------ the fixed-shape calls
def slm_step_fn(slm: torch.nn.Module, cache: StaticCache) -> Callable:
    """The SLM's one-token step: (ids [B, 1], positions [B, 1], mask [B, L]) -> (logits [B, V], hidden [B, H]).

    The hidden state comes from ``output_hidden_states`` (one token: a few KB) because a hook
    does not survive compilation.
    """

    def slm_step(ids, positions, mask):
        out = slm(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                  logits_to_keep=1, output_hidden_states=True, return_dict=True)
        return out.logits[:, -1], out.hidden_states[-1][:, -1]

    return slm_step


def router_fn(slm: torch.nn.Module, router: torch.nn.Module, k: int) -> Callable:
    """The router on the SLM's proposal: (logits, hidden, token) -> scores [B]."""

    def route(logits, hidden, token):
        return (route_scores(slm, router, k, logits, hidden, token),)

    return route


def llm_chunk_fn(llm: torch.nn.Module, cache: StaticCache) -> Callable:
    """The LLM reading a padded chunk: (ids, positions [B, b], mask [B, L], last [1], rewind []) -> (logits [B, V],).

    ``last`` indexes the chunk's last real token (only its logits are computed); the padding
    after it is written to the cache, then the cache's length is wound back by ``rewind``
    so that the next chunk overwrites it. No real token ever attends to padding: it sits
    after every real token of the chunk.
    """

    def llm_chunk(ids, positions, mask, last, rewind):
        out = llm(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
                  logits_to_keep=last, return_dict=True)
        for layer in cache.layers:
            layer.cumulative_length.sub_(rewind)
        return (out.logits[:, -1],)

    return llm_chunk


# ------------------------------------------------------------------ capturing
class CudaGraphStep:
    """``fn`` captured as one CUDA graph: inputs are copied into static buffers, outputs copied out.

    Args:
        fn: a function of tensors returning a tuple of tensors, without host synchronisation.
        example: one set of real inputs (fixes the shapes; the warm-up runs on them).
        pool: the memory pool shared by the graphs of one state (they never run concurrently).
    """

    def __init__(self, fn: Callable, example: dict[str, torch.Tensor], pool) -> None:
        self.inputs = {name: value.clone() for name, value in example.items()}
        self.copied: dict[str, torch.Tensor] = {}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up runs eagerly, off the capture
            for _ in range(2):
                fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(**self.inputs)

    def __call__(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for name, value in inputs.items():
            # The same tensor object as last time holds the same values (the loop never writes into
            # the mask buffer of a call), so one copy per call is enough.
            if self.copied.get(name) is not value:
                self.inputs[name].copy_(value)
                self.copied[name] = value
        self.graph.replay()
        return tuple(out.clone() for out in self.outputs)


class CompiledStep:
    """``fn`` through ``torch.compile``; outputs are copied out (with CUDA graphs the next call overwrites them).

    Args:
        fn: a function of tensors returning a tuple of tensors.
        options: ``torch.compile`` options (from the call's ``CompileConfig``).
    """

    def __init__(self, fn: Callable, options: dict) -> None:
        self.fn = torch.compile(fn, **options)
        self.cudagraphs = options.get("mode") in ("reduce-overhead", "max-autotune")

    def __call__(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs may be overwritten now
        return tuple(out.clone() for out in self.fn(**inputs))


@contextlib.contextmanager
def kept_lengths(*caches: StaticCache) -> Iterator[None]:
    """Restore the caches' lengths afterwards: capturing runs the step (warm-up) without committing it.

    What the warm-up wrote lies past the committed tokens, where the next real step writes again.
    """
    saved = [[layer.cumulative_length.clone() for layer in cache.layers] for cache in caches]
    try:
        yield
    finally:
        for cache, lengths in zip(caches, saved):
            for layer, length in zip(cache.layers, lengths):
                layer.cumulative_length.copy_(length)


def static_cache(model: torch.nn.Module, batch: int, length: int) -> StaticCache:
    """A static cache allocated up front, so no capture ever allocates it."""
    cache = StaticCache(config=model.config, max_cache_len=length)
    shape = model._get_static_cache_init_shape()  # private HF hook (tests/test_hf_internals.py guards it)
    if shape is not None:
        cache.early_initialization(batch, *shape, dtype=model.dtype, device=output_device(model))
    return cache


class CapturedState:
    """Static caches for one batch size and capacity, and the calls captured over them.

    Captures happen on first use of each shape, so a call pays only for the shapes it meets.

    Args:
        slm, llm, router, num_topk: what the steps run.
        compile_config: torch.compile options, or None for CUDA graphs.
        batch, capacity: the shapes (capacity = longest sequence + ``SLACK``).
        capture_llm: False keeps the LLM's catch-up eager (it cannot be captured).
    """

    def __init__(self, slm, llm, router, num_topk: int, compile_config, batch: int, capacity: int,
                 capture_llm: bool) -> None:
        self.slm, self.llm, self.router, self.num_topk = slm, llm, router, num_topk
        self.batch, self.capacity, self.capture_llm = batch, capacity, capture_llm
        self.slm_cache, self.llm_cache = static_cache(slm, batch, capacity), static_cache(llm, batch, capacity)
        if compile_config is not None:
            options = {k: v for k, v in compile_config.to_dict().items() if k in _COMPILE_OPTIONS}
            self.capture = lambda fn, example: CompiledStep(fn, options)
        else:
            pool = torch.cuda.graph_pool_handle() if output_device(slm).type == "cuda" else None
            self.capture = lambda fn, example: CAPTURERS["cuda-graph"](fn, example, pool)
        self.key = state_key(slm, llm, router, num_topk, compile_config, batch)
        self._slm_step: Callable | None = None
        self._route: Callable | None = None
        self._llm_chunks: dict[int, Callable] = {}
        # Views of this tensor give a chunk's ``last`` index and ``rewind`` count without a host copy.
        self.counts = torch.arange(SLACK + 1, device=output_device(llm))

    def reset(self) -> None:
        """Empty both caches in place (captured calls keep pointing at the same memory)."""
        self.slm_cache.reset()
        self.llm_cache.reset()

    def slm_step(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._slm_step is None:
            with kept_lengths(self.slm_cache):
                self._slm_step = self.capture(slm_step_fn(self.slm, self.slm_cache), inputs)
        return self._slm_step(**inputs)

    def route(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._route is None:
            self._route = self.capture(router_fn(self.slm, self.router, self.num_topk), inputs)
        return self._route(**inputs)

    def llm_chunk(self, bucket: int, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if bucket not in self._llm_chunks:
            with kept_lengths(self.llm_cache):
                self._llm_chunks[bucket] = self.capture(llm_chunk_fn(self.llm, self.llm_cache), inputs)
        return self._llm_chunks[bucket](**inputs)


CAPTURERS: dict[str, Callable] = {"cuda-graph": CudaGraphStep}


def state_key(slm, llm, router, num_topk: int, compile_config, batch: int) -> tuple:
    """What a stored state was built for: the same objects (identity), options and batch size."""
    options = None if compile_config is None else json.dumps(compile_config.to_dict(), sort_keys=True, default=str)
    return (slm, llm, router, num_topk, options, batch)


class CaptureStore:
    """The captured calls and their static caches, kept between generate calls (one state at a time)."""

    def __init__(self) -> None:
        self.state: CapturedState | None = None

    def clear(self) -> None:
        self.state = None

    def state_for(self, slm, llm, router, num_topk: int, compile_config, batch: int, needed: int) -> CapturedState | None:
        """A reset state for this call, reusing the stored one when it fits; None when the SLM cannot be captured."""
        key = state_key(slm, llm, router, num_topk, compile_config, batch)
        state = self.state
        if state is None or state.key != key or state.capacity < needed + SLACK:
            self.state = None  # free the old caches and graphs before allocating new ones
            why_not = capturable(slm)
            if why_not is not None:
                logger.warning("R2R runs eagerly: the SLM cannot be captured (%s).", why_not)
                return None
            llm_why_not = capturable(llm)
            if llm_why_not is None and output_device(llm) != output_device(slm):
                llm_why_not = "it is on another device than the SLM"
            if llm_why_not is not None:
                logger.warning("R2R captures the SLM step only: the LLM cannot be captured (%s).", llm_why_not)
            state = CapturedState(slm, llm, router, num_topk, compile_config, batch, needed + SLACK,
                                  capture_llm=llm_why_not is None)
            self.state = state
        state.reset()
        return state


class CapturedSteps:
    """The loop's calls for one generate call over a ``CapturedState`` (see the module docstring)."""

    def __init__(self, state: CapturedState) -> None:
        self.state, self.capacity = state, state.capacity
        self.capture_router = getattr(state.router, "capturable", True)

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        end, s = seq.length, self.state
        if end - start == 1:
            return s.slm_step(ids=seq.ids[:, start:end], positions=seq.positions[:, start:end], mask=seq.mask)
        with HiddenStateCapture(s.slm) as capture:  # the prompt: one eager prefill
            logits = lm_forward(s.slm, seq.ids[:, start:end], seq.mask_upto(end), seq.positions[:, start:end],
                                s.slm_cache)
            return logits[:, -1], capture.hidden[:, -1]

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        s = self.state
        if not self.capture_router:  # a stateful baseline (the random router) runs eagerly
            return route_scores(s.slm, s.router, s.num_topk, logits, hidden, token)
        return s.route(logits=logits, hidden=hidden, token=token)[0]

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor:
        end, s = seq.length, self.state
        tokens = end - start
        bucket = bucket_for(tokens) if s.capture_llm else None
        if bucket is None:
            logits = lm_forward(s.llm, seq.ids[:, start:end], seq.mask_upto(end), seq.positions[:, start:end],
                                s.llm_cache)
            return logits[:, -1]
        stop = start + bucket
        return s.llm_chunk(bucket, ids=seq.ids[:, start:stop], positions=seq.positions[:, start:stop], mask=seq.mask,
                           last=s.counts[tokens - 1 : tokens], rewind=s.counts[bucket - tokens])[0]
