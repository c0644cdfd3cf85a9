"""How deep a row at threshold 0 should draft: candidate rules replayed over the real pair's agreement, at batch 1.

    python -m benchmarks.speed.depth_rules --record [--tasks 30]   # the traces (both models, teacher-forced)
    python -m benchmarks.speed.depth_rules                         # the rules over them (no model: seconds)
    python -m benchmarks.speed.depth_rules --device h200           # ... with the first H200 run's costs (predicted)

A trace is, per token of the LLM's recorded greedy answer to a HumanEval task (``results/humaneval/llm.jsonl``, the
30 longest: 9,393 tokens), whether the SLM's argmax there (given the LLM's prefix) is the LLM's token and the SLM's
probability of it: one cache-free forward of each model over prompt + answer. At threshold 0 that decides every draft
whatever its length: a draft from a confirmed prefix is the SLM's argmax at each position while it agrees, and the
first position it does not is the LLM's to write. So a rule's drafts, the LLM's forwards, the SLM's forwards and the
tokens thrown away follow exactly from a trace (how R2R drafts at batch 1: a draft ends at its depth or, with
``draft_confidence``, at the SLM's unsure token, with the frontier; the SLM reads each drafted token but the last,
and the last with the LLM's next in one forward), and a time from this CPU's costs per forward (``COSTS``, measured
by ``--costs``). ``plan.adapted`` is the rule R2R runs; the others are candidates.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from r2r_hf.core.plan import DRAFT_FIRST, adapted

TRACES = Path("benchmarks/results/depth_traces_bfloat16.json")
OUT = Path("benchmarks/results/depth_rules.json")
# Seconds per forward on this CPU (bf16, one thread, a 300-token cache, load average ~9.5 from others' work: only
# ratios matter): the SLM's one-token step, the LLM's forward over k tokens (``--costs`` measures them again).
COSTS = {"slm": 0.209, "llm": {1: 0.526, 5: 0.504, 9: 0.544, 13: 0.551, 17: 0.553, 21: 0.561, 33: 0.690}}
CALIBRATED = Path("benchmarks/results/gpu_calibrated.json")


def h200_costs(path: Path = CALIBRATED) -> dict:
    """The first device run's costs at one row (``gpu_calibrated.json``; R1-Distill-Qwen 1.5B + 32B on an H200), in
    seconds: the fused SLM step and the 32B's captured read of k tokens, each with the host's time per step. A
    **prediction** where the traces are another pair's (the coder pair's agreement with the H200 pair's costs)."""
    costs = json.loads(path.read_text())["costs"]
    host = costs["host_ms_per_step"]
    return {"slm": (costs["slm_ms"]["1x1"] + host) / 1e3,
            "llm": {int(k.split("x")[1]): (v + host) / 1e3 for k, v in costs["llm_ms"].items() if k.startswith("1x")}}

# A rule: (depth now, tail held, confirmed of it, rejected) -> depth next; its first depth; its bound is speculate.
Rule = tuple[int, Callable[[int, int, int, bool], int]]
GAIN = "expected gain: draft while the SLM's chance of the next confirmed token pays for an SLM step"
FORESIGHT = "foresight (a bound, not a rule): each draft ends where the SLM will first disagree"


def rules(bound: int) -> dict[str, Rule]:
    """The candidates at a depth bound of ``bound`` (speculate)."""
    def full(d, held, agreed, rejected):  # a tail as deep as it was let go, confirmed whole
        return not rejected and agreed == held >= d

    return {
        "fixed": (bound, lambda d, held, agreed, rejected: d),
        "r2r (plan.adapted): +4 after a full confirmed draft, 2 after a rejection": (DRAFT_FIRST, adapted),
        "HF assisted's heuristic: +2 after a full confirmed draft, -1 after a rejection":
            (DRAFT_FIRST, lambda d, held, agreed, rejected: d + 2 if full(d, held, agreed, rejected)
             else max(1, d - 1) if rejected else d),
        "x2 after a full confirmed draft, /2 after a rejection":
            (DRAFT_FIRST, lambda d, held, agreed, rejected: 2 * d if full(d, held, agreed, rejected)
             else max(2, d // 2) if rejected else d),
        "+4 after a full confirmed draft, to what was confirmed after a rejection":
            (DRAFT_FIRST, lambda d, held, agreed, rejected: d + 4 if full(d, held, agreed, rejected)
             else max(2, min(d, agreed + 1)) if rejected else d),
    }


def llm_cost(k: int, costs: dict = COSTS) -> float:
    """The LLM's forward over ``k`` tokens, interpolated in ``costs``."""
    points = sorted(costs["llm"].items())
    for (a, x), (b, y) in zip(points, points[1:]):
        if k <= b:
            return x + (y - x) * (max(k, a) - a) / (b - a)
    return points[-1][1] * k / points[-1][0]


def _judged(c: dict, trace: dict, n: int, at: int, drafted: int, costs: dict) -> tuple[int, int]:
    """One draft of ``drafted`` tokens from position ``at`` (of ``n``) judged by one LLM forward: counted into ``c``;
    the position after it and how many drafted tokens the LLM confirmed (up to the SLM's first disagreement)."""
    agreed = next((j for j in range(drafted) if not trace["agree"][at + j]), drafted)
    c["slm"] += drafted  # (each drafted token was proposed by one SLM forward)
    c["llm"] += 1
    c["thrown"] += drafted - agreed
    c["tokens"] += min(agreed + 1, n - at)
    c["seconds"] += drafted * costs["slm"] + llm_cost(drafted + 1, costs)
    return at + agreed + 1, agreed


def _start(trace: dict, limit: int | None) -> tuple[int, int, dict]:
    """An answer's length (its first ``limit`` tokens), the position it starts at and empty counters."""
    n = len(trace["agree"]) if limit is None else min(limit, len(trace["agree"]))
    return n, 0, dict(tokens=0, slm=0, llm=0, thrown=0, seconds=0.0)


def replay(trace: dict, rule: Rule, bound: int, confidence: float, limit: int | None = None,
           costs: dict = COSTS) -> dict:
    """One answer drafted by ``rule`` (see the module docstring): counters and the predicted seconds."""
    chance, (first, step) = trace["p"], rule
    (n, at, c), depth = _start(trace, limit), min(first, bound)
    while at < n:
        d, drafted = min(depth, bound), 0
        while drafted < d and at + drafted < n:
            drafted += 1
            if chance[at + drafted - 1] < confidence:
                break  # the unsure token ends the draft (its frontier)
        at, agreed = _judged(c, trace, n, at, drafted, costs)
        depth = step(depth, drafted, agreed, agreed < drafted)
    return c


def expected_gain(trace: dict, bound: int, limit: int | None = None, costs: dict = COSTS) -> dict:
    """The cost model's rule: draft one more token while its expected gain pays for it. The SLM's probabilities so
    far, multiplied, estimate the chance ``q`` that the draft is confirmed up to here; the next token is drafted
    while ``q`` tokens gained are worth more than an SLM step at the draft's own rate (expected tokens over seconds),
    so a draft stops early where the SLM doubts and late where it is sure, whatever the drafts before did."""
    chance, (n, at, c) = trace["p"], _start(trace, limit)
    while at < n:
        drafted, q, expected = 0, 1.0, 1.0
        while drafted < bound and at + drafted < n:
            drafted += 1
            q *= chance[at + drafted - 1]
            expected += q
            if q * (drafted * costs["slm"] + llm_cost(drafted + 1, costs)) < costs["slm"] * expected:
                break
        at, _ = _judged(c, trace, n, at, drafted, costs)
    return c


def foresight(trace: dict, bound: int, limit: int | None = None, costs: dict = COSTS) -> dict:
    """No rule can do better (within ``bound``): each draft ends just before the SLM's first disagreement, which only
    the trace knows, so nothing is thrown and every LLM forward writes the most it can (an LLM forward costs about
    the same over 1 or 33 tokens here, so cutting a run of agreement in two never pays)."""
    agree, (n, at, c) = trace["agree"], _start(trace, limit)
    while at < n:
        drafted = 0
        while drafted < bound and at + drafted < n and agree[at + drafted]:
            drafted += 1
        at, _ = _judged(c, trace, n, at, drafted, costs)
    return c


def _row(name: str, bound: int, confidence: float, answers: list[dict], costs: dict) -> dict:
    tot = dict.fromkeys(answers[0], 0)
    for counters in answers:
        for k, v in counters.items():
            tot[k] += v
    alone = tot["tokens"] * costs["llm"][1]
    return {"rule": name, "bound": bound, "confidence": confidence, **tot,
            "llm_forwards_per_token": tot["llm"] / tot["tokens"], "slm_forwards_per_token": tot["slm"] / tot["tokens"],
            "predicted_vs_llm_alone": alone / tot["seconds"]}


def compare(traces: list[dict], bounds=(8, 16, 20, 24, 32), confidences=(0.0, 0.4, 0.8, 0.87),
            limit: int | None = None, costs: dict = COSTS) -> list:
    """Every rule at every bound and confidence over ``traces`` (the expected-gain rule and the foresight bound,
    which read the SLM's probabilities their own way, once per bound): totals, per token, and x the LLM alone."""
    out = []
    for confidence in confidences:
        for bound in bounds:
            for name, rule in rules(bound).items():
                out.append(_row(name, bound, confidence,
                                [replay(t, rule, bound, confidence, limit, costs) for t in traces], costs))
    for bound in bounds:
        out.append(_row(GAIN, bound, 0.0, [expected_gain(t, bound, limit, costs) for t in traces], costs))
        out.append(_row(FORESIGHT, bound, 0.0, [foresight(t, bound, limit, costs) for t in traces], costs))
    return out


def record(tasks: int, dtype: str = "bfloat16") -> list[dict]:
    """The traces of the ``tasks`` longest recorded LLM answers (see the module docstring)."""
    import torch

    from benchmarks.quality.humaneval import Runner, _problems, humaneval_messages
    from benchmarks.quality.humaneval_results import read_rows, system_path
    from benchmarks.models import ROUTER

    runner = Runner(ROUTER, None, 1, getattr(torch, dtype))
    recorded = read_rows(system_path("llm", ""))
    problems = {p["task_id"]: p for p in _problems()}
    end = runner.tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    with torch.inference_mode():
        for task in sorted(recorded, key=lambda t: -recorded[t]["generated_tokens"])[:tasks]:
            text = runner.tok.apply_chat_template(humaneval_messages(problems[task]), add_generation_prompt=True,
                                                  tokenize=False)
            prompt = runner.tok(text, add_special_tokens=False)["input_ids"]
            answer = runner.tok(recorded[task]["answer"], add_special_tokens=False)["input_ids"] + [end]
            ids, keep = torch.tensor([prompt + answer]), len(answer) + 1
            slm = runner.slm(ids, logits_to_keep=keep).logits[0, :-1].float().softmax(-1)
            llm = runner.llm(ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
            chance, choice = slm.max(-1)
            want = torch.tensor(answer)
            out.append({"task_id": task, "tokens": len(answer), "agree": (choice == want).tolist(),
                        "p": [round(x, 3) for x in chance.tolist()],
                        "llm_is_answer": int((llm == want).sum())})
            print(task, len(answer), sum(out[-1]["agree"]), flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="record the traces (loads both models)")
    parser.add_argument("--tasks", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "h200"), default="cpu",
                        help="whose costs: this CPU's (COSTS) or the first H200 run's (predicted; depth_rules_h200.json)")
    args = parser.parse_args(argv)
    if args.record:
        import torch

        torch.set_num_threads(1)
        TRACES.write_text(json.dumps({"conditions": {"dtype": "bfloat16", "date": time.strftime("%Y-%m-%d"),
                                                     "load": os.getloadavg()}, "traces": record(args.tasks)}) + "\n")
    traces = json.loads(TRACES.read_text())["traces"]
    costs, out = (COSTS, OUT) if args.device == "cpu" else (h200_costs(), OUT.with_name("depth_rules_h200.json"))
    bounds = (8, 16, 20, 24, 32) if args.device == "cpu" else (8, 16, 32, 64)
    result = {"conditions": {"traces": str(TRACES), "answers": len(traces), "tokens": sum(t["tokens"] for t in traces),
                             "agreement": sum(sum(t["agree"]) for t in traces) / sum(t["tokens"] for t in traces),
                             "device": args.device, "costs_s": costs},
              "whole answers": compare(traces, bounds, costs=costs),
              "first 160 tokens": compare(traces, bounds, limit=160, costs=costs)}
    out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["whole answers"]:
        print(f"conf {row['confidence']:.2f} bound {row['bound']:2d} {row['rule'][:60]:60s} "
              f"x{row['predicted_vs_llm_alone']:.3f}"
              f" LLM/token {row['llm_forwards_per_token']:.3f} SLM/token {row['slm_forwards_per_token']:.3f} "
              f"thrown {row['thrown']}")
    return result


if __name__ == "__main__":
    main()
