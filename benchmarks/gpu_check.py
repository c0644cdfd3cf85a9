"""The device check's measurements, most important first, each written down the moment it is taken.

    python -m benchmarks.gpu_check --out DIR             # on the GPU (benchmarks/gpu_check.sh runs it)
    python -m benchmarks.gpu_check --out DIR --dry-run   # the same steps on a CPU: tiny shapes, emulated graphs

A lent GPU may come once, for minutes, so the order is what matters most to what costs most, and
``DIR/gpu_check.json`` is rewritten after every number (a run cut short keeps what it measured):

1. R2R on the captured path (CUDA graphs) at forced routed shares p = 0 / 0.05 / 0.1 / 0.2,
   batch 1 (a fixed schedule) and batch 8 (rows routed independently); first call (the captures) timed apart;
2. the captured component costs (t_SLM, t_router, t_LLM per bucket) and the cost model they add up to;
3. teacher-forced agreement of captured and eager logits in bf16 (the tolerance the README states);
4. the LLM alone on CUDA graphs (its one-token step replayed, no host sync): the compile-free baseline;
5. eager ``llm.generate`` (batch 1 and 8), eager ``slm.generate`` and eager R2R at p = 0.1 (batch 1);
6. last, under its own deadline in a fresh process (the parent frees the GPU first): HF's compiled
   ``llm.generate`` (static cache + torch.compile), whose compile alone may take minutes for a 32B.

Weights are random (speed does not depend on them) and the routed share is forced (``ForcedRouter``
runs the real router every step and routes on a schedule), as in ``benchmarks/speed.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers

from benchmarks.speed_parts import (
    ForcedRouter,
    captured_components,
    eager_components,
    first_call,
    graph_decode_per_token,
    ideal_per_token,
    llm_call_steps,
    random_model,
    schedule,
    timed,
)
from r2r_hf import R2RForCausalLM
from r2r_hf.core.engines import EagerSteps


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
    compile_seconds: float  # the compiled baseline's own deadline (compile included)
    emulate: bool  # CPU: emulated CUDA graphs


DEVICE = Plan("qwen2.5-1.5b", "qwen2.5-32b", "bfloat16", "cuda", prompt=64, tokens=128, batches=(1, 8),
              shares=(0.0, 0.05, 0.1, 0.2), repeats=2, compile_seconds=150, emulate=False)
DRY_RUN = Plan("tiny", "tiny-llm", "bfloat16", "cpu", prompt=16, tokens=24, batches=(1, 8),
               shares=(0.0, 0.05, 0.1, 0.2), repeats=1, compile_seconds=30, emulate=True)
AGREEMENT_READS = [3, 1, 70, 2, 40]  # LLM catch-ups after the prompt: a step, a gap longer than the buckets...


class Report:
    """The check's JSON, rewritten (atomically) after every measurement."""

    def __init__(self, path: Path, plan: Plan) -> None:
        self.path, self.started = path, time.monotonic()
        self.data: dict = {"plan": asdict(plan), "timeline": []}

    def put(self, section: str, key: str | None, value) -> None:
        if key is None:
            self.data[section] = value
        else:
            self.data.setdefault(section, {})[key] = value
        self.write()

    def mark(self, step: str) -> None:
        self.data["timeline"].append({"step": step, "at_s": round(time.monotonic() - self.started, 1)})
        print(f"[{self.data['timeline'][-1]['at_s']:7.1f} s] {step}", flush=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def _conditions(plan: Plan) -> dict:
    cuda = plan.device.startswith("cuda")
    return {"hardware": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "weights": "random", "graphs": "emulated on the CPU (r2r_hf.testing.graphs)" if plan.emulate else "CUDA",
            "decoding": "greedy, min_new_tokens = max_new_tokens (every call writes the same number of tokens)"}


def build(plan: Plan) -> tuple[R2RForCausalLM, torch.nn.Module]:
    """The pair with the paper's router (1024 x 6 blocks), and that router."""
    dtype = getattr(torch, plan.dtype)
    slm, llm = random_model(plan.slm, dtype, plan.device, 0), random_model(plan.llm, dtype, plan.device, 1)
    dims = [1024] * 6 if not plan.emulate else [64] * 2
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=dims)
    if plan.emulate:
        from r2r_hf.testing.graphs import emulated_store

        model.capture_store = emulated_store()
    return model, model.router


def r2r_runs(model, router, plan: Plan, batch: int, report: Report, prompt: torch.Tensor, gen: dict) -> list[dict]:
    """R2R on the captured path at each forced share; one entry per share, written as it is measured."""
    forced = ForcedRouter(router, batch, plan.tokens)
    model.router, runs = forced, []
    try:
        for share in plan.shares:
            decisions = schedule(share, batch, plan.tokens, per_row=batch > 1)
            forced.set_schedule(decisions)
            call = lambda: model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)  # noqa: E731
            run = {"p": share, "p_llm_call": len(llm_call_steps(decisions)) / plan.tokens,
                   "first_call_s": first_call(call, plan.device)}
            run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
            run["tokens_per_s"] = 1e3 * batch / run["ms_per_token"]
            run["decisions"] = decisions
            runs.append(run)
            report.put("r2r_captured", str(batch), [{k: v for k, v in r.items() if k != "decisions"} for r in runs])
    finally:
        model.router = router
    return runs


def cost_model(model, router, plan: Plan, batch: int, runs: list[dict], report: Report) -> None:
    """Captured and eager component costs, and each run's ideal time and loop efficiency."""
    state = model.capture_store.state
    context = plan.prompt + plan.tokens // 2
    parts = captured_components(state, context, plan.repeats, plan.device)
    eager = eager_components(model.slm, model.llm, router, batch, plan.prompt, context, plan.device, plan.repeats)
    ms = lambda parts: {k: ({str(g): 1e3 * t for g, t in v.items()} if isinstance(v, dict) else 1e3 * v)  # noqa: E731
                        for k, v in parts.items()}
    report.put("components_ms", str(batch), {"captured": ms(parts), "eager": ms(eager)})
    model_rows = []
    for run in runs:
        ideal = ideal_per_token(llm_call_steps(run["decisions"]), parts, eager, plan.prompt, plan.tokens)
        model_rows.append({"p": run["p"], "ideal_ms": 1e3 * ideal, "loop_efficiency": 1e3 * ideal / run["ms_per_token"]})
    report.put("cost_model", str(batch), model_rows)


def bf16_agreement(model, plan: Plan, report: Report) -> None:
    """Teacher-forced logits of the captured path against the eager one (dynamic cache), 2 rows."""
    from r2r_hf.testing.agreement import agreement, teacher_forced

    length = plan.prompt + sum(AGREEMENT_READS) + 8
    ids = torch.randint(0, 1000, (2, length), device=plan.device, generator=torch.Generator(plan.device).manual_seed(3))
    reads = [plan.prompt + AGREEMENT_READS[0], *AGREEMENT_READS[1:]]
    k = model.config.num_topk_logits
    eager = EagerSteps(model.slm, model.llm, model.router, k, None, length)
    captured = model.capture_store.lend(model.slm, model.llm, model.router, k, None, 2, length)
    try:
        found = agreement(teacher_forced(eager, ids, plan.prompt, reads), teacher_forced(captured, ids, plan.prompt, reads))
    finally:
        captured.close()
    report.put("agreement", None, {"dtype": plan.dtype, "reads": reads, **{r: asdict(a) for r, a in found.items()}})


def baselines(model, plan: Plan, report: Report, prompts: dict[int, torch.Tensor], gen: dict) -> None:
    """The LLM alone on CUDA graphs; eager llm/slm.generate; eager R2R at p = 0.1, batch 1."""
    graph_step = model.capture_store.graph_step
    for batch, prompt in prompts.items():
        report.put("llm_graphs_ms", str(batch), 1e3 * graph_decode_per_token(
            model.llm, prompt, plan.tokens, graph_step, plan.device, plan.repeats))
    for batch, prompt in prompts.items():
        report.put("llm_eager_ms", str(batch),
                   1e3 * timed(lambda: model.llm.generate(prompt, **gen), plan.device, plan.repeats) / plan.tokens)
    prompt = prompts[1]
    report.put("slm_eager_ms", "1",
               1e3 * timed(lambda: model.slm.generate(prompt, **gen), plan.device, plan.repeats) / plan.tokens)
    forced = ForcedRouter(model.router, 1, plan.tokens)
    forced.set_schedule(schedule(0.1, 1, plan.tokens, per_row=False))
    real, model.router = model.router, forced
    try:
        report.put("r2r_eager_ms", "1", {"0.1": 1e3 * timed(lambda: model.generate(prompt, **gen, threshold=0.5),
                                                            plan.device, plan.repeats) / plan.tokens})
    finally:
        model.router = real


def speedups(report: Report) -> None:
    """R2R's speed-up at each share against every LLM baseline measured so far."""
    d, found = report.data, {}
    for batch, runs in d.get("r2r_captured", {}).items():
        for name in ("llm_graphs_ms", "llm_eager_ms", "llm_compiled_ms"):
            base = d.get(name, {}).get(batch)
            base = base.get("ms_per_token") if isinstance(base, dict) else base
            if isinstance(base, (int, float)):
                found.setdefault(batch, {})[name.removesuffix("_ms")] = {str(r["p"]): base / r["ms_per_token"]
                                                                          for r in runs}
    report.put("speedups", None, found)


def compiled_llm(plan: Plan, out: Path) -> None:
    """Child process: HF's compiled llm.generate (static cache + HF's CompileConfig), batch 1 then 8."""
    report = Report(out / "llm_compiled.json", plan)
    llm = random_model(plan.llm, getattr(torch, plan.dtype), plan.device, 1)
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0,
               cache_implementation="static")
    if plan.device == "cpu":  # HF compiles only on accelerators unless told; the dry run tells it
        from transformers.generation.configuration_utils import CompileConfig

        gen["compile_config"] = CompileConfig(mode="default")
        gen["compile_config"]._compile_all_devices = True
    for batch in plan.batches:
        prompt = torch.randint(0, 1000, (batch, plan.prompt), device=plan.device)
        call = lambda: llm.generate(prompt, **gen)  # noqa: E731
        first = first_call(call, plan.device)
        report.put("llm_compiled_ms", str(batch), {"first_call_s": first,
                                                   "ms_per_token": 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens})


def run_compiled_with_deadline(plan: Plan, out: Path, report: Report, dry_run: bool) -> None:
    """The compiled baseline in a fresh process, killed at ``plan.compile_seconds``; what it measured is merged."""
    report.put("llm_compiled_ms", None, {"status": f"running (deadline {plan.compile_seconds:.0f} s)"})
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out), "--only-compiled"]
    command += ["--dry-run"] if dry_run else []
    try:
        subprocess.run(command, timeout=plan.compile_seconds, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        status = "finished"
    except subprocess.TimeoutExpired:
        status = f"cut at its deadline of {plan.compile_seconds:.0f} s"
    except subprocess.CalledProcessError as err:
        status = f"failed (exit {err.returncode}; see the log)"
    child = out / "llm_compiled.json"
    measured = json.loads(child.read_text()).get("llm_compiled_ms", {}) if child.exists() else {}
    report.put("llm_compiled_ms", None, {**measured, "status": status})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu_check.json (and llm_compiled.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, emulated graphs")
    parser.add_argument("--only-compiled", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    plan = DRY_RUN if args.dry_run else DEVICE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1 if args.dry_run else torch.get_num_threads())
    if args.only_compiled:
        with torch.no_grad():
            compiled_llm(plan, out)
        return 0
    report = Report(out / "gpu_check.json", plan)
    report.put("conditions", None, _conditions(plan))
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        report.mark("build the models")
        model, router = build(plan)
        prompts = {b: torch.randint(0, 1000, (b, plan.prompt), device=plan.device,
                                    generator=torch.Generator(plan.device).manual_seed(b)) for b in plan.batches}
        runs = {}
        for batch in plan.batches:
            report.mark(f"R2R captured, batch {batch}")
            runs[batch] = r2r_runs(model, router, plan, batch, report, prompts[batch], gen)
            speedups(report)
        for batch in plan.batches:
            report.mark(f"components and cost model, batch {batch}")
            model.router = router
            model.capture_store.clear()
            forced = ForcedRouter(router, batch, plan.tokens)  # re-capture this batch size's state
            model.router = forced
            model.generate(prompts[batch], **gen, cache_implementation="static", threshold=0.5)
            model.router = router
            cost_model(model, forced, plan, batch, runs[batch], report)
        report.mark("bf16 agreement, captured vs eager")
        model.capture_store.clear()
        bf16_agreement(model, plan, report)
        report.mark("baselines: LLM on graphs, eager generate")
        baselines(model, plan, report, prompts, gen)
        speedups(report)
        del model, router
    if plan.device.startswith("cuda"):
        torch.cuda.empty_cache()  # the compiled baseline builds its own LLM
    report.mark("compiled llm.generate (last, own deadline)")
    run_compiled_with_deadline(plan, out, report, args.dry_run)
    speedups(report)
    report.mark("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
