"""Speculative routing's cost model (issue 43): which policy, and what it buys against the LLM alone.

    python -m benchmarks.serving.speculative            # writes benchmarks/results/serve_model_speculative.json
    python -m benchmarks.serving.speculative --table    # prints its tables

Each cell (machine, routing share p, concurrency) serves the same answers through the real schedule
(``cost_model.simulate``: ``core.turn``, ``core.plan``, ``core.rows`` over priced forwards) under ``m = 1``, every
waiting policy of a grid, every speculative policy of a grid, and the shipped speculative defaults
(``core.policy.speculative_policy`` for the server, ``core.policy.call_policy`` for a batch-1 ``generate``), each
against the LLM alone served the same way (``cost_model.llm_alone``; at concurrency 1 the same: one row). The
answers: the 16 recorded prompts of the shipped router's load run (``serve_load_traces/m1-c16.jsonl``), four
times, each with a 256-token answer routed with probability p per token and agreeing with the SLM at a routed
position with probability 0.876 (measured on the shipped pair). The lossless peer beside it: vLLM's speculative
decoding, Qwen3-32B + Qwen3-1.7B draft (k = 4) on one H100, third-party logs (github.com/tomasruizt/vllm-scripts,
``results/logs-2026-01-23``). Component costs are estimates (``cost_model.H200_CAPTURED``, ``H200_FUSED``): no
device has run this.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from r2r_hf.core.policy import IMMEDIATE, WaitPolicy, call_policy, default_policy, speculative_policy

from .cost_model import H200_CAPTURED, POLICY_GRID, Costs, answers_of, cpu_costs, llm_alone, simulate, synthetic

SLOTS = 16
# The fused captured step (benchmarks/results/captured_steps.md): SLM step + router ~1.2 ms, and the host
# loop's 0.5 ms per step benchmarks/results/speculation.md assumes; the 32B forward as captured.
H200_FUSED = replace(H200_CAPTURED, slm=(1.0e-3, 0.0, 6e-6), step=5e-4, name="H200, fused steps (est.), host 0.5 ms")
VLLM_LOSSLESS = {1: 2.22, 8: 1.95, 16: 1.84}  # vLLM V1, Qwen3-32B + 1.7B draft, k = 4, MT-Bench, one H100
DEPTHS = (1, 2, 4, 8)
FRACTIONS = {"1/2": 0.5, "3/4": 0.75, "all": 1.0, "never": None}
WAITS = (8, 16, 32, 64, 128)
RECOMMENDED_DEPTH = 4  # the depth the shipped defaults are evaluated at (the server's --speculate stays 0: opt-in)


def by_fraction(fraction: float | None, max_wait: int, speculate: int, slots: int = SLOTS) -> WaitPolicy:
    """The LLM runs once ``fraction`` of the running rows (at least two: never at once for one row) hold a pending
    position or wait (None: never by count), or the oldest is ``max_wait`` steps old, or a full row routes again."""
    if fraction is None:
        return WaitPolicy((slots + 1,), max_wait, speculate)
    return WaitPolicy(tuple(max(2, math.ceil(rows * fraction)) for rows in range(1, slots + 1)), max_wait, speculate)


SPECULATIVE_GRID = {f"d{d} {f} w{w}": by_fraction(FRACTIONS[f], w, d) for d in DEPTHS for f in FRACTIONS for w in WAITS}
WAITING_GRID = {"m = 1": IMMEDIATE, "GPU default (m = rows / 3, w = 16)": default_policy("cuda", SLOTS),
                **{f"m{p.min_rows[0]} w{p.max_wait}": p for p in POLICY_GRID}}


def shipped(depth: int = RECOMMENDED_DEPTH) -> dict[str, WaitPolicy]:
    """The speculative defaults as the core builds them: the server's (``speculative_policy``), and a batch-1
    ``generate`` call's (``call_policy``: greedy, no scores kept)."""
    call = SimpleNamespace(speculate=depth, do_sample=False, return_dict_in_generate=False, llm_max_wait=None)
    return {f"server default, d{depth}": speculative_policy("cuda", SLOTS, depth),
            f"generate default, d{depth}": call_policy(call, 1)}


def answers(p: float, seed: int = 0) -> list:
    """The cells' answers (see the module docstring)."""
    trace = Path("benchmarks/results/serve_load_traces/m1-c16.jsonl")
    prompts = [prompt for prompt, _ in answers_of(trace)] if trace.exists() else [120] * 16
    return synthetic([(prompt, [False] * 256) for prompt in prompts * 4], p, seed)


def _row(got: dict, alone: float, **labels) -> dict:
    keep = ("tokens_per_s", "llm_forwards_per_token", "llm_calls_per_token", "thrown_per_token", "rows_per_llm_call",
            "pending_per_resolution", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms", "agreed", "rejected", "time_share")
    return {**labels, **{k: got[k] for k in keep}, "vs_llm_alone": got["tokens_per_s"] / alone}


def cell(costs: Costs, p: float, concurrency: int) -> dict:
    """One cell: every policy of both grids and the shipped defaults (their tokens/s and counters)."""
    served = answers(p)
    alone = llm_alone(served, concurrency, costs)
    runs = {}
    for kind, grid in (("waiting", WAITING_GRID), ("speculative", SPECULATIVE_GRID), ("shipped", shipped())):
        for name, policy in grid.items():
            runs[name] = _row(simulate(served, concurrency, policy, costs, SLOTS), alone, kind=kind, policy=name)
    return {"machine": costs.name, "p": p, "concurrency": concurrency, "llm_alone_tokens_per_s": alone, "runs": runs}


def summary(one: dict) -> list[dict]:
    """A cell's table rows: m = 1, the best waiting policy, the best speculative one, the shipped defaults."""
    runs = one["runs"].values()
    best = {kind: max((r for r in runs if r["kind"] == kind), key=lambda r: r["tokens_per_s"])
            for kind in ("waiting", "speculative")}
    picked = [("m = 1", one["runs"]["m = 1"]), ("best waiting", best["waiting"]),
              ("speculative, best of grid", best["speculative"])]
    picked += [(r["policy"], r) for r in runs if r["kind"] == "shipped"
               and (one["concurrency"] == 1 or not r["policy"].startswith("generate"))]
    head = {k: one[k] for k in ("machine", "p", "concurrency", "llm_alone_tokens_per_s")}
    return [{**head, "row": label, **run, "vllm_lossless": VLLM_LOSSLESS.get(one["concurrency"])}
            for label, run in picked]


def ranking(cells: list[dict], kind: str = "speculative", where=lambda one: True) -> list[dict]:
    """Each ``kind`` policy's tokens/s over the best of its grid in each chosen cell: geometric mean and worst
    cell, best first; with its largest share of tokens thrown away."""
    chosen = [one for one in cells if where(one)]
    names = [name for name, r in chosen[0]["runs"].items() if r["kind"] == kind]
    scored = []
    for name in names:
        shares = [one["runs"][name]["tokens_per_s"] / max(r["tokens_per_s"] for r in one["runs"].values()
                                                          if r["kind"] == kind) for one in chosen]
        thrown = max(one["runs"][name]["thrown_per_token"] for one in chosen)
        scored.append({"policy": name, "geomean": statistics.geometric_mean(shares), "worst": min(shares),
                       "thrown_max": thrown})
    return sorted(scored, key=lambda x: -x["geomean"])


P_VALUES = (0.05, 0.1, 0.2)
CONCURRENCIES = (1, 8, 16)


def rankings(cells: list[dict], cpu_cells: list[dict]) -> dict[str, list[dict]]:
    """The rankings the defaults are chosen from (top 8 each)."""
    served = ranking(cells, where=lambda one: one["concurrency"] > 1)
    everywhere = ranking(cells)
    alone = ranking(cells, where=lambda one: one["concurrency"] == 1)
    return {"server: H200 (both), p = 0.05-0.2, concurrency 8 and 16": served[:8],
            "server: H200 (both), p = 0.05-0.2, concurrency 1, 8 and 16": everywhere[:8],
            "batch 1: H200 (both), p = 0.05-0.2 (never by count)":
                [r for r in alone if " never " in r["policy"]][:8],
            "this CPU: p = 0.1, concurrency 1, 8 and 16": ranking(cpu_cells)[:8],
            "this CPU, waiting policies": ranking(cpu_cells, "waiting")[:4]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/serve_model_speculative.json")
    parser.add_argument("--costs", default="benchmarks/results/forward_costs.json", help="this CPU's forward costs")
    parser.add_argument("--table", action="store_true", help="print the tables of --out and exit")
    parser.add_argument("--jobs", type=int, default=2, help="cells computed at once (processes)")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(json.loads(Path(args.out).read_text())))
        return {}
    cpu = cpu_costs(args.costs)
    packed = replace(H200_CAPTURED, packed=True, name=f"{H200_CAPTURED.name}, packed reads (what-if)")
    specs = [(costs, p, c) for costs in (H200_CAPTURED, H200_FUSED) for p in P_VALUES for c in CONCURRENCIES]
    specs += [(cpu, 0.1, c) for c in CONCURRENCIES] + [(packed, 0.1, c) for c in (8, 16)]
    with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:  # each cell alone: ~20-90 s of pure Python
        done = list(pool.map(cell, *zip(*specs)))
    h200 = 2 * len(P_VALUES) * len(CONCURRENCIES)  # the cells of ``specs``, in its order
    cells, cpu_cells, packed_cells = done[:h200], done[h200 : h200 + len(CONCURRENCIES)], done[h200 + len(CONCURRENCIES):]
    out = {"conditions": {"answers": "16 recorded prompts x 4, 256-token answers, routed with probability p, "
                                     "agreement 0.876 at routed positions (seeded)", "slots": SLOTS,
                          "costs": {c.name: {"slm": str(c.slm)[:120], "llm": str(c.llm)[:120], "router": c.router,
                                             "step": c.step} for c in (H200_CAPTURED, H200_FUSED, cpu)},
                          "vllm_lossless": "Qwen3-32B + Qwen3-1.7B draft (k = 4), vLLM V1, one H100, MT-Bench, greedy: "
                                           "github.com/tomasruizt/vllm-scripts results/logs-2026-01-23",
                          "shipped": {name: [list(p.min_rows[:8]), p.max_wait, p.speculate]
                                      for name, p in shipped().items()}},
           "table": [row for one in cells for row in summary(one)],
           "cpu": [row for one in cpu_cells for row in summary(one)],
           "packed": [row for one in packed_cells for row in summary(one)],
           "rankings": rankings(cells, cpu_cells),
           "grid": [{**{k: one[k] for k in ("machine", "p", "concurrency")},
                     "vs_llm_alone_and_thrown": {name: [round(r["vs_llm_alone"], 4), round(r["thrown_per_token"], 4)]
                                                 for name, r in one["runs"].items()}} for one in cells + cpu_cells]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(tables(out))
    return out


def _ratio(rows: list[dict], label: str) -> str:
    got = [r for r in rows if r["row"] == label]
    return f"{got[0]['vs_llm_alone']:.2f}x" if got else "-"


def tables(out: dict) -> str:
    """The markdown tables: per cell the ratios side by side, then each row's counters, then the rankings."""
    lines = []
    for rows in (out["table"], out["cpu"], out["packed"]):
        lines += ["| machine | p | concurrency | LLM alone (tokens/s) | m = 1 | best waiting | speculative, best of "
                  "grid | server default | generate default | vLLM lossless |", "|---" * 10 + "|"]
        for key in dict.fromkeys((r["machine"], r["p"], r["concurrency"]) for r in rows):
            here = [r for r in rows if (r["machine"], r["p"], r["concurrency"]) == key]
            server = next(r["row"] for r in here if r["row"].startswith("server default"))
            generate = next((r["row"] for r in here if r["row"].startswith("generate default")), None)
            vllm = here[0]["vllm_lossless"]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {here[0]['llm_alone_tokens_per_s']:.0f} | "
                         f"{_ratio(here, 'm = 1')} | {_ratio(here, 'best waiting')} | "
                         f"{_ratio(here, 'speculative, best of grid')} | {_ratio(here, server)} | "
                         f"{_ratio(here, generate) if generate else '-'} | {f'{vllm:.2f}x' if vllm else '-'} |")
        lines.append("")
    lines += ["| machine | p | concurrency | row | policy | vs LLM alone | LLM calls / token | thrown / token | "
              "rows / LLM call | pending / resolution | inter-token p50 / p95 / p99 (ms) |", "|---" * 11 + "|"]
    for r in out["table"] + out["cpu"] + out["packed"]:
        rows, pending = r["rows_per_llm_call"], r["pending_per_resolution"]
        lines.append(f"| {r['machine']} | {r['p']} | {r['concurrency']} | {r['row']} | {r['policy']} | "
                     f"{r['vs_llm_alone']:.2f}x | {r['llm_calls_per_token']:.4f} | {r['thrown_per_token']:.3f} | "
                     f"{'-' if rows is None else f'{rows:.2f}'} | {'-' if pending is None else f'{pending:.2f}'} | "
                     f"{r['itl_p50_ms']:.1f} / {r['itl_p95_ms']:.1f} / {r['itl_p99_ms']:.1f} |")
    for name, ranked in out["rankings"].items():
        lines += ["", f"**{name}** (tokens/s over the best of the grid in each cell)", "",
                  "| policy | geometric mean | worst cell | largest thrown / token |", "|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['geomean']:.3f} | {r['worst']:.3f} | {r['thrown_max']:.3f} |"
                  for r in ranked]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
