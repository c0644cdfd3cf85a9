"""How a fixed-shape step is captured: a CUDA graph of its eager forward, or ``torch.compile``.

A *step* is a function of tensors that returns a tuple of tensors and never synchronises the host.
A captured step is called like the function and returns copies of its outputs: a replay writes
its outputs into the same memory every time (and graphs sharing a pool may overwrite each other's),
so nothing a caller keeps may point into that memory.

What is captured, over which caches and when, is ``static_reads.py``'s and ``slot_reads.py``'s business; this module only
knows how, and which ops a capture cannot take (``sync_problem``; ``host_work``: the first such op of a step, which
``core/probes.host_work_problem`` asks of a model's one-token read). ``GraphStep`` is the interface a ``CaptureStore`` is given (the CPU emulation in
``r2r_hf.testing.graphs`` implements it too).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode


Step = Callable[..., tuple[torch.Tensor, ...]]

# Ops that copy device data to the host or need it to size their output.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::nonzero", "aten::argwhere",
            "aten::equal", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2",
            "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount",
            "aten::lift_fresh"}  # lift_fresh: torch.tensor() from host data
# Random draws: a graph replays the offsets recorded at capture.
RNG_OPS = {"aten::rand", "aten::randn", "aten::randint", "aten::randperm", "aten::rand_like", "aten::randn_like",
           "aten::randint_like", "aten::multinomial", "aten::bernoulli", "aten::bernoulli_", "aten::normal",
           "aten::normal_", "aten::uniform_", "aten::random_", "aten::exponential_", "aten::cauchy_",
           "aten::log_normal_", "aten::geometric_", "aten::native_dropout", "aten::poisson"}
INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def flat(values: Any) -> Iterator[Any]:
    """Every leaf of nested lists, tuples and dicts."""
    if isinstance(values, (list, tuple)):
        for v in values:
            yield from flat(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from flat(v)
    else:
        yield values


def sync_problem(func, args: tuple, kwargs: dict) -> str | None:
    """Why the dispatched op ``func`` (an aten overload) cannot be captured, or None."""
    name = func._schema.name
    if name == "aten::lift_fresh":
        return f"{name} makes a tensor from host data"
    if name in SYNC_OPS:
        return f"{name} copies device data to the host"
    if name in RNG_OPS:
        return f"{name} draws random numbers (a graph replays the captured draw)"
    if name == "aten::repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") and \
            kwargs.get("output_size", args[3] if len(args) > 3 else None) is None:
        return "repeat_interleave with tensor repeats and no output_size sizes its output on the host"
    if name in INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in flat(indices)):
            return f"{name} with a boolean mask sizes its result on the host"
    return None


class _HostWork(TorchDispatchMode):
    """Notes the first op that a capture could not take (``sync_problem``), running every op as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.problem: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.problem is None:
            self.problem = sync_problem(func, args, kwargs)
        return func(*args, **kwargs)


def host_work(fn: Callable[[], Any]) -> str | None:
    """Why ``fn`` (a model's step) could not run inside a capture, or None: its first op that works on the host."""
    with _HostWork() as mode:
        fn()
    return mode.problem


class GraphStep(Protocol):
    """A step captured once on example inputs and replayed on new ones."""

    def __init__(self, fn: Step, example: dict[str, torch.Tensor], pool: Any) -> None: ...

    def __call__(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def run(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The captured outputs themselves, valid until the pool's next replay (``CudaGraphStep.run``)."""

    @classmethod
    def new_pool(cls, device: torch.device) -> Any: ...


_gc_lock = threading.Lock()
_gc_state = {"depth": 0, "was_enabled": True}


@contextmanager
def recompile_limit(compiles: int) -> Iterator[None]:
    """Dynamo's recompile limits raised to at least ``compiles`` while it lasts, a hit made an error
    (``FailOnRecompileLimitHit``): whatever compiles inside compiles in full or fails, never runs uncompiled."""
    import torch._dynamo.config as config

    # Named so since torch 2.6 (the older names are aliases there); torch 2.4-2.5 know only the older ones.
    names = [(new if hasattr(config, new) else old) for new, old in (
        ("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
        ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"))]
    values = [max(getattr(config, names[0]), compiles), max(getattr(config, names[1]), compiles), True]
    with config.patch(**dict(zip(names, values))):
        yield


@contextmanager
def gc_paused(collect: bool = False) -> Iterator[None]:
    """Python's garbage collector off inside (re-entrant); with ``collect``, one collection first, at the outermost
    entry only (the caller about to capture many graphs collects once, not per graph).

    Why: since torch 2.9 ``torch.cuda.graph`` no longer collects on entry, and a dead graph (a reference cycle
    holding a ``CUDAGraph``) that the collector frees while another graph is being captured invalidates that
    capture (pytorch#158193, #161037); vLLM and SGLang turn the collector off around their captures too.
    """
    with _gc_lock:
        if _gc_state["depth"] == 0:
            if collect:
                gc.collect()
            _gc_state["was_enabled"] = gc.isenabled()
            gc.disable()
        _gc_state["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_state["depth"] -= 1
            if _gc_state["depth"] == 0 and _gc_state["was_enabled"]:
                gc.enable()


class GraphPool:
    """The memory pool the graphs of one captured state share, and the one side stream their warm-ups run on
    (a fresh stream per graph only multiplies streams; one per pool is what torch's recipe needs)."""

    def __init__(self, device: torch.device) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)


class CudaGraphStep:
    """``fn`` captured as one CUDA graph: inputs are copied into static buffers, outputs copied out.

    Args:
        fn: a step (see the module docstring).
        example: one set of real inputs (fixes the shapes; the warm-up runs on them).
        pool: the ``GraphPool`` of one captured state (its graphs never run concurrently).
    """

    def __init__(self, fn: Step, example: dict[str, torch.Tensor], pool: GraphPool) -> None:
        self.inputs = {name: value.clone() for name, value in example.items()}
        self.copied: dict[str, torch.Tensor] = {}
        with gc_paused():  # no collection between the warm-up and the end of the capture (``gc_paused``)
            stream = pool.stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # the warm-up runs eagerly, off the capture
                for _ in range(2):
                    fn(**self.inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool.handle):
                self.outputs = fn(**self.inputs)

    @classmethod
    def new_pool(cls, device: torch.device) -> GraphPool:
        return GraphPool(device)

    def __call__(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.clone() for out in self.run(**inputs))

    def run(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Replay on ``inputs``; the captured outputs themselves, which the pool's next replay overwrites: for a
        caller that takes what it keeps out of them at once (a gather of some rows copies them: no clone first)."""
        for name, value in inputs.items():
            # The same tensor object as last time holds the same values (the loop never writes into
            # the mask buffer of a call, and ``copied`` keeps it alive), so one copy per call is enough.
            if self.copied.get(name) is not value:
                self.inputs[name].copy_(value)
                self.copied[name] = value
        self.replay()
        return tuple(self.outputs)

    def replay(self) -> None:
        self.graph.replay()


class CompiledStep:
    """``fn`` through ``torch.compile``; outputs are copied out (with CUDA graphs the next call overwrites them).

    Args:
        fn: a step (see the module docstring).
        options: ``torch.compile`` options (from the call's ``CompileConfig``).
    """

    def __init__(self, fn: Step, options: dict) -> None:
        self.fn = torch.compile(fn, **options)
        self.cudagraphs = options.get("mode") in ("reduce-overhead", "max-autotune")

    def __call__(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(out.clone() for out in self.run(**inputs))

    def run(self, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs as the compiled function returns them (with CUDA graphs, overwritten by the next call)."""
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs may be overwritten now
        return tuple(self.fn(**inputs))


# torch.compile options a ``CompileConfig`` carries.
COMPILE_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options")


def compile_options(compile_config) -> dict:
    """The ``torch.compile`` keyword arguments of an HF ``CompileConfig``."""
    return {k: v for k, v in compile_config.to_dict().items() if k in COMPILE_OPTIONS}
