"""Speculative routing on the real pair (issue 43): what it saves, what it throws away, what it costs, on this CPU.

    python -m benchmarks.quality.speculation [--tasks 16] [--speed-tasks 4] [--max-new-tokens 192] [--threads 1]

The shipped router with Qwen2.5-Coder 0.5B + 1.5B Instruct (``benchmarks/models.py``), greedy, batch 1, the first
``--tasks`` HumanEval tasks by prompt length (``benchmarks.quality.humaneval.by_length``), chat template, bf16. Phases
(each writes its numbers to ``--out`` as soon as it has them; a rerun skips the phases and thresholds already there):

* ``quality_cost``  R2R with speculation at thresholds routing ~5 / 10 / 20 / 40 % of the SLM's own answers to those
  tasks (read back through the router, as ``benchmarks.quality.humaneval``'s ``r2r@P``), the router's threshold and 0:
  LLM forwards per generated token with speculation and without it (batch-1 ``generate`` runs one LLM forward per routed
  token: the routed share), tokens thrown away per generated token, agreement at routed positions, pass@1 on those
  tasks. Speculation does not change an answer (the next phases check it on real text), so the pass@1 is R2R's.
* ``batch1``  at the router's threshold on ``--speed-tasks`` tasks: R2R without and with speculation, interleaved
  task by task, tokens/s and counters; the answers must be equal.
* ``threshold0``  the LLM's own answer three ways, interleaved: ``llm.generate``, R2R at threshold 0 with
  speculation, and ``llm.generate`` with the SLM as assistant (HF assisted generation); the answers must be equal.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.models import ROUTER
from benchmarks.quality.humaneval import Runner, by_length, extract_code, program_for, _problems
from benchmarks.quality.sandbox import run_program
from benchmarks.record import hardware, versions

RATES = (0.05, 0.10, 0.20, 0.40)


def _save(out: dict, path: Path) -> None:
    path.write_text(json.dumps(out, indent=1))


def answer(runner: Runner, problem: dict, threshold: float | None, **options) -> tuple[list[int], dict, float]:
    """One greedy answer (its ids up to EOS), its counters and its seconds; ``threshold`` None: ``llm.generate``."""
    tok = runner.tok
    ids = tok(runner.chat_text(problem), return_tensors="pt", add_special_tokens=False)
    greedy = dict(max_new_tokens=runner.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    start = time.perf_counter()
    if threshold is None:
        sequences, counters = runner.llm.generate(**ids, **greedy, **options), {}
    else:
        out = runner.r2r.generate(**ids, **greedy, threshold=threshold, return_dict_in_generate=True, **options)
        sequences, counters = out.sequences, dict(out.counters, llm_token_rate=out.llm_token_rate)
    seconds = time.perf_counter() - start
    row = sequences[0, ids["input_ids"].shape[1]:].tolist()
    eos = {tok.eos_token_id, tok.pad_token_id}
    end = next((j for j, t in enumerate(row) if t in eos), None)
    return (row if end is None else row[: end + 1]), counters, seconds


def quality_cost(runner: Runner, problems: list[dict], thresholds: dict, speculate: dict, out: dict, path: Path):
    """Per threshold: pass@1 and what speculation did (see the module docstring)."""
    table = out.setdefault("quality_cost", {})
    for name, threshold in thresholds.items():
        if name in table:
            continue
        tokens = routed = thrown = agreed = rejected = llm_forwards = passed = 0
        seconds = 0.0
        for problem in problems:
            ids, c, s = answer(runner, problem, threshold, **speculate)
            tokens, seconds = tokens + len(ids), seconds + s
            routed += round(c["llm_token_rate"] * c["generated"])
            llm_forwards, thrown = llm_forwards + c["llm_forwards"], thrown + c["thrown"]
            agreed, rejected = agreed + c["speculative_agreed"], rejected + c["speculative_rejected"]
            code = extract_code(runner.tok.decode(ids, skip_special_tokens=True))
            passed += run_program(program_for(problem, code), timeout=10.0).passed
        table[name] = {"threshold": threshold, "tasks": len(problems), "pass_at_1": passed / len(problems),
                       "llm_token_rate": routed / tokens, "generated_tokens": tokens,
                       "llm_forwards_per_token": llm_forwards / tokens,
                       "llm_forwards_per_token_without": routed / tokens,
                       "thrown_per_token": thrown / tokens, "agreement_at_routed": agreed / max(agreed + rejected, 1),
                       "tokens_per_s": tokens / seconds}
        print(name, json.dumps(table[name]), flush=True)
        _save(out, path)


def side_by_side(runner: Runner, problems: list[dict], systems: dict, phase: str, out: dict, path: Path) -> None:
    """Each system answers every task, interleaved task by task (drift hits all alike); tokens/s, counters, and
    whether every answer equals the first system's."""
    if phase in out:
        return
    found = {name: {"tokens": 0, "seconds": 0.0, "answers": [], "counters": []} for name in systems}
    for problem in problems:
        for name, (threshold, options) in systems.items():
            ids, c, s = answer(runner, problem, threshold, **options)
            found[name]["tokens"] += len(ids)
            found[name]["seconds"] += s
            found[name]["answers"].append(ids)
            found[name]["counters"].append(c)
    first = next(iter(found.values()))["answers"]
    result = {}
    for name, f in found.items():
        counters = [c for c in f["counters"] if c]
        generated = sum(c["generated"] for c in counters)
        total = {k: sum(c[k] for c in counters) for k in ("llm_forwards", "thrown", "speculative_agreed",
                                                          "speculative_rejected")} if counters else {}
        per = {"llm_forwards_per_token": total["llm_forwards"] / generated, "thrown_per_token": total["thrown"] /
               generated} if counters else {}
        result[name] = {"tokens": f["tokens"], "tokens_per_s": f["tokens"] / f["seconds"], "same_answers": f["answers"]
                        == first, **total, **per}
    out[phase] = result
    print(phase, json.dumps(result), flush=True)
    _save(out, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default=ROUTER)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--speed-tasks", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--speculate", type=int, default=8, help="pending positions a row may hold")
    parser.add_argument("--wait", type=int, default=32, help="steps the oldest pending position may wait")
    parser.add_argument("--speculate-below", type=float, default=None,
                        help="a routed row goes on only where the router's score is below this (default: everywhere)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--phases", default="quality_cost,batch1,threshold0")
    parser.add_argument("--out", default="benchmarks/results/speculation.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = Path(args.out)
    out = json.loads(path.read_text()) if path.exists() else {}
    runner = Runner(args.router, None, args.max_new_tokens, getattr(torch, args.dtype))
    problems = by_length(_problems())[: args.tasks]
    speculate = {"speculate": args.speculate, "llm_max_wait": args.wait}
    if args.speculate_below is not None:
        speculate["speculate_below"] = args.speculate_below
    out["conditions"] = {"tasks": [p["task_id"] for p in problems], "max_new_tokens": args.max_new_tokens,
                         "dtype": args.dtype, "threads": args.threads, "speculation": speculate,
                         **versions(), "cpu": hardware(), "router": args.router}
    phases = args.phases.split(",")
    if "quality_cost" in phases:
        slm = [(p, runner.tok.decode(answer(runner, p, float("inf"))[0], skip_special_tokens=True)) for p in problems]
        scores = runner.transcript_scores(runner.r2r, slm)
        thresholds = {f"routes ~{round(100 * r)} %": float(torch.quantile(scores.float(), 1 - r)) for r in RATES}
        thresholds |= {"the router's threshold": runner.r2r.config.threshold, "0 (the LLM's answer)": 0.0}
        quality_cost(runner, problems, thresholds, speculate, out, path)
    speed = problems[: args.speed_tasks]
    tau = runner.r2r.config.threshold
    if "batch1" in phases:
        side_by_side(runner, speed, {"r2r": (tau, {}), "r2r, speculating": (tau, speculate)}, "batch1", out, path)
    if "threshold0" in phases:
        side_by_side(runner, speed, {"llm.generate": (None, {}), "r2r at threshold 0, speculating": (0.0, speculate),
                                     "llm.generate, SLM assisting": (None, {"assistant_model": runner.slm})},
                     "threshold0", out, path)
    _save(out, path)
    return out


if __name__ == "__main__":
    main()
