"""CUDA-graph capture, emulated on the CPU, as strictly as the real thing behaves.

``EmulatedGraphStep`` is ``capture.CudaGraphStep`` with only the CUDA primitives replaced:

* a replay re-runs the captured function on the step's static input buffers and writes its
  results into the same output tensors every time, so anything that keeps a reference to a
  previous replay's outputs sees them overwritten, as with a real graph;
* every run happens "during capture" as transformers sees it (``is_cuda_stream_capturing``), so
  the library takes the paths it would take under a real capture;
* a host synchronisation inside the function (``.item()``, ``bool(tensor)``, ``nonzero``...)
  raises, because a real capture would fail on it.
"""

from __future__ import annotations

import contextlib
from unittest import mock

from torch.utils._python_dispatch import TorchDispatchMode

from r2r_hf.core.capture import CudaGraphStep

# Ops that copy device data to the host (or need it to size their output): illegal under capture.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item", "aten::nonzero", "aten::equal",
            "aten::masked_select", "aten::unique", "aten::_unique2"}


class HostSyncError(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raise on any op that would synchronise the host with the device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNC_OPS:
            raise HostSyncError(f"{func._schema.name} synchronises the host inside a captured step")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def as_if_capturing():
    with mock.patch("transformers.utils.import_utils.is_cuda_stream_capturing", return_value=True), NoHostSync():
        yield


class _Graph:
    def __init__(self, step: EmulatedGraphStep) -> None:
        self.step = step

    def replay(self) -> None:
        with as_if_capturing():
            fresh = self.step.fn(**self.step.inputs)
        for out, new in zip(self.step.outputs, fresh):
            out.copy_(new)


class EmulatedGraphStep(CudaGraphStep):
    """``CudaGraphStep`` on the CPU: same copy-in / replay / copy-out, emulated replay (see the module docstring)."""

    captures = 0

    def __init__(self, fn, example, pool) -> None:
        type(self).captures += 1
        self.fn = fn
        self.inputs = {name: value.clone() for name, value in example.items()}
        self.copied = {}
        fn(**self.inputs)  # the warm-up runs eagerly, as on CUDA
        with as_if_capturing():
            self.outputs = fn(**self.inputs)  # on CUDA capture records without running: lengths are restored
        self.graph = _Graph(self)


def emulate_cuda_graphs(monkeypatch) -> type[EmulatedGraphStep]:
    """Make CPU static-cache calls take the CUDA-graph path, with emulated graphs; returns the step class."""
    from r2r_hf.core import capture

    step_class = type("Step", (EmulatedGraphStep,), {"captures": 0})
    monkeypatch.setitem(capture.CAPTURERS, "cuda-graph", step_class)
    monkeypatch.setattr(capture, "GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    return step_class
