"""The peers, HF's own ways of running the LLM alone, in a fresh process after the measurements (their pair went
with theirs), then merged: a step of ``check.sh`` of its own.

    python -m benchmarks.gpu.compiled --out DIR [--dry-run]                # writes DIR/llm_compiled.json
    python -m benchmarks.gpu.compiled --out DIR --merge EXIT [--seconds S] # into DIR/gpu_check.json, with the ratios

In order, each under its own guard within the step's seconds:

* ``hf_generate_batch``: HF's continuous batching (``generate_batch``, paged attention) at 8 and 16 users, outside
  inference mode (on the first device run it answered nothing: "Inplace update to inference tensor outside
  InferenceMode", in a process whose server had run in inference mode). On a CPU it takes about a minute to start,
  so the dry run records it as not run;
* ``compiled_llm``: HF's compiled ``llm.generate`` (static cache + HF's ``CompileConfig``), batch 1. Its cold compile
  of 64 layers is a coin flip inside 150 s (the review's estimate), so it comes after every in-process number and its
  failure costs nothing else; the fused LLM alone (``llm_fused_1``) is the in-process denominator that does not depend
  on it. Batch 1 only: HF's ``CompileConfig(dynamic=True)`` makes every shape symbolic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.gpu.plan import DEVICE, DRY_RUN, Plan
from benchmarks.gpu.ratios import ratios
from benchmarks.gpu.runner import Phase, PhaseTimeout, Report, describe, run_phases

COMPILED, BATCHED = "compiled_llm", "hf_generate_batch"


def measure(plan: Plan, out: Path, fail: set[str] | None, seconds: float) -> int:
    """Load a random LLM, then each peer within ``seconds``: under the runner's guard, which stops them before the
    step's timeout (check.sh gives 20 s more) so the traceback says where the time went."""
    import torch

    from benchmarks.speed.parts import first_call, timed
    from benchmarks.synthetic import random_model

    report = Report(out / "llm_compiled.json", asdict(plan))
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0,
               cache_implementation="static")
    if plan.device == "cpu":  # HF compiles only on accelerators unless told; the dry run tells it
        from transformers.generation.configuration_utils import CompileConfig

        gen["compile_config"] = CompileConfig(mode="default")
        gen["compile_config"]._compile_all_devices = True

    built: dict = {}

    def llm():  # loaded by the first peer that runs (under its guard)
        if "llm" not in built:
            built["llm"] = random_model(plan.llm, getattr(torch, plan.dtype), plan.device, 1)
        return built["llm"]

    def batched() -> None:
        from benchmarks.gpu.serve import hf_continuous_batching

        if plan.emulate:
            report.put(BATCHED, None, [{"status": "not run in the dry run: it takes about a minute to start on a CPU"}])
            return
        vocab = llm().get_input_embeddings().weight.shape[0]
        report.put(BATCHED, None, hf_continuous_batching(llm(), tuple(sorted(set(plan.serve))), plan.serve_tokens,
                                                         plan.prompt, vocab, time.monotonic() + seconds / 2))

    def run() -> None:
        prompt = torch.randint(0, 1000, (1, plan.prompt), device=plan.device)
        call = lambda: llm().generate(prompt, **gen)  # noqa: E731
        found = {"first_call_s": first_call(call, plan.device)}  # the compile: kept if the timed runs are cut
        report.put("llm_compiled_ms", "1", found)
        report.put("llm_compiled_ms", "1", {**found, "ms_per_token": 1e3 * timed(call, plan.device, plan.repeats)
                                            / plan.tokens})

    torch.set_num_threads(1 if plan.emulate else torch.get_num_threads())
    with torch.no_grad():
        run_phases([Phase(BATCHED, seconds / 2, batched), Phase(COMPILED, seconds, run)], report, until_s=seconds,
                   fail=fail)
    return 1 if report.errors else 0


def merge(out: Path, exit_code: int, timeout: float | None) -> dict:
    """The child's numbers and status (or why it has none) into ``gpu_check.json``; the ratios again."""
    check = out / "gpu_check.json"
    data = json.loads(check.read_text()) if check.exists() else {"plan": {}, "timeline": [], "errors": {}, "phase_s": {}}
    child = out / "llm_compiled.json"
    found = json.loads(child.read_text()) if child.exists() else {}
    error = found.get("errors", {}).get(COMPILED)  # the child's own account first (it has the traceback)
    if exit_code < 0:  # check.sh left too little time to start it
        status = "not run: too little of the script's time was left"
        error = {"type": "Skipped", "message": status, "traceback": []}
    elif exit_code in (124, 137):  # killed by the step's timeout (check.sh)
        status = f"cut at the step's timeout of {timeout or 0:.0f} s"
        error = error or describe(PhaseTimeout(status))
    elif error is not None:
        status = f"{error['type']}: {error['message'][:200]}"
    elif exit_code != 0:
        status = f"failed (exit {exit_code}; see gpu_compiled.log)"
        error = {"type": "ChildFailed", "message": status, "traceback": []}
    else:
        status = "finished"
    data["llm_compiled_ms"] = {**found.get("llm_compiled_ms", {}), "status": status}
    data["phase_s"][COMPILED] = found.get("phase_s", {}).get(COMPILED)
    if error is not None:
        data["errors"][COMPILED] = error
    if BATCHED in found.get("phase_s", {}):  # the first peer: its numbers, or its own error
        data[BATCHED], data["phase_s"][BATCHED] = found.get(BATCHED), found["phase_s"][BATCHED]
        if BATCHED in found.get("errors", {}):
            data["errors"][BATCHED] = found["errors"][BATCHED]
    data.update(ratios(data))
    check.write_text(json.dumps(data, indent=1, default=str))
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    parser.add_argument("--merge", type=int, metavar="EXIT", help="merge the child that exited with EXIT (-1: not run)")
    parser.add_argument("--seconds", type=float, help="the child's own deadline (default: the plan's compile_s); "
                        "with --merge, the step's timeout (what a cut says)")
    parser.add_argument("--fail-phase", default=os.environ.get("GPU_CHECK_FAIL_PHASE") or None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.merge is not None:
        data = merge(out, args.merge, args.seconds)
        print(f"compiled llm.generate: {data['llm_compiled_ms']['status']}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    plan = DRY_RUN if args.dry_run else DEVICE
    failing = set(args.fail_phase.split(",")) if args.fail_phase else None
    return measure(plan, out, failing, args.seconds or plan.compile_s)


if __name__ == "__main__":
    sys.exit(main())
