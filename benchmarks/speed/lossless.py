"""Lossless decoding on the real pair, side by side in one process: the LLM alone, HF assisted generation with the
SLM as assistant, and R2R at threshold 0 speculating (the LLM's own answer), on this CPU at batch 1.

    python -m benchmarks.speed.lossless [--dtype bfloat16] [--tasks 4] [--max-new-tokens 160] [--repeats 3]
                                        [--confidence 0.4 --confident-depths 8,16]

Qwen2.5-Coder 0.5B + 1.5B Instruct (``benchmarks/models.py``) with the shipped router, greedy, chat template, the
shortest HumanEval tasks (``benchmarks.quality.humaneval.by_length``). Each round answers every task with every
system, interleaved task by task (drift hits all alike); a system's time on a task is its best of ``--repeats``
rounds, and its tokens/s is its tokens over the sum of those. Every answer must equal ``llm.generate``'s. The
machine's load (``os.getloadavg``, what ``uptime`` prints) is recorded with each round: on a shared machine only
ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.models import ROUTER
from benchmarks.quality.humaneval import Runner, _problems, by_length
from benchmarks.record import hardware, versions


def systems(runner: Runner, depths: list[int], wait: int, confidence: float | None = None,
            confident: list[int] = ()) -> dict:
    """name -> a function of (input ids, attention mask, greedy options) -> (sequences, counters or None)."""
    def llm(ids, mask, greedy):
        return runner.llm.generate(input_ids=ids, attention_mask=mask, **greedy), None

    def assisted(ids, mask, greedy):
        return runner.llm.generate(input_ids=ids, attention_mask=mask, assistant_model=runner.slm, **greedy), None

    def r2r(depth, floor=None):
        def run(ids, mask, greedy):
            out = runner.r2r.generate(input_ids=ids, attention_mask=mask, **greedy, threshold=0.0, speculate=depth,
                                      llm_max_wait=wait, return_dict_in_generate=True, draft_confidence=floor)
            return out.sequences, out.counters
        return run

    return {"llm.generate": llm, "llm.generate, SLM assisting": assisted,
            **{f"r2r at threshold 0, speculating {d}": r2r(d) for d in depths},
            **{f"r2r at threshold 0, speculating {d}, drafts stop under {confidence}": r2r(d, confidence)
               for d in (confident if confidence else ())}}


def answer_of(sequences: torch.Tensor, prompt: int, stop: set[int]) -> list[int]:
    row = sequences[0, prompt:].tolist()
    end = next((j for j, t in enumerate(row) if t in stop), None)
    return row if end is None else row[: end + 1]


def side_by_side(runner: Runner, problems: list[dict], runs: dict, repeats: int) -> dict:
    """Every system on every task, ``repeats`` interleaved rounds (see the module docstring)."""
    tok = runner.tok
    greedy = dict(max_new_tokens=runner.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    stop = {tok.eos_token_id, tok.pad_token_id}
    prompts = [tok(runner.chat_text(p), return_tensors="pt", add_special_tokens=False) for p in problems]
    best = {name: [float("inf")] * len(prompts) for name in runs}
    answers, counters, loads = {name: [None] * len(prompts) for name in runs}, {name: [] for name in runs}, []
    for round_ in range(repeats):
        loads.append({"round": round_, "load_before": os.getloadavg()})
        for i, enc in enumerate(prompts):
            for name, run in runs.items():
                start = time.perf_counter()
                sequences, c = run(enc["input_ids"], enc["attention_mask"], greedy)
                best[name][i] = min(best[name][i], time.perf_counter() - start)
                answers[name][i] = answer_of(sequences, enc["input_ids"].shape[1], stop)
                if c is not None and round_ == 0:
                    counters[name].append(c)
        loads[-1]["load_after"] = os.getloadavg()
        print(json.dumps(loads[-1]), flush=True)
    first = answers["llm.generate"]
    out = {}
    for name in runs:
        tokens = sum(len(a) for a in answers[name])
        out[name] = {"tokens": tokens, "seconds": sum(best[name]), "tokens_per_s": tokens / sum(best[name]),
                     "same_answers": answers[name] == first, "seconds_per_task": best[name],
                     **_totals(counters[name])}
    base = out["llm.generate"]["tokens_per_s"]
    for name in runs:
        out[name]["vs_llm"] = out[name]["tokens_per_s"] / base
    return {"systems": out, "loads": loads}


def _totals(counters: list[dict]) -> dict:
    """The R2R runs' counters summed over the tasks (per generated token where a ratio reads better)."""
    if not counters:
        return {}
    keys = ("generated", "steps", "slm_forwards", "llm_forwards", "router_steps", "frontier_tokens",
            "speculative_agreed", "speculative_rejected", "thrown")
    total = {k: sum(c[k] for c in counters) for k in keys}
    judged = total["speculative_agreed"] + total["speculative_rejected"]
    total["agreement"] = total["speculative_agreed"] / max(judged, 1)
    for k in ("slm_forwards", "llm_forwards", "thrown"):
        total[f"{k}_per_token"] = total[k] / total["generated"]
    return total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default=ROUTER)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depths", default="4,8", help="speculation depths of R2R, comma-separated")
    parser.add_argument("--wait", type=int, default=32, help="steps the oldest pending position may wait")
    parser.add_argument("--confidence", type=float, default=None,
                        help="also R2R whose drafts stop where the SLM's probability is under this (draft_confidence)")
    parser.add_argument("--confident-depths", default="8,16", help="the depths of those runs, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lossless_<dtype>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = Runner(args.router, None, args.max_new_tokens, getattr(torch, args.dtype))
    problems = by_length(_problems())[: args.tasks]
    runs = systems(runner, [int(d) for d in args.depths.split(",") if d], args.wait, args.confidence,
                   [int(d) for d in args.confident_depths.split(",") if d])
    with torch.inference_mode():
        found = side_by_side(runner, problems, runs, args.repeats)
    result = {"conditions": {"tasks": [p["task_id"] for p in problems], "max_new_tokens": args.max_new_tokens,
                             "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats, "batch": 1,
                             "greedy": True, "wait": args.wait, "confidence": args.confidence,
                             "router": args.router, "cpus": os.cpu_count(),
                             **versions(), "cpu": hardware()}, **found}
    for name, s in found["systems"].items():
        print(f"{name:40s} {s['tokens_per_s']:6.2f} tokens/s  {s['vs_llm']:.2f}x  equal: {s['same_answers']}")
    path = Path(args.out or f"benchmarks/results/lossless_{args.dtype}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
