"""The device check's in-process measurements, each phase under its own guard (``benchmarks/gpu/runner.py``).

    python -m benchmarks.gpu.check --out DIR             # on the GPU (benchmarks/gpu/check.sh runs it)
    python -m benchmarks.gpu.check --out DIR --dry-run   # the same phases on a CPU: tiny shapes, emulated graphs

``DIR/gpu_check.json`` is rewritten after every number. A phase that raises (or runs past its budget) is written
down as ``errors[phase]`` (type, message, traceback tail) and the next phase runs; ``phase_s`` says how long each
took, ``compiles`` how many graphs dynamo compiled in it, ``fallbacks`` every warning r2r_hf logged (a fused read
that did not compile, a model left unfused, the router kept in fp32) with its phase, ``fused_check`` the fused
self-check's measured difference per model. The exit status is 1 when any phase failed.

Order: value per second, the compile first and outside every timed phase (a run cut short keeps its first
phases). Budgets (H200, bf16, 1.5B + 32B; estimated from the review's cost model, each the phase's deadline):

  conditions, build (random weights, the fused self-check)                                        10 + 40 s
  warm           every shape class the check meets compiled: R2R at batch 1 then 2, every token
                 routed (each model's regions at one row | several x one token | a piece; the rows,
                 tokens and cache dims marked dynamic, so batch 8 and every catch-up bucket reuse them;
                 ~25 region compiles, Triton est. 4-9 s each). It ends by 185 s whatever is left:     170 s
  r2r_fused_1    HEADLINE: R2R on graphs of fused reads at p = 0.1, batch 1                              45 s
  llm_fused_1    HEADLINE: the LLM alone on graphs of fused reads, batch 1: the fair denominator          30 s
                 (the pair is written by ~240 s of script time: 25 s of versions and imports first)
  r2r_unfused_1, llm_graphs_1   the same pair on graphs of HF's forward: fusing's gain            40 + 25 s
  r2r_shares_1   R2R fused at the other shares (p = 0, 0.05, 0.2)                                       45 s
  slm_fused_1    the SLM alone on fused graphs: never-route's target (within 1.10x)                     20 s
  components_1   captured t_SLM, t_router, t_LLM per bucket (and a speculative resolution's read, every
                 position's logits, per bucket); the cost model (loop efficiency)                       45 s
  r2r_router_1   the real router at its 90th-percentile threshold, folded into the SLM's read and in
                 bf16 (core/fast/router_copy.py; a forced schedule cannot be folded): p as measured      40 s
  r2r_speculative_1  R2R speculating (speculate 8, wait 32) at p = 0.1: random weights disagree at every
                 routed position, so every resolution rolls back: the worst case, with its counters      40 s
  serving        the engine in-process (serve.py): R2R fused (the GPU's waiting default) and the
                 LLM alone on the same engine (no SLM, no router), concurrency 8 and 16, time outside
                 the graphs per step and each stage's time; then R2R with m = 1, R2R speculating (the
                 worst case on random weights) and HF's generate_batch, as the budget allows (the slot
                 regions' compile and every server's capture are inside it)                             150 s
  agreement      teacher-forced bf16 logits, captured (fused) vs eager (docs/fast_path.md's tolerance)   45 s
  r2r_fused_8, llm_fused_8, components_8: a prediction (1.3-1.5x)                                 75 + 30 + 45 s
  llm_eager_1, slm_eager_1, r2r_eager_1 (p = 0.1), llm_eager_8                              45 + 20 + 30 + 45 s

The phases stop at ``Plan.deadline_s`` (400 s on the device), the last ones cut first. HF's compiled
``llm.generate`` (``compiled.py``) and the CUDA tests then run as steps of their own in ``check.sh``,
each with its own timeout, in fresh processes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.gpu import phases as ph
from benchmarks.gpu.plan import DEVICE, DRY_RUN, Plan
from benchmarks.gpu.ratios import ratios
from benchmarks.gpu.runner import Fallbacks, Phase, Report, free, run_phases

COMPILED = "compiled_llm"  # the compiled child's phase name (compiled.py), for --fail-phase


def headline_phases(plan: Plan, report: Report, ctx: dict, gen: dict) -> list[Phase]:
    """conditions, build, warm and the headline pair (the module docstring's first rows)."""
    model = lambda: ctx["model"]  # noqa: E731 - built by the build phase

    def make() -> None:
        ctx["model"] = ph.build(plan, report)
        ctx["prompts"] = {b: torch.randint(0, 1000, (b, plan.prompt), device=plan.device,
                                           generator=torch.Generator(plan.device).manual_seed(b))
                          for b in {*plan.batches, 2}}

    one = plan.batches[0]
    return [Phase("conditions", 10, lambda: report.put("conditions", None, ph.conditions(plan))),
            Phase("build", 40, make),
            Phase("warm", 170, lambda: ph.warm(model(), plan, ctx["prompts"], gen, report), ("build",), plan.warm_by_s),
            Phase(f"r2r_fused_{one}", 45, lambda: ph.r2r_shares(model(), plan, one, ctx["prompts"][one], gen, report,
                                                                (plan.headline,)), ("build",)),
            Phase(f"llm_fused_{one}", 30, lambda: ph.alone(model(), "llm", plan, one, ctx["prompts"][one], report,
                                                           fused=True), ("build",))]


def phases(plan: Plan, report: Report, ctx: dict) -> list[Phase]:
    """Every in-process phase in its order (the module docstring says why); ``ctx`` holds the pair and prompts."""
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0)
    model, prompt = (lambda: ctx["model"]), (lambda b: ctx["prompts"][b])  # noqa: E731
    one, *more = plan.batches
    others = tuple(s for s in plan.shares if s != plan.headline)

    def later(name: str, budget: float, run: Callable[[], None]) -> Phase:
        return Phase(name, budget, run, ("build",))

    def eager(role: str, batch: int) -> Phase:
        return later(f"{role}_eager_{batch}", {"llm": 45, "slm": 20, "r2r": 30}[role],
                     lambda: ph.eager(model(), role, plan, batch, prompt(batch), gen, report))

    def components(batch: int) -> Phase:
        return later(f"components_{batch}", 45, lambda: ph.components(model(), plan, batch, prompt(batch), gen, report))

    listed = [
        *headline_phases(plan, report, ctx, gen),
        later(f"r2r_unfused_{one}", 40, lambda: ph.r2r_unfused(model(), plan, prompt(one), gen, report)),
        later(f"llm_graphs_{one}", 25, lambda: ph.alone(model(), "llm", plan, one, prompt(one), report, fused=False)),
        later(f"r2r_shares_{one}", 45, lambda: ph.r2r_shares(model(), plan, one, prompt(one), gen, report, others)),
        later(f"slm_fused_{one}", 20, lambda: ph.alone(model(), "slm", plan, one, prompt(one), report, fused=True)),
        components(one),
        later(f"r2r_router_{one}", 40, lambda: ph.r2r_router(model(), plan, prompt(one), gen, report)),
        later(f"r2r_speculative_{one}", 40, lambda: ph.speculative(model(), plan, prompt(one), gen, report)),
        later("serving", plan.serve_budget_s, lambda: ph.serving(model(), plan, report)),
        later("agreement", 45, lambda: ph.bf16_agreement(model(), plan, report)),
    ]
    for b in more:
        listed += [later(f"r2r_fused_{b}", 75, lambda b=b: ph.r2r_shares(model(), plan, b, prompt(b), gen, report,
                                                                          plan.shares)),
                   later(f"llm_fused_{b}", 30, lambda b=b: ph.alone(model(), "llm", plan, b, prompt(b), report,
                                                                     fused=True)),
                   components(b)]
    listed += [eager("llm", one), eager("slm", one), eager("r2r", one), *[eager("llm", b) for b in more]]
    return [replace(p, budget_s=p.budget_s * plan.slack, run=counted(p.name, p.run, report)) for p in listed]


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
    """Every phase's name, in order, the compiled child's last (what ``--fail-phase`` accepts)."""
    return [p.name for p in phases(plan, Report(Path(os.devnull), {}), {})] + [COMPILED]


def derive(report: Report) -> None:
    """The ratios of what was measured so far (after every phase)."""
    for section, value in ratios(report.data).items():
        report.put(section, None, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, emulated graphs")
    parser.add_argument("--fail-phase", default=os.environ.get("GPU_CHECK_FAIL_PHASE") or None, metavar="NAME",
                        help="tests only: raise in phase NAME to show that every other phase still runs "
                             "(default: $GPU_CHECK_FAIL_PHASE)")
    parser.add_argument("--phases", default=None, metavar="A,B",
                        help="only these phases (and conditions, build and warm, which every measurement needs): a "
                             "rerun of what matters on a lease's last minutes")
    parser.add_argument("--deadline-s", type=float, default=None, help="end the phases by then (default: the plan's)")
    args = parser.parse_args(argv)
    plan = DRY_RUN if args.dry_run else DEVICE
    if args.deadline_s is not None:
        plan = replace(plan, deadline_s=args.deadline_s)
    chosen = None if args.phases is None else {"conditions", "build", "warm", *args.phases.split(",")}
    if chosen is not None and not chosen <= set(names(plan)):
        parser.error(f"--phases: not phases: {', '.join(sorted(chosen - set(names(plan))))}")
    if args.fail_phase and args.fail_phase not in names(plan):  # a typo would make the test pass vacuously
        parser.error(f"--fail-phase {args.fail_phase!r}: not a phase ({', '.join(names(plan))})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    report, ctx = Report(out / "gpu_check.json", asdict(plan)), {}
    with torch.no_grad(), Fallbacks(report).attached():
        listed = [p for p in phases(plan, report, ctx) if chosen is None or p.name in chosen]
        run_phases(listed, report, until_s=plan.deadline_s, fail=args.fail_phase,
                   recover=lambda: free(plan.device), after=lambda: derive(report))
    report.mark(f"done; {len(report.errors)} phase(s) failed: {', '.join(report.errors) or 'none'}")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
