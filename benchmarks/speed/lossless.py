"""Lossless decoding on the real pair, side by side in one process: the LLM alone, HF assisted generation with the
SLM as assistant, and R2R at threshold 0 speculating (the LLM's own answer), on this CPU at batch 1.

    python -m benchmarks.speed.lossless [--dtype bfloat16] [--lengths 160:1,512:1] [--repeats 3]
                                        [--systems assisted,adaptive,confident,gain] [--once llm,fixed8]

Qwen2.5-Coder 0.5B + 1.5B Instruct (``benchmarks/models.py``) with the shipped router, greedy, chat template.
``--lengths N:K`` answers K HumanEval tasks with ``max_new_tokens`` N each, those whose recorded LLM answer
(``results/humaneval/llm.jsonl``, at most 384 tokens) is at least min(N, 384) tokens long, shortest prompt first:
answers of about N tokens. Each round answers every task with every system of ``--systems``, interleaved task by
task (drift hits all alike); the systems of ``--once`` run in the first round only (their counters and one time:
the LLM alone costs twice an R2R round; without it, answers are held to assisted generation's, greedy: the
LLM's). A system's best is the sum over tasks of its best round on each, its median
the median of its round totals. Every answer must equal ``llm.generate``'s. The machine's load (``os.getloadavg``,
what ``uptime`` prints) is recorded with each round: on a shared machine only ratios within one run mean anything.
HF's assisted generation adapts its drafts' confidence threshold across calls where scikit-learn is installed
(transformers 5.24: ``assistant_confidence_threshold`` kept on the assistant's generation config): it is reset to
HF's 0.4 before the run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.models import ROUTER
from benchmarks.quality.humaneval import Runner, _problems, by_length
from benchmarks.quality.humaneval_results import read_rows, system_path
from benchmarks.record import hardware, versions

WAIT = 64  # steps the oldest pending position may wait (a batch-1 draft never waits that long: its depth ends it)


def systems(runner: Runner, confidence: float, deep: int, cost: float | str = 2.5) -> dict:
    """name -> a function of (input ids, attention mask, greedy options) -> (sequences, counters or None)."""
    def llm(ids, mask, greedy):
        return runner.llm.generate(input_ids=ids, attention_mask=mask, **greedy), None

    def assisted(ids, mask, greedy):
        return runner.llm.generate(input_ids=ids, attention_mask=mask, assistant_model=runner.slm, **greedy), None

    def r2r(depth, fixed=False, floor=None, gain=None):
        def run(ids, mask, greedy):
            out = runner.r2r.generate(input_ids=ids, attention_mask=mask, **greedy, threshold=0.0, speculate=depth,
                                      llm_max_wait=WAIT, return_dict_in_generate=True, draft_confidence=floor,
                                      fixed_depth=fixed, draft_cost=gain)
            return out.sequences, out.counters
        return run

    return {"llm": ("llm.generate", llm), "assisted": ("llm.generate, SLM assisting", assisted),
            "fixed8": ("r2r, fixed depth 8", r2r(8, fixed=True)),
            "adaptive": ("r2r, depth by acceptance up to 16", r2r(16)),
            "confident": (f"r2r, depth by acceptance up to {deep}, drafts end under {confidence}",
                          r2r(deep, floor=confidence)),
            "fixed-confident": (f"r2r, fixed depth {deep}, drafts end under {confidence}",
                                r2r(deep, fixed=True, floor=confidence)),
            "gain": (f"r2r, drafts end by the expected-gain rule (cost {cost}) up to {deep}",
                     r2r(deep, gain=cost)),
            "gain16": (f"r2r, drafts end by the expected-gain rule (cost {cost}) up to 16", r2r(16, gain=cost))}


def tasks(lengths: str) -> list[tuple[dict, int]]:
    """(problem, max_new_tokens) per task of ``--lengths`` (see the module docstring)."""
    recorded = read_rows(system_path("llm", ""))
    chosen, order = [], by_length(_problems())
    for part in lengths.split(","):
        new, count = (int(x) for x in part.split(":"))
        long = [p for p in order if recorded.get(p["task_id"], {}).get("generated_tokens", 0) >= min(new, 384)]
        chosen += [(p, new) for p in long if p["task_id"] not in {q["task_id"] for q, _ in chosen}][:count]
    return chosen


def answer_of(sequences: torch.Tensor, prompt: int, stop: set[int]) -> list[int]:
    row = sequences[0, prompt:].tolist()
    end = next((j for j, t in enumerate(row) if t in stop), None)
    return row if end is None else row[: end + 1]


def side_by_side(runner: Runner, work: list[tuple[dict, int]], runs: dict, once: set[str], repeats: int) -> dict:
    """Every system on every task, ``repeats`` interleaved rounds (see the module docstring)."""
    tok = runner.tok
    stop = {tok.eos_token_id, tok.pad_token_id}
    prompts = [tok(runner.chat_text(p), return_tensors="pt", add_special_tokens=False) for p, _ in work]
    warm = dict(max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    for _, run in runs.values():  # (loads the router, first calls' one-time work: not any system's time)
        run(prompts[0]["input_ids"], prompts[0]["attention_mask"], warm)
    best = {name: [float("inf")] * len(prompts) for name in runs}
    totals = {name: [] for name in runs}
    answers, counters, loads = {name: [None] * len(prompts) for name in runs}, {name: [] for name in runs}, []
    for round_ in range(repeats):
        loads.append({"round": round_, "load_before": os.getloadavg()})
        now = [name for name in runs if round_ == 0 or name not in once]
        spent = dict.fromkeys(now, 0.0)
        for i, (enc, (_, new)) in enumerate(zip(prompts, work)):
            greedy = dict(max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
            for name in now:
                start = time.perf_counter()
                sequences, c = runs[name][1](enc["input_ids"], enc["attention_mask"], greedy)
                seconds = time.perf_counter() - start
                best[name][i], spent[name] = min(best[name][i], seconds), spent[name] + seconds
                answers[name][i] = answer_of(sequences, enc["input_ids"].shape[1], stop)
                if c is not None and round_ == 0:
                    counters[name].append(c)
        for name in now:
            totals[name].append(spent[name])
        loads[-1]["load_after"] = os.getloadavg()
        print(json.dumps(loads[-1]), {n: round(s, 1) for n, s in spent.items()}, flush=True)
    reference = "llm" if "llm" in runs else "assisted"  # (greedy assisted generation is llm.generate's answer)
    first = answers[reference]
    out = {}
    for name, (label, _) in runs.items():
        tokens = sum(len(a) for a in answers[name])
        out[name] = {"system": label, "tokens": tokens, "seconds": sum(best[name]),
                     "tokens_per_s": tokens / sum(best[name]), "round_seconds": totals[name],
                     "median_tokens_per_s": tokens / statistics.median(totals[name]),
                     f"same_answers_as_{reference}": answers[name] == first, "seconds_per_task": best[name],
                     **_totals(counters[name])}
    for name in runs:
        for key in ("tokens_per_s", "median_tokens_per_s"):
            for base in ("llm", "assisted"):
                if base in runs:
                    out[name][f"vs_{base}_{key}"] = out[name][key] / out[base][key]
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
    total["mean_depth"] = sum((c["mean_depth"] or 0) * (c["speculative_agreed"] + c["speculative_rejected"])
                              for c in counters) / max(judged, 1)
    for k in ("slm_forwards", "llm_forwards", "thrown"):
        total[f"{k}_per_token"] = total[k] / total["generated"]
    return total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default=ROUTER)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--lengths", default="160:1,512:1", help="max_new_tokens:tasks, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--systems", default="llm,assisted,fixed8,adaptive,confident")
    parser.add_argument("--once", default="llm,fixed8", help="systems timed in the first round only")
    parser.add_argument("--confidence", type=float, default=0.8, help="draft_confidence of the 'confident' runs")
    parser.add_argument("--deep", type=int, default=32, help="speculate of the 'confident' runs")
    parser.add_argument("--cost", type=lambda t: t if t == "auto" else float(t), default=2.5,
                        help="draft_cost of the 'gain' runs: an LLM forward in SLM steps (2.5: this CPU, bf16), or "
                             "'auto': timed on the pair (core/costs.py)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lossless_<dtype>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = tasks(args.lengths)
    runner = Runner(args.router, None, max(n for _, n in work), getattr(torch, args.dtype))
    runner.slm.generation_config.assistant_confidence_threshold = 0.4  # HF's default (see the module docstring)
    every = systems(runner, args.confidence, args.deep, args.cost)
    runs = {name: every[name] for name in args.systems.split(",")}
    with torch.inference_mode():
        found = side_by_side(runner, work, runs, set(args.once.split(",")), args.repeats)
    threshold = float(runner.slm.generation_config.assistant_confidence_threshold)
    result = {"conditions": {"tasks": [(p["task_id"], n) for p, n in work], "dtype": args.dtype,
                             "threads": args.threads, "repeats": args.repeats, "once": args.once, "batch": 1,
                             "draft_cost": args.cost, "draft_cost_timed": _timed_cost(runner, args.cost),
                             "greedy": True, "wait": WAIT, "router": args.router, "cpus": os.cpu_count(),
                             "assisted_threshold_after": threshold,
                             **versions(), "cpu": hardware()}, **found}
    for s in found["systems"].values():
        same = next(value for key, value in s.items() if key.startswith("same"))
        print(f"{s['system']:60s} {s['tokens_per_s']:6.2f} tokens/s (median {s['median_tokens_per_s']:.2f})  "
              f"{s['vs_assisted_median_tokens_per_s']:.2f}x assisted  equal: {same}  "
              f"LLM/token {s.get('llm_forwards_per_token', float('nan')):.3f} thrown {s.get('thrown', '-')}")
    path = Path(args.out or f"benchmarks/results/lossless_{args.dtype}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _timed_cost(runner: Runner, cost: float | str) -> float | None:
    """The ratio ``draft_cost="auto"`` timed for the pair (kept from its first call), where it was asked for."""
    from r2r_hf.core.costs import measured_draft_cost

    return measured_draft_cost(runner.r2r.routed_pair()) if cost == "auto" else None


if __name__ == "__main__":
    main()
