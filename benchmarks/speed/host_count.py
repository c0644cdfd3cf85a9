"""Counting, on a CPU, the host work a decoding step would cost on a GPU (``benchmarks/speed/host_ops.py`` uses it).

On a CPU everything lives in one memory, so nothing here copies or waits; what is counted is what each call would
do on a GPU, decided from the call and its arguments. A ``TorchFunctionMode`` sees the Python-level calls (with
their ``device`` and ``non_blocking`` arguments), a ``TorchDispatchMode`` the aten ops under them:

* **syncing host-to-device copy** (``h2d``): ``torch.tensor``/``as_tensor``/``Tensor.new_tensor`` of host data
  (lists, numbers) onto the decoding device; ``.to(device)``, ``.cuda()`` or ``copy_`` of a host tensor without
  ``non_blocking`` (with it: ``h2d_async``; on a GPU only a pinned source makes it so); indexing with a Python list
  (torch makes an index tensor of it and copies it); a host tensor of more than one element given to an op beside
  device tensors (torch copies it over). A pageable copy blocks the host until the stream has drained. A tensor is
  a *host* tensor when it was made from host data or by a factory without a device (``torch.zeros(3)``, or
  ``device="cpu"`` as a string: the decoding device is always a ``torch.device`` in this code), or derived from
  host tensors only; every other tensor is on the decoding device.
* **device-to-host read** (``d2h``): ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``,
  ``bool()``/``int()``/``float()`` of a device tensor, and ops that size their output on the host (``nonzero``,
  boolean-mask indexing, ``unique``...: ``r2r_hf.testing.graphs.sync_problem``, the emulation's own list).
* **eager op** (``eager``): an aten op outside every graph replay that launches device work (views and metadata
  excluded: ``benchmarks.speed.kernel_counts.FREE``; ops on host tensors excluded: the host computes them). Under
  inference mode ``to``, ``contiguous`` and ``reshape`` reach the dispatcher whole: one that returns new memory
  (a dtype cast, ``copy=True``, a non-contiguous input) is a copy kernel and counts (``COPYING``). A replay
  itself counts once in ``replays``; the copies into its static inputs and out of its outputs are eager ops, as
  on a GPU.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.speed.kernel_counts import FREE
from r2r_hf.testing.graphs import EmulatedGraphStep, sync_problem

FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand, torch.randn, torch.randint,
             torch.linspace, torch.eye, torch.randperm}
READS = {torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()", torch.Tensor.cpu: ".cpu()",
         torch.Tensor.numpy: ".numpy()", torch.Tensor.__bool__: "bool()", torch.Tensor.__int__: "int()",
         torch.Tensor.__float__: "float()", torch.Tensor.__index__: "index()"}
TRANSFERS = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor, torch.Tensor.to, torch.Tensor.cuda,
             torch.Tensor.copy_, *READS}
ROOT = str(Path(__file__).resolve().parents[2])
# Ops in ``FREE`` that launch a copy when their result does not share their input's memory (see the docstring).
COPYING = {"to", "contiguous", "reshape", "type_as", "flatten"}


@dataclass
class Counts:
    """What a stretch of decoding did on the host, with where each copy and read came from."""

    h2d: int = 0
    h2d_async: int = 0
    d2h: int = 0
    eager: int = 0
    aten: int = 0  # every aten op outside the replays, views and metadata included (as a plain dispatch count)
    replays: int = 0
    sites: collections.Counter = field(default_factory=collections.Counter)  # (kind, where): how many
    ops: collections.Counter = field(default_factory=collections.Counter)  # eager op name: how many

    def per(self, steps: int) -> dict:
        """Per step, with the copies' and reads' sites and the commonest eager ops."""
        return {"h2d_syncing": self.h2d / steps, "h2d_async": self.h2d_async / steps, "d2h_reads": self.d2h / steps,
                "eager_ops": self.eager / steps, "aten_ops": self.aten / steps, "graph_replays": self.replays / steps,
                "sites": {f"{kind} {where}": n / steps for (kind, where), n in self.sites.most_common()},
                "top_eager_ops": {name: n / steps for name, n in self.ops.most_common(12)}}


def _host(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, "_r2r_host", False)


def _tag(out) -> None:
    for value in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(value, torch.Tensor):
            value._r2r_host = True


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _tensors(v)
    return found


def _site() -> str:
    """The innermost r2r_hf frame that made this call (``file:line function``)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/r2r_hf/" in name and "/r2r_hf/testing/" not in name:
            return f"{Path(name).relative_to(ROOT)}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "elsewhere"


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to(...)`` call targets the host (the string ``"cpu"``; see the module docstring)."""
    return any(a == "cpu" for a in (*args[1:], kwargs.get("device")) if isinstance(a, str))


def _moves(func, args: tuple, kwargs: dict) -> bool:
    """Whether a ``.to(...)``/``.cuda()`` call names a device (``.to(dtype)`` alone converts where the tensor is)."""
    named = (*args[1:], kwargs.get("device"))
    return func is torch.Tensor.cuda or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in named)


class Counter:
    """Both modes over one ``Counts``; ``paused`` (a depth) while a graph replays."""

    def __init__(self) -> None:
        self.counts, self.paused, self.quiet, self.active = Counts(), 0, 0, False
        self._modes = (_Calls(self), _Ops(self))

    def __enter__(self) -> Counter:
        for mode in self._modes:
            mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def note(self, kind: str) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        self.counts.sites[kind, _site()] += 1

    def classify(self, func, args: tuple, kwargs: dict) -> str | None:
        """The copy or read a Python-level call is (``h2d``, ``h2d_async``, ``d2h``), or None."""
        data = args[0] if args else kwargs.get("data")
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device")
            if isinstance(data, torch.Tensor):
                return "h2d" if _host(data) and device is not None and device != "cpu" else None
            return None if device is None or device == "cpu" else "h2d"
        if func is torch.Tensor.new_tensor:
            return None if _host(args[0]) or isinstance(args[1], torch.Tensor) else "h2d"
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            if not _moves(func, args, kwargs):
                return None
            if _host(args[0]) and not _to_host(args, kwargs):
                return "h2d_async" if kwargs.get("non_blocking") else "h2d"
            return "d2h" if not _host(args[0]) and _to_host(args, kwargs) else None
        if func is torch.Tensor.copy_:
            if _host(args[1]) and not _host(args[0]):
                return "h2d_async" if kwargs.get("non_blocking") or (len(args) > 2 and args[2]) else "h2d"
            return "d2h" if _host(args[0]) and not _host(args[1]) else None
        if func in READS:
            return None if _host(args[0]) else "d2h"
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, list) for i in index):  # a Python list becomes an index tensor, copied over
                return "h2d"
        return None


class _Calls(TorchFunctionMode):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs, c = kwargs or {}, self.counter
        if c.paused or c.quiet:
            return func(*args, **kwargs)
        kind = c.classify(func, args, kwargs)
        tensors = _tensors((*args, *kwargs.values()))
        host_only = bool(tensors) and all(_host(t) for t in tensors)
        if kind is None and not host_only:  # a host tensor of several elements beside device tensors is copied
            kind = "h2d" if any(_host(t) and t.numel() > 1 for t in tensors) else None
        if kind is not None:
            c.note(kind)
        # The copy or read itself, or host work, is no device op; an op copying its index over still runs one.
        made_on_host = func in FACTORIES and kwargs.get("device") in (None, "cpu")
        quiet = host_only or made_on_host or (kind is not None and func in TRANSFERS)
        c.quiet += quiet
        try:
            out = func(*args, **kwargs)
        finally:
            c.quiet -= quiet
        moved = kind in ("h2d", "h2d_async") and func in (torch.Tensor.to, torch.Tensor.cuda)  # now a device tensor
        if moved and out is args[0]:
            out = out.detach()  # on a GPU a new tensor on the device; here the same memory, no longer the host's
        from_data = func in (torch.tensor, torch.as_tensor) and kind is None and not isinstance(
            args[0] if args else None, torch.Tensor)  # made from host data
        if (host_only and not moved) or made_on_host or kind == "d2h" or from_data:
            _tag(out)
        return out


class _Ops(TorchDispatchMode):
    def __init__(self, counter: Counter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs, c = kwargs or {}, self.counter
        if not c.paused:
            c.counts.aten += 1
        out = func(*args, **kwargs)
        if not (c.paused or c.quiet):
            name, short = func._schema.name, func.overloadpacket.__name__
            if name != "aten::lift_fresh" and sync_problem(func, args, kwargs):
                c.note("d2h")
            elif short.rstrip("_") not in FREE or (short in COPYING and _copied(args, out)):
                c.counts.eager += 1
                c.counts.ops[short] += 1
        return out


def _copied(args: tuple, out) -> bool:
    """Whether an op of ``COPYING`` returned new memory (a copy kernel ran) rather than its input's."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def counting_steps(counter: Counter | None = None) -> type[EmulatedGraphStep]:
    """Emulated CUDA graphs whose replays, while ``counter`` counts, count once (``replays``) and pause it; every
    replay adds its wall time to ``seconds`` (the emulation's stand-in for the device's time)."""
    class Counted(EmulatedGraphStep):
        seconds = 0.0
        watched = counter

        def replay(self) -> None:
            watched, start = type(self).watched, time.perf_counter()
            watched = watched if watched is not None and watched.active else None
            if watched is not None:
                watched.counts.replays += 1
                watched.paused += 1
            try:
                super().replay()
            finally:
                if watched is not None:
                    watched.paused -= 1
                type(self).seconds += time.perf_counter() - start

    return Counted
