"""The device check's measurements, each phase under its own guard (``benchmarks/gpu_runner.py``).

    python -m benchmarks.gpu_check --out DIR             # on the GPU (benchmarks/gpu_check.sh runs it)
    python -m benchmarks.gpu_check --out DIR --dry-run   # the same phases on a CPU: tiny shapes, emulated graphs

``DIR/gpu_check.json`` is rewritten after every number. A phase that raises (or runs past its
budget) is written down as ``errors[phase]`` (type, message, traceback tail) and the next phase
runs; ``phase_s`` says how long each took. The exit status is 1 when any phase failed.

Order: value per second (a run cut short keeps its first phases). Batch 1 first: it carries four of
the five targets in docs/performance.md; then the serving phase (issue 31's targets); eager paths
last: an H200 measured them before. Each budget is that phase's deadline (H200, bf16, 1.5B + 32B;
estimated from the review's cost model, x ~2.5):

  conditions 1 / 30 s, build (random weights) 20 / 90 s,
  r2r_captured_1   R2R on CUDA graphs of fused reads (core/fast/fused.py) at p = 0 / 0.05 / 0.1 / 0.2, the
                   regions' cold compile inside its first calls: what the device is lent for     60 / 120 s
  llm_graphs_1     the LLM's one-token step replayed on graphs: R2R's denominator              10 / 40 s
  slm_graphs_1     the SLM's, the same way: the never-route target's baseline                   3 / 20 s
  components_1     captured t_SLM, t_router, t_LLM per bucket; the cost model (loop efficiency) 15 / 45 s
  r2r_unfused_1    the same at p = 0.1 on graphs of HF's forward (--unfused-graphs): fusing's gain 15 / 40 s
  r2r_router_1     the real router at its 90th-percentile threshold, folded into the SLM's read and in
                   bf16 (core/fast/router_copy.py; a forced schedule cannot be folded): p as measured  15 / 40 s
  agreement        teacher-forced bf16 logits, captured (fused) vs eager (the README's tolerance) 20 / 60 s
  serving          the engine under load at concurrency 1 / 8 / 16 (gpu_serve.py), p = 0.1: captured
                   waiting, the LLM alone, captured m = 1, eager; HF's generate_batch         ~100 / 120 s
                   (on graphs of HF's forward: the slot regions' compile would not fit its budget too)
  r2r_captured_8, llm_graphs_8, slm_graphs_8, components_8: a prediction (1.3-1.5x)        60 / 180 s
  llm_eager_1, slm_eager_1, r2r_eager_1 (p = 0.1), llm_eager_8                              70 / 140 s
  compiled_llm     HF's compiled llm.generate, batch 1, in a fresh process          at least 150 s

The in-process phases must end 150 + 10 s (the child's start) before the check's 420 s, so the last
(eager, batch 8) ones are cut first. The compiled baseline runs last and alone: the parent frees the
pair first (gc.collect(): ``del model`` alone frees nothing, a reference cycle) since a second 32B
(65 GB) beside it would barely fit, and its cold compile is a coin flip, so it gets at least 150 s
and whatever the phases before it left. Batch 1 only: batch 8 recompiles every graph (a ~90 %
miss, the review says), and HF's ``CompileConfig(dynamic=True)`` makes every shape symbolic, not
just the batch, so batch 1 would be timed on dynamic-shape kernels, not HF's default compile.

Weights are random (speed does not depend on them) and the routed share is forced (``ForcedRouter``
runs the real router every step and routes on a schedule), as in ``benchmarks/speed.py``; ``r2r_router_1``
alone routes on the real router's scores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import transformers

from benchmarks.gpu_runner import Phase, PhaseTimeout, Report, describe, free, run_phases
from benchmarks.speed_parts import (ForcedRouter, captured_components, eager_components, first_call,
                                    graph_decode_per_token, ideal_per_token, llm_call_steps, random_model, schedule,
                                    timed)
from r2r_hf import R2RForCausalLM


@dataclass(frozen=True)
class Plan:
    """What one check measures and how long it may take."""

    slm: str
    llm: str
    dtype: str
    device: str
    prompt: int
    tokens: int
    batches: tuple[int, ...]
    shares: tuple[float, ...]
    repeats: int
    deadline_s: float  # the whole check, from main's start (gpu_check.sh's timeout is 20 s longer: imports)
    compile_seconds: float  # the compiled child's least time; it gets what the phases before it leave too
    emulate: bool  # CPU: emulated CUDA graphs
    serve: tuple[int, ...]  # the serving phase's concurrencies (benchmarks/gpu_serve.py)
    serve_tokens: int  # tokens per served answer
    serve_budget_s: float
    slack: float = 1.0  # every phase's budget is multiplied by it (the deadline above is not: it is set per plan)


DEVICE = Plan("qwen2.5-1.5b", "qwen2.5-32b", "bfloat16", "cuda", prompt=64, tokens=128, batches=(1, 8),
              shares=(0.0, 0.05, 0.1, 0.2), repeats=2, deadline_s=420, compile_seconds=150, emulate=False,
              serve=(1, 8, 16), serve_tokens=128, serve_budget_s=120)
DRY_RUN = Plan("tiny", "tiny-llm", "bfloat16", "cpu", prompt=16, tokens=24, batches=(1, 8),
               shares=(0.0, 0.05, 0.1, 0.2), repeats=1, deadline_s=360, compile_seconds=30, emulate=True,
               serve=(1, 2), serve_tokens=4, serve_budget_s=60, slack=3.0)
# The dry run rehearses the isolation, not the device's timing: it takes ~90 s alone on 2 cores, but CI runs it beside
# another pytest worker compiling with inductor, where it took over 4x that (one CI run lost its last 11 phases to the
# old 170 s deadline). Hence budgets x 3 and a deadline of 360 s; a run alone still ends in ~90 s.
AGREEMENT_READS = [3, 1, 70, 2, 40]  # LLM catch-ups after the prompt: a step, a gap longer than the buckets...
CHILD_START_S = 10  # the child's imports and CUDA start, and the parent's merge after it
COMPILED = "compiled_llm"


def conditions(plan: Plan) -> dict:
    cuda = plan.device.startswith("cuda")
    return {"hardware": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "weights": "random", "graphs": "emulated on the CPU (r2r_hf.testing.graphs)" if plan.emulate else "CUDA",
            "decoding": "greedy, min_new_tokens = max_new_tokens (every call writes the same number of tokens)"}


def build(plan: Plan) -> R2RForCausalLM:
    """The pair with the paper's router (1024 x 6 blocks)."""
    dtype = getattr(torch, plan.dtype)
    slm, llm = random_model(plan.slm, dtype, plan.device, 0), random_model(plan.llm, dtype, plan.device, 1)
    dims = [1024] * 6 if not plan.emulate else [64] * 2
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=dims)
    if plan.emulate:
        from r2r_hf.testing.graphs import emulated_store

        model.capture_store = emulated_store(fuse=True)  # the fused path, compiled on the CPU (tiny: seconds)
        # A CPU's inductor is slower than the device budgets assume: the dry run compiles the regions here (one
        # and two rows: the dynamic recompile too), so the phases time reads, as they do on the device.
        for rows in (1, 2):
            model.generate(torch.randint(3, 1000, (rows, plan.prompt)), max_new_tokens=4, do_sample=False,
                           pad_token_id=0, cache_implementation="static", threshold=0.0)
        model.capture_store.clear()
    return model


def decisions(plan: Plan, share: float, batch: int) -> torch.Tensor:
    """The forced schedule at ``share``: one for the whole batch at batch 1, rows independent above."""
    return schedule(share, batch, plan.tokens, per_row=batch > 1)


def r2r_captured(model, plan: Plan, batch: int, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R on the captured path at each forced share; one entry per share, written as it is measured."""
    router = model.router
    forced = ForcedRouter(router, batch, plan.tokens)
    model.router, runs = forced, []
    try:
        for share in plan.shares:
            forced.set_schedule(decisions(plan, share, batch))
            call = lambda: model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)  # noqa: E731
            run = {"p": share, "p_llm_call": len(llm_call_steps(decisions(plan, share, batch))) / plan.tokens,
                   "first_call_s": first_call(call, plan.device)}
            run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
            run["tokens_per_s"] = 1e3 * batch / run["ms_per_token"]
            runs.append(run)
            report.put("r2r_captured", str(batch), runs)
            fused = model.capture_store.state.fused  # what ran: a region that failed to compile fell back
            report.put("fused", str(batch), {role: regions is not None for role, regions in fused.items()})
    finally:
        model.router = router


def r2r_unfused(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R at p = 0.1, batch 1, on graphs of HF's own forward (what ``--unfused-graphs`` captures)."""
    store, router = model.capture_store, model.router
    forced = ForcedRouter(router, 1, plan.tokens)
    forced.set_schedule(decisions(plan, 0.1, 1))
    fuse, store.fuse, model.router = store.fuse, False, forced
    try:
        call = lambda: model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)  # noqa: E731
        run = {"p": 0.1, "first_call_s": first_call(call, plan.device)}
        run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
        report.put("r2r_unfused_ms", "1", run)
    finally:
        store.fuse, model.router = fuse, router
        store.clear()  # the next phase captures fused reads again


def r2r_router(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R at batch 1 with the real router, which the forced schedules cannot have (they keep per-step state): the
    router folded into the SLM's captured read and in the models' dtype (``core/fast/router_copy.py``). The threshold is the
    90th percentile of its never-routed scores, so about 10 % of tokens route; the share it routed is reported."""
    def call(threshold: float):
        return model.generate(prompt, **gen, cache_implementation="static", threshold=threshold,
                              return_dict_in_generate=True)

    probe = call(float("inf"))
    threshold = float(probe.router_scores[probe.generated_mask].float().quantile(0.9))
    run = {"threshold": threshold, "first_call_s": first_call(lambda: call(threshold), plan.device)}
    run["p_measured"] = float(call(threshold).llm_token_rate)
    state = model.capture_store.state
    run["router"] = {"folded": state.router_step is None, "dtype": str(next(state.scorer.module.parameters()).dtype)}
    report.put("r2r_router_ms", "1", run)
    run["ms_per_token"] = 1e3 * timed(lambda: call(threshold), plan.device, plan.repeats) / plan.tokens
    report.put("r2r_router_ms", "1", run)


def components(model, plan: Plan, batch: int, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """Captured and eager component costs at ``batch``, and each share's ideal time (and loop efficiency,
    where R2R at that share was measured): the schedules are rebuilt, so this needs no other phase."""
    router, forced = model.router, ForcedRouter(model.router, batch, plan.tokens)
    model.capture_store.clear()  # capture this batch size's state (and only it)
    model.router = forced
    try:
        model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)
    finally:
        model.router = router
    context = plan.prompt + plan.tokens // 2
    parts = captured_components(model.capture_store.state, context, plan.repeats, plan.device)
    eager = eager_components(model.slm, model.llm, forced, batch, plan.prompt, context, plan.device, plan.repeats)
    ms = lambda parts: {k: ({str(g): 1e3 * t for g, t in v.items()} if isinstance(v, dict) else 1e3 * v)  # noqa: E731
                        for k, v in parts.items()}
    report.put("components_ms", str(batch), {"captured": ms(parts), "eager": ms(eager)})
    measured = {r["p"]: r["ms_per_token"] for r in report.data.get("r2r_captured", {}).get(str(batch), [])}
    rows = []
    for share in plan.shares:
        ideal = 1e3 * ideal_per_token(llm_call_steps(decisions(plan, share, batch)), parts, eager, plan.prompt,
                                      plan.tokens)
        rows.append({"p": share, "ideal_ms": ideal,
                     "loop_efficiency": ideal / measured[share] if share in measured else None})
    report.put("cost_model", str(batch), rows)


def bf16_agreement(model, plan: Plan, report: Report) -> None:
    """Teacher-forced logits of the captured path against the eager one (dynamic cache), 2 rows."""
    from r2r_hf.core.layouts.model_calls import EagerCalls
    from r2r_hf.testing.agreement import agreement, teacher_forced

    length = plan.prompt + sum(AGREEMENT_READS) + 8
    ids = torch.randint(0, 1000, (2, length), device=plan.device, generator=torch.Generator(plan.device).manual_seed(3))
    reads = [plan.prompt + AGREEMENT_READS[0], *AGREEMENT_READS[1:]]
    k = model.config.num_topk_logits
    model.capture_store.clear()
    eager = EagerCalls(model.slm, model.llm, model.router, k, None, length)
    captured = model.capture_store.lend(model.slm, model.llm, model.router, k, None, 2, length)
    try:
        found = agreement(teacher_forced(eager, ids, plan.prompt, reads), teacher_forced(captured, ids, plan.prompt, reads))
    finally:
        captured.close()
    report.put("agreement", None, {"dtype": plan.dtype, "reads": reads, **{r: asdict(a) for r, a in found.items()}})


def r2r_eager(model, plan: Plan, prompt: torch.Tensor, gen: dict) -> float:
    """Eager R2R at p = 0.1, batch 1: ms per token."""
    router, forced = model.router, ForcedRouter(model.router, 1, plan.tokens)
    forced.set_schedule(decisions(plan, 0.1, 1))
    model.router = forced
    try:
        return 1e3 * timed(lambda: model.generate(prompt, **gen, threshold=0.5), plan.device, plan.repeats) / plan.tokens
    finally:
        model.router = router


def ratios(report: Report) -> None:
    """R2R's speed-up at each share against every LLM baseline measured so far, and never-route / the SLM on graphs."""
    d, found, never = report.data, {}, {}
    for batch, runs in d.get("r2r_captured", {}).items():
        for name in ("llm_graphs_ms", "llm_eager_ms", "llm_compiled_ms"):
            base = d.get(name, {}).get(batch)
            base = base.get("ms_per_token") if isinstance(base, dict) else base
            if isinstance(base, (int, float)):
                found.setdefault(batch, {})[name.removesuffix("_ms")] = {str(r["p"]): base / r["ms_per_token"]
                                                                          for r in runs}
        slm = d.get("slm_graphs_ms", {}).get(batch)
        zero = [r["ms_per_token"] for r in runs if r["p"] == 0.0]
        if slm and zero:  # the docs' target: within 1.10x
            never[batch] = zero[0] / slm
    report.put("speedups", None, found)
    report.put("never_route_over_slm_graphs", None, never)
    unfused, fused = d.get("r2r_unfused_ms", {}).get("1"), [r for r in d.get("r2r_captured", {}).get("1", [])
                                                            if r["p"] == 0.1]
    if unfused and fused:  # issue 32: the fused graphs' gain over HF's forward captured
        report.put("fused_over_unfused", "1", unfused["ms_per_token"] / fused[0]["ms_per_token"])


def serving(model, plan: Plan, report: Report) -> None:
    """The server's engine in-process under load (``benchmarks/gpu_serve.py``): captured with the GPU's waiting
    default and with m = 1, eager, the LLM alone, HF's generate_batch; each server's numbers as they come."""
    from benchmarks.gpu_serve import serving_phase, serving_shape

    # Its own deadline comes 10 s before the phase's: a load cut there still stops its engine and says so.
    deadline = time.monotonic() + plan.serve_budget_s * plan.slack - 10
    with serving_shape(model), torch.inference_mode():
        serving_phase(model, torch.device(plan.device), 0.1, plan.serve, plan.serve_tokens, plan.prompt,
                      lambda name, value: report.put("serving", name, value), deadline,
                      peer=not plan.emulate)  # HF's generate_batch warms up for ~20-30 s on a CPU: the device's only


def phases(plan: Plan, report: Report, ctx: dict) -> list[Phase]:
    """The in-process phases in their order (the module docstring says why); ``ctx`` holds the pair."""
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0)

    def make() -> None:
        ctx["model"] = build(plan)
        ctx["prompts"] = {b: torch.randint(0, 1000, (b, plan.prompt), device=plan.device,
                                           generator=torch.Generator(plan.device).manual_seed(b)) for b in plan.batches}

    def graphs(role: str, batch: int) -> Phase:
        def run() -> None:
            model = ctx["model"]
            report.put(f"{role}_graphs_ms", str(batch), 1e3 * graph_decode_per_token(
                getattr(model, role), ctx["prompts"][batch], plan.tokens, model.capture_store.graph_step, plan.device,
                plan.repeats))
        return Phase(f"{role}_graphs_{batch}", 40 if role == "llm" else 20, run, ("build",))

    def eager(role: str, batch: int) -> Phase:
        def run() -> None:
            model, prompt = ctx["model"], ctx["prompts"][batch]
            ms = (r2r_eager(model, plan, prompt, gen) if role == "r2r" else
                  1e3 * timed(lambda: getattr(model, role).generate(prompt, **gen), plan.device, plan.repeats)
                  / plan.tokens)
            report.put(f"{role}_eager_ms", str(batch), {"0.1": ms} if role == "r2r" else ms)
        return Phase(f"{role}_eager_{batch}", {"llm": 45, "slm": 20, "r2r": 30}[role], run, ("build",))

    def per_batch(batch: int) -> list[Phase]:
        first = batch == plan.batches[0]  # the regions compile in batch 1's first calls
        return [Phase(f"r2r_captured_{batch}", 120 if first else 75,
                      lambda: r2r_captured(ctx["model"], plan, batch, ctx["prompts"][batch], gen, report), ("build",)),
                graphs("llm", batch), graphs("slm", batch),
                Phase(f"components_{batch}", 45, lambda: components(ctx["model"], plan, batch, ctx["prompts"][batch],
                                                                     gen, report), ("build",))]

    one, *more = plan.batches
    listed = [Phase("conditions", 30, lambda: report.put("conditions", None, conditions(plan))),
              Phase("build", 90, make),
              *per_batch(one),
              Phase("r2r_unfused_1", 40, lambda: r2r_unfused(ctx["model"], plan, ctx["prompts"][one], gen, report),
                    ("build",)),
              Phase("r2r_router_1", 40, lambda: r2r_router(ctx["model"], plan, ctx["prompts"][one], gen, report),
                    ("build",)),
              Phase("agreement", 60, lambda: bf16_agreement(ctx["model"], plan, report), ("build",)),
              Phase("serving", plan.serve_budget_s, lambda: serving(ctx["model"], plan, report), ("build",)),
              *[p for b in more for p in per_batch(b)],
              eager("llm", one), eager("slm", one), eager("r2r", one), *[eager("llm", b) for b in more]]
    return [replace(p, budget_s=p.budget_s * plan.slack) for p in listed]


def compiled_llm(plan: Plan, out: Path, kill_at: float, fail: str | None) -> None:
    """Child process: HF's compiled llm.generate (static cache + HF's CompileConfig), batch 1, under its guard.

    ``kill_at``: the parent's ``time.monotonic()`` at which it kills this process (one clock for both on Linux).
    """
    report = Report(out / "llm_compiled.json", asdict(plan))
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0,
               cache_implementation="static")
    if plan.device == "cpu":  # HF compiles only on accelerators unless told; the dry run tells it
        from transformers.generation.configuration_utils import CompileConfig

        gen["compile_config"] = CompileConfig(mode="default")
        gen["compile_config"]._compile_all_devices = True

    def run() -> None:
        llm = random_model(plan.llm, getattr(torch, plan.dtype), plan.device, 1)
        prompt = torch.randint(0, 1000, (1, plan.prompt), device=plan.device)
        call = lambda: llm.generate(prompt, **gen)  # noqa: E731
        found = {"first_call_s": first_call(call, plan.device)}  # the compile: kept if the timed runs are cut
        report.put("llm_compiled_ms", "1", found)
        report.put("llm_compiled_ms", "1", {**found, "ms_per_token": 1e3 * timed(call, plan.device, plan.repeats)
                                            / plan.tokens})

    # Its own deadline ends a little before the parent's kill, so the traceback says where the time went.
    left = kill_at - time.monotonic() - 5
    run_phases([Phase(COMPILED, left, run)], report, until_s=report.elapsed() + left, fail=fail)


def run_compiled(plan: Plan, out: Path, report: Report, dry_run: bool, fail: str | None) -> None:
    """The compiled baseline in a fresh process, killed at what is left of the check; its numbers and errors merged."""
    seconds = max(plan.deadline_s - report.elapsed() - 5, 1)
    report.mark(f"{COMPILED} (a fresh process, deadline {seconds:.0f} s)")
    report.put("llm_compiled_ms", None, {"status": f"running (deadline {seconds:.0f} s)"})
    kill_at = time.monotonic() + seconds
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out), "--only-compiled", f"{kill_at:.1f}"]
    command += (["--dry-run"] if dry_run else []) + (["--fail-phase", fail] if fail else [])
    start, status, error = report.elapsed(), "finished", None
    try:
        subprocess.run(command, timeout=seconds, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        status, error = f"cut at its deadline of {seconds:.0f} s", describe(PhaseTimeout(f"killed at {seconds:.0f} s"))
    except subprocess.CalledProcessError as err:
        status = f"failed (exit {err.returncode}; see the log)"
    child = out / "llm_compiled.json"
    found = json.loads(child.read_text()) if child.exists() else {}
    error = found.get("errors", {}).get(COMPILED) or error  # the child's own account first (it has the traceback)
    if status == "finished" and error is not None:  # it stopped itself (its deadline, or an exception)
        status = f"{error['type']}: {error['message'][:200]}"
    if error is None and status != "finished":
        error = {"type": "ChildFailed", "message": status, "traceback": []}
    report.put("llm_compiled_ms", None, {**found.get("llm_compiled_ms", {}), "status": status})
    report.put("phase_s", COMPILED, round(report.elapsed() - start, 1))
    if error is not None:
        report.put("errors", COMPILED, error)


def names(plan: Plan) -> list[str]:
    """Every phase's name, in order (what ``--fail-phase`` accepts)."""
    return [p.name for p in phases(plan, Report(Path(os.devnull), {}), {})] + [COMPILED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json (and llm_compiled.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, emulated graphs")
    parser.add_argument("--fail-phase", default=os.environ.get("GPU_CHECK_FAIL_PHASE") or None, metavar="NAME",
                        help="tests only: raise in phase NAME to show that every other phase still runs "
                             "(default: $GPU_CHECK_FAIL_PHASE)")
    parser.add_argument("--only-compiled", type=float, metavar="KILL_AT", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    plan = DRY_RUN if args.dry_run else DEVICE
    if args.fail_phase and args.fail_phase not in names(plan):  # a typo would make the test pass vacuously
        parser.error(f"--fail-phase {args.fail_phase!r}: not a phase ({', '.join(names(plan))})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    if args.only_compiled is not None:
        with torch.no_grad():
            compiled_llm(plan, out, args.only_compiled, args.fail_phase)
        return 0
    report, ctx = Report(out / "gpu_check.json", asdict(plan)), {}
    with torch.no_grad():
        run_phases(phases(plan, report, ctx), report, until_s=plan.deadline_s - plan.compile_seconds - CHILD_START_S,
                   fail=args.fail_phase, recover=lambda: free(plan.device), after=lambda: ratios(report))
    model = ctx.get("model")
    freed = weakref.ref(model) if model is not None else None
    ctx.clear()
    del model
    free(plan.device)  # gc.collect() first: the pair is a reference cycle that ``del`` alone leaves on the GPU
    report.put("before_compiled", None, {
        "parent_model_freed": None if freed is None else freed() is None,
        "cuda_allocated_gb": torch.cuda.memory_allocated() / 2**30 if plan.device.startswith("cuda") else None})
    run_compiled(plan, out, report, args.dry_run, args.fail_phase)
    ratios(report)
    report.mark(f"done; {len(report.errors)} phase(s) failed: {', '.join(report.errors) or 'none'}")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
