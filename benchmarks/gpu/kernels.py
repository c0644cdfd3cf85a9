"""The SLM's step under the profiler: what decides how its 1.92 ms gets toward its ~0.64 ms weight-read floor.

Ten steps of the SLM's one-token slot read (fused, with its hidden state and, where the server folds it, the router on
its proposals: the server's step) at each row count, twice:
replayed from the grid's captured graph (``grid.py``: what the server runs), and run as the same fused read without
a graph (each kernel launched by the host: where a graph's kernels are not attributed one by one, these are). For
each: kernels per step, the kernels' own device time per step against the step's wall time (their gap is launch
and idle time), and the ten costliest kernels (calls and microseconds per step). On a CPU (the dry run) the
"kernels" are the aten ops the profiler records.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from r2r_hf.core.fast.fused import attended
from r2r_hf.core.layouts.slot_cache import piece_inputs

TOP = 10


def _device_us(event) -> float:
    """An event's own device time in microseconds (the attribute's name changed across torch releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profiled(call, steps: int, device: torch.device) -> dict:
    """``call`` run ``steps`` times under the profiler (after one untimed call): kernels per step, their device time
    and the wall time per step, the costliest kernels."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    call()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            call()
        sync()
        wall = time.perf_counter() - start
    if cuda:
        gpu = torch.autograd.DeviceType.CUDA
        kernels = [e for e in prof.key_averages() if _device_us(e) > 0 and e.device_type == gpu]
        took = _device_us
    else:  # the dry run: the aten ops the profiler saw, by their own CPU time
        kernels = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        took = lambda e: float(e.self_cpu_time_total)  # noqa: E731
    top = sorted(kernels, key=took, reverse=True)[:TOP]
    return {"steps": steps, "kernels_per_step": sum(e.count for e in kernels) / steps,
            "kernel_ms_per_step": sum(took(e) for e in kernels) / 1e3 / steps, "wall_ms_per_step": 1e3 * wall / steps,
            "what": "CUDA kernels" if cuda else "aten ops (CPU: the dry run)",
            "top": [{"name": e.key[:160], "calls_per_step": e.count / steps, "us_per_step": took(e) / steps}
                    for e in top]}


def slm_steps(grid, rows: int, steps: int) -> dict:
    """The SLM's step at ``rows`` rows, replayed from its captured graph and run without one (see the module
    docstring)."""
    reads, plan = grid.layout.path.slm.steps, grid.plan
    example = piece_inputs(grid.layout.tokens, list(range(rows)), [plan.grid_context] * rows, [1] * rows, 1,
                           reads.cache.trash)
    span = attended(plan.grid_context + 1, reads.cache.capacity)
    captured = reads.step(rows, 1, span, example)
    out = {"captured": profiled(lambda: captured(**example), steps, grid.device), "fused": reads.fused,
           "router_folded": reads.fold is not None}
    if reads.regions is not None:  # the same read uncaptured (the router folded in where the server folds it)
        uncaptured = reads.function(rows, span)
        out["without a graph"] = profiled(lambda: uncaptured(**example), steps, grid.device)
    return out
