"""The device check's in-process measurements, each phase under its own guard (``benchmarks/gpu/runner.py``).

    python -m benchmarks.gpu.check --out DIR             # on the GPU (benchmarks/gpu/check.sh runs it)
    python -m benchmarks.gpu.check --out DIR --dry-run   # the same phases on a CPU: tiny shapes, emulated graphs

``DIR/gpu_check.json`` is rewritten after every number. A phase that raises (or runs past its budget) is written
down as ``errors[phase]`` (type, message, traceback tail) and the next phase runs; ``phase_s`` says how long each
took, ``compiles`` how many graphs dynamo compiled in it (after the warm-up phases, none should), ``fallbacks``
every warning r2r_hf logged (a fused read that did not compile, a model left unfused, the router kept in fp32) with
its phase, ``fused_check`` the fused self-check's measured difference per model. The exit status is 1 when any
phase failed.

Order (the second device run's, issue 51): every compile first and outside the timed phases, the headline pair as
soon as its classes are compiled, then the rest in order of value. Budgets (H200, bf16, 1.5B + 32B shapes; each the
phase's deadline; what the first run measured beside them):

  conditions, build (random weights, the fused self-check)                         10 + 40 s    (first run 10 s)
  warm           R2R at batch 1, every token routed: generate's region classes  120 s, ends by 150 s (47-82 s)
  r2r_fused_1    HEADLINE: R2R on graphs of fused reads at p = 0.1, batch 1                    45 s    (4 s)
  llm_fused_1    HEADLINE: the LLM alone on graphs of fused reads, batch 1 (the fair denominator) 30 s (9 s)
  warm_grid      the grid's batch of slots built and every point captured (grid.py): the slot and
                 packed reads' region classes compile here                                     150 s
  warm_servers   the servers started (served.py: R2R, the LLM alone, R2R with room for long
                 answers): their captures at start-up and the compiles a span as wide as the
                 slots meets                                                                   150 s   (55 + 10 s)
  grid           every point, 20 event-timed replays each: the LLM's padded reads at rows
                 {1,2,4,8,16} x tokens {1,8,16,32,64}, its packed reads at each total-token
                 bucket, verify reads {8,16} x {16,32,64} keeping every position's logits, the
                 long span (4096 columns), the SLM at rows {1,8,16}, the router's graph and
                 top-k alone; the host's time per step at 8 and 16 rows                         90 s
  serving        R2R against the LLM alone at 8, 16 and 16 users (the pair twice: noise), each
                 load with its per-read histogram (reads.py) and prefill apart                  120 s   (loads ~35 s)
  long           R2R with 2,048-token answers at 8 users                                        90 s
  speculative    the speculative server with the agreement oracle (oracle.py) at 8 and 16 users  60 s
  r2r_speculative_1  batch-1 speculation with the oracle (the servers are stopped first)        45 s
  exact          teacher-forced argmax agreement of the fused 32B against its eager forward     45 s
  kernels        the profiler over 10 SLM steps at 1 and 16 rows (kernels.py)                   30 s
  fit            the cost model fitted on the grid, checked against the served runs (CPU)        60 s

The phases stop at ``Plan.deadline_s`` (450 s on the device), the last ones cut first. The peers (HF's
``generate_batch`` outside inference mode, HF's compiled ``llm.generate``: ``compiled.py``) then run as a step of
their own in ``check.sh``, in a fresh process, with what is left of its 510 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.gpu import phases as ph
from benchmarks.gpu import slot_phases as sp
from benchmarks.gpu.plan import DEVICE, DRY_RUN, Plan
from benchmarks.gpu.ratios import ratios
from benchmarks.gpu.runner import Fallbacks, Phase, Report, free, run_phases

PEERS = ("hf_generate_batch", "compiled_llm")  # the peers' child's phase names (compiled.py), for --fail-phase


def headline_phases(plan: Plan, report: Report, ctx: dict, gen: dict) -> list[Phase]:
    """conditions, build, warm and the headline pair (the module docstring's first rows)."""
    model = lambda: ctx["model"]  # noqa: E731 - built by the build phase

    def make() -> None:
        ctx["model"] = ph.build(plan, report)
        ctx["prompt"] = torch.randint(0, 1000, (1, plan.prompt), device=plan.device,
                                      generator=torch.Generator(plan.device).manual_seed(1))

    prompt = lambda: ctx["prompt"]  # noqa: E731
    return [Phase("conditions", 10, lambda: report.put("conditions", None, ph.conditions(plan))),
            Phase("build", 40, make),
            Phase("warm", 120, lambda: ph.warm(model(), plan, prompt(), gen, report), ("build",), plan.warm_by_s),
            Phase("r2r_fused_1", 45, lambda: ph.r2r_shares(model(), plan, 1, prompt(), gen, report, (plan.headline,)),
                  ("build",)),
            Phase("llm_fused_1", 30, lambda: ph.alone(model(), "llm", plan, 1, prompt(), report, fused=True),
                  ("build",))]


def phases(plan: Plan, report: Report, ctx: dict) -> list[Phase]:
    """Every in-process phase in its order (the module docstring says why); ``ctx`` holds the pair, the grid and
    the servers."""
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0)
    compiles = ph.compiles

    def later(name: str, budget: float, run: Callable[[], None]) -> Phase:
        return Phase(name, budget, run, ("build",))

    def served(name: str, budget: float, run) -> Phase:  # the load stops itself 5 s before the phase's deadline
        return later(name, budget, lambda: run(ctx, plan, report, compiles,
                                               time.monotonic() + budget * plan.slack - 5))

    def batch_one() -> None:
        sp.release(ctx)
        ph.speculative(ctx["model"], plan, ctx["prompt"], gen, report)

    listed = [
        *headline_phases(plan, report, ctx, gen),
        later("warm_grid", 150, lambda: sp.warm_grid(ctx, plan, report, compiles)),
        later("warm_servers", 150, lambda: sp.warm_servers(ctx, plan, report, compiles)),
        later("grid", 90, lambda: sp.time_grid(ctx, plan, report)),
        served("serving", 120, sp.serving),
        served("long", 90, sp.long),
        served("speculative", 75, sp.speculative),
        later("r2r_speculative_1", 45, batch_one),
        later("exact", 45, lambda: sp.fused_vs_eager(ctx, plan, report)),
        later("kernels", 30, lambda: sp.profile(ctx, plan, report)),
        Phase("fit", 60, lambda: fit(report)),
    ]
    return [replace(p, budget_s=p.budget_s * plan.slack, run=counted(p.name, p.run, report)) for p in listed]


def fit(report: Report) -> None:
    """The cost model fitted on this run's grid, checked against this run's served loads (``calibrated.py``)."""
    from benchmarks.serving.calibrated import grid_check

    report.put("fit", None, grid_check(report.data))


def counted(name: str, run: Callable[[], None], report: Report) -> Callable[[], None]:
    """``run``, with the graphs dynamo compiled during it written down (``compiles[name]``): after ``warm`` the
    timed phases should compile nothing."""
    def wrapped() -> None:
        before = ph.compiles()
        try:
            run()
        finally:
            report.put("compiles", name, ph.compiles() - before)
    return wrapped


def names(plan: Plan) -> list[str]:
    """Every phase's name, in order, the peers' child's last (what ``--fail-phase`` accepts)."""
    return [p.name for p in phases(plan, Report(Path(os.devnull), {}), {})] + list(PEERS)


def derive(report: Report) -> None:
    """The ratios of what was measured so far (after every phase)."""
    for section, value in ratios(report.data).items():
        report.put(section, None, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, emulated graphs")
    parser.add_argument("--fail-phase", default=os.environ.get("GPU_CHECK_FAIL_PHASE") or None, metavar="NAME",
                        help="tests only: raise in phase NAME (or each of A,B) to show that every other phase still "
                             "runs (default: $GPU_CHECK_FAIL_PHASE)")
    parser.add_argument("--phases", default=None, metavar="A,B",
                        help="only these phases (and conditions and build, which every measurement needs): a rerun "
                             "of what matters on a lease's last minutes (name the warm-up phases too, or the timed "
                             "ones compile and capture what they need themselves)")
    parser.add_argument("--deadline-s", type=float, default=None, help="end the phases by then (default: the plan's)")
    args = parser.parse_args(argv)
    plan = DRY_RUN if args.dry_run else DEVICE
    if args.deadline_s is not None:
        plan = replace(plan, deadline_s=args.deadline_s)
    chosen = None if args.phases is None else {"conditions", "build", *args.phases.split(",")}
    if chosen is not None and not chosen <= set(names(plan)):
        parser.error(f"--phases: not phases: {', '.join(sorted(chosen - set(names(plan))))}")
    failing = set(args.fail_phase.split(",")) if args.fail_phase else set()
    if failing - set(names(plan)):  # a typo would make the test pass vacuously
        parser.error(f"--fail-phase {args.fail_phase!r}: not a phase ({', '.join(names(plan))})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    if plan.region_backend != "inductor":  # before any region is made: they take the options when compiled
        from r2r_hf.core.fast import fused

        fused.REGION_OPTIONS = {"backend": plan.region_backend, "dynamic": None, "fullgraph": True}
    report, ctx = Report(out / "gpu_check.json", asdict(plan)), {}
    try:
        with torch.no_grad(), Fallbacks(report).attached():
            listed = [p for p in phases(plan, report, ctx) if chosen is None or p.name in chosen]
            run_phases(listed, report, until_s=plan.deadline_s, fail=failing,
                       recover=lambda: free(plan.device), after=lambda: derive(report))
    finally:
        sp.release(ctx)  # the servers' threads
    report.mark(f"done; {len(report.errors)} phase(s) failed: {', '.join(report.errors) or 'none'}")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
