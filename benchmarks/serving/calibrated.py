"""The server's cost model against the first device run: H200 costs as measured, the served ratios replayed.

    python -m benchmarks.serving.calibrated [--first benchmarks/results/gpu_check.json]
                                        [--fused benchmarks/results/gpu_check_rerun.json]

The cost model (``cost_model.py``, ``speculative.py``) priced the H200 by estimate (an SLM step 2.5 ms, a
32B forward 19 ms flat in rows below the ridge, 0.1 ms of host work per step). The first H200 run measured them:

* the SLM's and the router's captured step at 1 and 8 rows (``components_ms``, fused SLM, first run);
* the LLM's captured read per rows and tokens bucket at 1 and 8 rows (first run, HF's forward on graphs: the 32B's
  fused self-check failed there) and the fused LLM's one-token step at 1, 8 and 16 rows (second run: the fused
  LLM alone, batch 1, and the LLM alone served at 8 and 16, less each step's time outside the graph replays).
  A fused read of g tokens is priced as the fused one-token step times the unfused grid's growth with g at those
  rows (at 16 rows: the 8-row growth, or compute at the 8-row grid's 64-token rate where that is more);
* the host's time per step outside the graph replays (second run, served).

With these, the replay of the serving phase's own conditions (64-token prompts, 128-token answers, p = 0.1 per
token, 2 x concurrency requests, 16 slots) is set beside what the serving phase measured, then the speculative
defaults are predicted with the same costs (the LLM agreeing at 87.6 % of routed positions, the real pair's rate),
for the server the device ran (``speculative``) and for today's, whose LLM reads gather their rows where that
makes a smaller rows bucket (``gathering``: ``fast/slot_reads.CapturedReads``, since the first device run).
Results: ``benchmarks/results/gpu_calibrated.json``; docs/performance.md, "The first device run".
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from r2r_hf.core.policy import IMMEDIATE, default_policy, speculative_policy

from .cost_model import Costs, llm_alone, simulate, synthetic
from .replay import replay
from .speculative import by_fraction

TOKENS = (1, 2, 4, 8, 16, 32, 64)
SLOTS = 16


def _served_step(serving: dict, name: str, concurrency: int) -> float:
    run = next(r for r in serving[name]["runs"] if r["concurrency"] == concurrency)
    return (run["ms_per_step"] - run["outside_graphs_ms_per_step"]) / 1e3


def measured_costs(first: dict, fused: dict) -> Costs:
    """H200 costs from the two runs' JSON (see the module docstring)."""
    parts = {int(b): c["captured"] for b, c in first["components_ms"].items()}
    unfused = {k: {int(g): t / 1e3 for g, t in parts[k]["t_llm"].items()} for k in (1, 8)}
    one_token = {1: fused["llm_fused_ms"]["1"]["ms_per_token"] / 1e3,
                 8: _served_step(fused["serving"], "LLM alone", 8), 16: _served_step(fused["serving"], "LLM alone", 16)}
    compute = unfused[8][64] / (8 * 64)  # seconds per token past the ridge
    llm = {}
    for k, base in one_token.items():
        growth = unfused[min(k, 8)]
        for g in TOKENS:
            llm[k, g] = max(base * growth[g] / growth[1], compute * k * g)
    slm_at = {k: parts[k]["t_slm"] / 1e3 for k in (1, 8)}
    slm_at[16] = slm_at[8] + (slm_at[8] - slm_at[1]) * 8 / 7  # linear in rows, as measured between 1 and 8
    slm = {(k, g): max(t, 6e-6 * k * g) for k, t in slm_at.items() for g in TOKENS}
    router_1, router_8 = parts[1]["t_router"] / 1e3, parts[8]["t_router"] / 1e3
    slope = (router_8 - router_1) / 7
    host = [r["outside_graphs_ms_per_step"] / 1e3 for r in fused["serving"]["R2R, waiting"]["runs"]]
    return Costs(slm=slm, llm=llm, router=(router_1 - slope, slope), step=sum(host) / len(host),
                 name="H200, measured (first device run)", captured_shapes=True)


def served_answers(concurrency: int, p: float, tokens: int, prompt: int = 64, seed: int = 0) -> list:
    """The serving phase's load: 2 x ``concurrency`` answers (at least 4)."""
    return synthetic([(prompt, [False] * tokens)] * max(2 * concurrency, 4), p, seed)


def against_measured(costs: Costs, fused: dict, p: float = 0.1) -> list[dict]:
    """Each served configuration of the serving phase: replayed tokens/s beside the measured."""
    servers = {"R2R, waiting": default_policy("cuda", SLOTS), "R2R, m = 1": IMMEDIATE}
    out = []
    for c in (8, 16):
        answers = served_answers(c, p, 128)
        measured = {name: next(r for r in fused["serving"][name]["runs"] if r["concurrency"] == c)["tokens_per_s"]
                    for name in (*servers, "LLM alone")}
        predicted = {name: simulate(answers, c, policy, costs, SLOTS)["tokens_per_s"] for name, policy in servers.items()}
        predicted["LLM alone"] = llm_alone(answers, c, costs)
        for name in measured:
            out.append({"concurrency": c, "server": name, "measured": measured[name], "replayed": predicted[name],
                        "replayed_over_measured": predicted[name] / measured[name]})
    return out


def speculative(costs: Costs, tokens: int, p: float = 0.1, depth: int = 4) -> list[dict]:
    """The waiting default and the speculative server default at 8 and 16 users, against the LLM alone."""
    out = []
    for c in (8, 16):
        answers = served_answers(c, p, tokens)
        alone = llm_alone(answers, c, costs)
        for name, policy in (("m = 1", IMMEDIATE), ("waiting default", default_policy("cuda", SLOTS)),
                             (f"speculative default, d{depth}", speculative_policy("cuda", SLOTS, depth)),
                             (f"speculative, d{depth}, all rows, w32", by_fraction(1.0, 32, depth, SLOTS))):
            got = simulate(answers, c, policy, costs, SLOTS)
            out.append({"concurrency": c, "tokens": tokens, "policy": name, "tokens_per_s": got["tokens_per_s"],
                        "vs_llm_alone": got["tokens_per_s"] / alone, "llm_calls_per_token": got["llm_calls_per_token"],
                        "thrown_per_token": got["thrown_per_token"]})
    return out


def today(costs: Costs, p: float = 0.1, depth: int = 4) -> list[dict]:
    """Today's server priced with the first run's measured costs: the LLM's reads packed (one flat forward at a
    bucket of its total tokens, the joining prompts' pieces riding in them: ``core/layouts/packed.py``) and the router
    folded into the SLM's reads (its fixed cost per step gone; its cost per row kept, as the first run measured it
    growing 46 us per row for a reason not yet known), at batch 1 and 8 and 16 users, 256- and 2,048-token answers,
    against the fair LLM alone (its prompts read once, its reads packed the same way)."""
    packed = replace(costs, packed=True)
    folded = replace(packed, router=(0.0, costs.router[1]))
    out = []
    for c in (1, 8, 16):
        for tokens in (256, 2048):
            answers = served_answers(c, p, tokens)
            alone = llm_alone(answers, c, packed)
            for name, policy in (("m = 1", IMMEDIATE), ("waiting default", default_policy("cuda", SLOTS)),
                                 (f"speculative default, d{depth}", speculative_policy("cuda", SLOTS, depth))):
                got = simulate(answers, c, policy if c > 1 or name != "waiting default" else IMMEDIATE, folded, SLOTS)
                run, _ = replay(answers, c, policy, folded, SLOTS)
                k = run.counters
                out.append({"concurrency": c, "tokens": tokens, "policy": name, "tokens_per_s": got["tokens_per_s"],
                            "vs_llm_alone": got["tokens_per_s"] / alone, "llm_alone_tokens_per_s": alone,
                            "llm_rows_useful": k.llm_rows_real / k.llm_rows_read if k.llm_rows_read else None,
                            "llm_calls_per_token": got["llm_calls_per_token"],
                            "thrown_per_token": got["thrown_per_token"]})
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--fused", default="benchmarks/results/gpu_check_rerun.json")
    parser.add_argument("--out", default="benchmarks/results/gpu_calibrated.json")
    parser.add_argument("--gathering", action="store_true",
                        help="--fused measured a server whose LLM reads gather their rows (any run after 2026-12-04)")
    args = parser.parse_args(argv)
    first, fused = (json.loads(Path(p).read_text()) for p in (args.first, args.fused))
    costs = replace(measured_costs(first, fused), gathered_rows=args.gathering)
    result = {"costs": {"slm_ms": {f"{k}x{g}": 1e3 * t for (k, g), t in costs.slm.items() if g == 1},
                        "llm_ms": {f"{k}x{g}": 1e3 * t for (k, g), t in costs.llm.items()},
                        "router_ms": [1e3 * costs.router[0], 1e3 * costs.router[1]], "host_ms_per_step": 1e3 * costs.step},
              "against_measured": against_measured(costs, fused),
              "speculative": [row for tokens in (128, 256) for row in speculative(costs, tokens)]}
    gathering = replace(costs, gathered_rows=True)  # today's server (the same as --fused's with --gathering)
    result["gathering"] = result["speculative"] if args.gathering else [
        row for tokens in (128, 256) for row in speculative(gathering, tokens)]
    result["today"] = today(costs)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in result["against_measured"] + result["speculative"] + result["gathering"] + result["today"]:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return result


if __name__ == "__main__":
    main()
