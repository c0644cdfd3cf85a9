"""CUDA-graph capture emulated on the CPU, as strictly as the real thing behaves.

``EmulatedGraphStep`` is ``core.graphs.CudaGraphStep`` with only the CUDA primitives replaced, for
tests and for the dry run of the GPU check (``benchmarks/gpu/check.sh --dry-run``):

* **Host synchronisation fails.** Inside the captured function, an op that copies device data to
  the host or needs it to size its output raises ``HostSyncError``, as a real capture fails on it:
  ``.item()``/``bool()``/``int()`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``.to("cpu")``, ``nonzero``, boolean-mask indexing and assignment, ``masked_select``, ``unique``,
  ``bincount``, ``repeat_interleave`` without ``output_size``, ``torch.tensor(...)`` from host data,
  and random draws (a graph would replay the same draw, off the generator the loop keeps exact).
  On a CPU ``.to(torch.device("cpu"))`` cannot be told from a move onto the model's own device, so
  only the string form ``"cpu"`` is caught.
* **A replay does not re-run Python's decisions.** A real graph replays the kernels recorded at
  capture. The emulation runs the function again, records every op with the tensors it reads
  (by address for tensors made before the step, by the op that made them otherwise) and its
  non-tensor arguments, and raises ``ReplayMismatch`` where that differs from the capture: a
  decision taken in Python on changing state (a length counted on the host, say) would have been
  frozen by the real graph. Nor does a replay keep what Python wrote: the numbers a step writes into
  the objects it closes over (a counter kept in Python) are put back after each replay, as after a real
  one, which never ran the Python that wrote them.
* **Outputs are overwritten.** Each replay writes its results into the same output tensors, so a
  reference kept from an earlier replay sees them change, and every replay poisons (NaN, or -1 for
  integers) the outputs of the other graphs of its memory pool, which a real replay may overwrite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.fast.graphs import CudaGraphStep, Step, flat, gc_paused, sync_problem

HOST_METHODS = {torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()", torch.Tensor.cpu: ".cpu()",
                torch.Tensor.item: ".item()"}


class HostSyncError(RuntimeError):
    """An op inside a captured step would synchronise the host (a real capture fails on it)."""


class ReplayMismatch(RuntimeError):
    """A replay took another path than the capture (a real graph would have replayed the captured one)."""


class _Trace:
    """The ops of one run: name, tensors read (pre-existing by address, made in the run by producer) and arguments."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self._made: dict[int, tuple[int, int]] = {}  # storage address -> (op index, output index)

    def _describe(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            address = value.untyped_storage().data_ptr()
            origin = ("made", self._made[address]) if address in self._made else ("before", address)
            return origin + (value.storage_offset(), tuple(value.shape), value.stride(), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(self._describe(v) for v in value)
        if isinstance(value, float):
            return repr(value)
        return value if isinstance(value, (int, bool, str, type(None))) else repr(value)

    def record(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        self.ops.append((name, self._describe(args), tuple(sorted((k, self._describe(v)) for k, v in kwargs.items()))))
        for i, value in enumerate(flat(out)):
            if isinstance(value, torch.Tensor):
                self._made[value.untyped_storage().data_ptr()] = (len(self.ops) - 1, i)

    def first_difference(self, other: _Trace) -> str | None:
        for i, (a, b) in enumerate(zip(self.ops, other.ops)):
            if a != b:
                return f"op {i}: captured {a[0]} {a[1:]}, replayed {b[0]} {b[1:]}"
        if len(self.ops) != len(other.ops):
            return f"captured {len(self.ops)} ops, replayed {len(other.ops)}"
        return None


class _NoHostSync(TorchDispatchMode):
    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        problem = sync_problem(func, args, kwargs)
        if problem:
            raise HostSyncError(f"{problem}: it cannot run inside a captured step")
        out = func(*args, **kwargs)
        self.trace.record(func._schema.name, args, kwargs, out)
        return out


class _NoHostCalls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = HOST_METHODS.get(func)
        if what is None and func is torch.Tensor.to and any(a == "cpu" for a in (*args[1:], *kwargs.values())
                                                            if isinstance(a, str)):
            what = '.to("cpu")'
        if what is not None:
            raise HostSyncError(f"{what} copies device data to the host: it cannot run inside a captured step")
        return func(*args, **kwargs)


def _compiled_region(trace: _Trace):
    """How a compiled region (``core.fused_reads``) runs under the emulation: outside its modes, recorded as one op.

    torch.compile runs no compiled code under a user's dispatch mode, and a function mode its code was not
    compiled under fails its guards. Inside the region nothing can synchronise the host (``fullgraph``: one
    graph of device ops, guards read shapes only); what the emulation checks is its inputs, as an op's."""

    def run(fn, args: tuple):
        with torch.utils._python_dispatch._disable_current_modes(), torch.overrides._pop_mode_temporarily():
            out = fn(*args)
        trace.record(f"region {getattr(fn, '__name__', fn)}", args, {}, out)
        return out

    return run


@contextlib.contextmanager
def as_if_capturing(trace: _Trace | None = None) -> Iterator[_Trace]:
    """Run as under a real capture: transformers sees a capturing stream, host syncs raise; yields the op trace."""
    from ..core.fast import fused_reads

    trace = trace if trace is not None else _Trace()
    with mock.patch("transformers.utils.import_utils.is_cuda_stream_capturing", return_value=True), \
            mock.patch.object(fused_reads, "region_runner", _compiled_region(trace)), _NoHostCalls(), _NoHostSync(trace):
        yield trace


def _python_numbers(fn, depth: int = 4) -> list[tuple[Any, str, Any]]:
    """(object, attribute, value) of every number attribute of the objects ``fn`` closes over (through the functions
    it closes over, ``depth`` deep)."""
    found, seen, todo = [], set(), [(fn, depth)]
    while todo:
        value, left = todo.pop()
        if id(value) in seen or left < 0:
            continue
        seen.add(id(value))
        if callable(value) and getattr(value, "__closure__", None):
            todo += [(cell.cell_contents, left - 1) for cell in value.__closure__ if _filled(cell)]
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            found += [(value, k, v) for k, v in vars(value).items() if isinstance(v, (int, float))]
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet filled
        return False
    return True


class EmulatedPool:
    """The graphs sharing one memory pool: a replay (or a capture) may overwrite the others' outputs."""

    def __init__(self) -> None:
        self.steps: list[EmulatedGraphStep] = []

    def ran(self, step: EmulatedGraphStep) -> None:
        for other in self.steps:
            if other is not step:
                for out in other.outputs:
                    out.fill_(float("nan") if out.is_floating_point() else -1)


class EmulatedGraphStep(CudaGraphStep):
    """``CudaGraphStep`` on the CPU: same copy-in / replay / copy-out, emulated graphs (see the module docstring).

    ``captures`` counts the captures made through this class (subclass it to count separately).
    """

    captures = 0

    def __init__(self, fn: Step, example: dict[str, torch.Tensor], pool: EmulatedPool) -> None:
        type(self).captures += 1
        self.fn, self.pool = fn, pool
        self.inputs = {name: value.clone() for name, value in example.items()}
        self.copied: dict[str, torch.Tensor] = {}
        with gc_paused():  # as on CUDA: no collection from the warm-up to the end of the capture
            fn(**self.inputs)  # the warm-up runs eagerly, as on CUDA (the caller restores the cache's length)
            with as_if_capturing() as trace:
                self.outputs = fn(**self.inputs)
        self.trace = trace
        pool.steps.append(self)
        pool.ran(self)

    @classmethod
    def new_pool(cls, device: torch.device) -> EmulatedPool:
        return EmulatedPool()

    def replay(self) -> None:
        kept = _python_numbers(self.fn)
        with as_if_capturing() as trace:
            fresh = self.fn(**self.inputs)
        for owner, name, value in kept:  # a real replay runs no Python: nothing it wrote stays
            setattr(owner, name, value)
        difference = self.trace.first_difference(trace)
        if difference is not None:
            raise ReplayMismatch(f"the step took another path at replay than at capture ({difference}); a CUDA graph "
                                 "replays the captured path, so its result would differ from the eager one")
        for out, new in zip(self.outputs, fresh):
            out.copy_(new)
        self.pool.ran(self)


def emulated_store(graph_step: type[EmulatedGraphStep] = EmulatedGraphStep, fuse: bool = False):
    """A ``CaptureStore`` that captures static-cache calls on the CPU too, with emulated graphs.

    ``fuse``: capture fused reads (inductor compiles each region on the CPU: tens of seconds cold), not HF's forward.
    """
    from ..core.fast.store import CaptureStore

    return CaptureStore(graph_step=graph_step, graph_devices=("cuda", "cpu"), fuse=fuse)
