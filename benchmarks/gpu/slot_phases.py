"""The device check's phases over the engine's slots, one function each (``check.py`` orders and guards them).

Everything over slots runs in inference mode, as the server runs (its buffers are inference tensors, and dynamo
guards on the mode: a read captured in one mode compiles again in the other). Each warm-up phase builds what its
timed phases use and keeps it in ``ctx``: the grid's batches with every point captured (``warm_grid``: the fused
regions' shape classes compile there, for the servers too, whose caches have the grid's shapes), the servers started
(``warm_servers``: their captures). A timed phase whose warm-up failed builds what it needs itself (its compiles are
then counted in it), so one failure costs one phase. Every function writes its numbers as it takes them.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from benchmarks.gpu import exact, kernels, served
from benchmarks.gpu.grid import Grid, host_per_step, replay_ms, summary
from benchmarks.gpu.runner import Report, describe


def inference(fn):
    """``fn`` in inference mode (see the module docstring)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapped


def the_grid(ctx: dict, plan) -> Grid:
    """The grid's batches (built here if ``warm_grid`` did not)."""
    if "grid" not in ctx:
        ctx["grid"] = Grid(ctx["model"], plan)
    return ctx["grid"]


@inference
def warm_grid(ctx: dict, plan, report: Report, compiles) -> None:
    """Build the grid's batches and capture every point once (the fused regions compile here, outside the grid)."""
    start, before = time.perf_counter(), compiles()
    grid = the_grid(ctx, plan)
    each_point(grid, report, lambda point: point.call())
    report.put("warm", "grid", {"seconds": time.perf_counter() - start, "compiles": compiles() - before,
                                "fused": grid.report.get("fused"), "packed": grid.report.get("packed")})
    failed(report)


@inference
def time_grid(ctx: dict, plan, report: Report) -> None:
    """Every point replayed ``grid_replays`` times under CUDA events, then the host's time per step."""
    grid = the_grid(ctx, plan)
    report.data.pop("grid_errors", None)  # (what the warm-up could not capture, this phase says again)
    each_point(grid, report, lambda point: report.put(f"grid_{point.section}", point.key, {
        **point.shape, **summary(replay_ms(point.call, grid.device, plan.grid_replays))}))
    report.put("grid_slots", None, grid.report)  # the short batch as the server captures it (fused, packed, folded)
    folded = grid.report.get("folded")
    costs = {"slm": report.data.get("grid_slm", {}), "router": {} if folded else report.data.get("grid_router", {})}
    for rows in plan.host_rows:
        report.put("grid_host", str(rows), host_per_step(grid, rows, plan.host_steps, costs))
    failed(report)


def each_point(grid: Grid, report: Report, run) -> None:
    """``run(point)`` for every point of the grid, each under its own guard: a point that raises is written into
    ``grid_errors`` and the next one runs (one kind of read that cannot be captured costs its points only)."""
    for point in grid.points():
        try:
            run(point)
        except Exception as err:  # noqa: BLE001 - recorded; ``failed`` fails the phase once every point has run
            report.put("grid_errors", f"{point.section} {point.key}", describe(err))


def failed(report: Report) -> None:
    """Fail the phase where any point failed (its numbers, and the other points', are written already)."""
    errors = report.data.get("grid_errors") or {}
    if errors:
        first = next(iter(errors.values()))
        raise RuntimeError(f"{len(errors)} grid point(s) failed (grid_errors), first {next(iter(errors))}: "
                           f"{first['type']}: {first['message'][:200]}")


def the_servers(ctx: dict, plan, report: Report, compiles) -> served.Served:
    """The servers, each started on first need (``warm_servers`` starts them all)."""
    if "served" not in ctx:
        ctx["served"] = served.Served(ctx["model"], plan, compiles,
                                      lambda name, value: report.put("server_start", name, value))
    return ctx["served"]


def warm_servers(ctx: dict, plan, report: Report, compiles) -> None:
    servers = the_servers(ctx, plan, report, compiles)
    for name in servers.specs():
        servers.get(name)


def serving(ctx: dict, plan, report: Report, compiles, deadline: float) -> None:
    """R2R (the GPU's waiting default) against the LLM alone at each of ``plan.serve``, in pairs: each pair's ratio."""
    servers = the_servers(ctx, plan, report, compiles)
    runs: dict[str, list] = {"R2R, waiting": [], "LLM alone": []}
    ratios = []
    for c in plan.serve:
        pair = (("R2R, waiting", "R2R", 1 - plan.headline, "waiting"), ("LLM alone", "LLM alone", math.inf, "own"))
        for name, server, threshold, policy in pair:
            runs[name].append(served.run_load(servers, server, c, max(2 * c, 4), plan.serve_tokens, threshold,
                                              deadline, policy=policy, prompt=plan.prompt))
            report.put("serving", name, runs[name])
        ratios.append({"concurrency": c, "r2r_over_llm_alone": runs["R2R, waiting"][-1]["tokens_per_s"]
                       / runs["LLM alone"][-1]["tokens_per_s"]})
        report.put("serving", "ratios", ratios)


def long(ctx: dict, plan, report: Report, compiles, deadline: float) -> None:
    """R2R with ``plan.long_tokens``-token answers, one per user (the waiting default)."""
    servers = the_servers(ctx, plan, report, compiles)
    c = plan.long_users
    run = served.run_load(servers, "R2R, long", c, c, plan.long_tokens, 1 - plan.headline, deadline, prompt=plan.prompt)
    report.put("serving", "R2R, waiting, long", [run])


def speculative(ctx: dict, plan, report: Report, compiles, deadline: float) -> None:
    """The speculative server (its default at depth ``plan.speculate``) with the agreement oracle at each of
    ``plan.spec_users``; then the same server at threshold 0 (lossless decoding: every token routes, no router, the
    oracle's verdicts) at the first of them."""
    servers = the_servers(ctx, plan, report, compiles)
    runs = []
    for c in plan.spec_users:
        runs.append(served.run_load(servers, "R2R", c, max(2 * c, 4), plan.serve_tokens, 1 - plan.headline, deadline,
                                    policy="speculative", agreement=plan.agreement, prompt=plan.prompt))
        report.put("serving", "R2R, speculative (oracle)", runs)
    c = plan.spec_users[0]
    lossless = served.run_load(servers, "R2R", c, max(2 * c, 4), plan.serve_tokens, 0.0, deadline,
                               policy="speculative", agreement=plan.agreement, prompt=plan.prompt)
    report.put("serving", "R2R, lossless (oracle)", [lossless])


def release(ctx: dict) -> None:
    """Stop the servers and give the model its own router back (the phases after the served ones use the model)."""
    if "served" in ctx:
        ctx.pop("served").close()


@inference
def fused_vs_eager(ctx: dict, plan, report: Report) -> None:
    release(ctx)
    check = report.data.get("fused_check", {}).get("llm") or {}
    report.put("exact", "llm", exact.fused_against_eager(the_grid(ctx, plan), plan.exact_rows, plan.exact_length,
                                                         check.get("tolerance")))


@inference
def profile(ctx: dict, plan, report: Report) -> None:
    grid = the_grid(ctx, plan)
    for rows in plan.profile_rows:
        report.put("kernels", str(rows), kernels.slm_steps(grid, rows, plan.profile_steps))
