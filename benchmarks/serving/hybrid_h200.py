"""A Qwen3.5-class hybrid pair served on an H200, predicted: forward costs from the models' shapes, with the constants
the first device run measured (issue 56, item 6).

    python -m benchmarks.serving.hybrid_h200            # writes benchmarks/results/hybrid_h200_predicted.json
    python -m benchmarks.serving.hybrid_h200 --table    # prints its tables

**A prediction**: no device has served a hybrid pair. The pair: Qwen3.5-0.8B (SLM) + Qwen3.5-27B (LLM, dense), each
a 3:1 stack of Gated DeltaNet and full-attention layers (``shape_costs.SHAPES``, each field's source beside it). Both
run on the captured server as it serves a hybrid today: HF's forward on graphs (the fused regions take full
attention only: ``probes.structure_problem``), the LLM's reads gathering their rows, never packed; every row of a
forward reads as many tokens, one of ``fast/static_reads.BUCKETS`` (``SlotBook.read`` with ``widths``: a catch-up of
rows with different counts takes several forwards); a row's state checkpointed where speculation may cut it back.

Each forward is priced from the shapes (``shape_costs.py``: the weights, the attention layers' KV, each row's
recurrent state read and written once, a checkpoint or a restore copying it) with the constants the first H200 run
measured on random Qwen2.5 1.5B + 32B weights (``shape_costs.fit``); the host's time per step and per drafted step
and the router folded into the SLM's read (its cost per row) as ``calibrated.today`` prices today's server.

The same shape model, Qwen2.5 1.5B + 32B shapes, replays the first run's served loads (whose servers ran HF's
forward on graphs, as a hybrid does) beside what was measured (``against_first_run``).

The prediction: R2R waiting and speculating (p = 0.1, the oracle's agreement 0.876) and lossless (threshold 0,
agreement 0.9), each with the GPU's default draft blocks, at 1, 8 and 16 users on 16 slots, against the LLM alone on
the same engine (the 27B in the SLM's place, its own state and splits priced alike; the faster of its draft blocks
and one step per synchronisation), the loads of ``calibrated.today`` and ``lossless.today``; then the same with the
hybrid's own costs priced otherwise (``VARIANTS``): every width from 1 to 64 captured (a row's count read in one
forward where the rows agree), and at zero in turn the uneven catch-ups' split (rows padded as a transformer's), the
state traffic, the rollback to a checkpoint, and all three (``plain``: the same matrices as a transformer whose KV is
its attention layers'). A sensitivity: the host's time per step of the first run's servers on HF's forward.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from r2r_hf.core.fast.static_reads import BUCKETS
from r2r_hf.core.policy import DRAFT_BLOCK, IMMEDIATE, default_policy, serving_policy, speculative_policy

from . import lossless
from .calibrated import SLOTS, served_answers
from .cost_model import AGREEMENT, alone_on_the_engine, simulate
from .shape_costs import SHAPES, Shape, ShapeCosts, fit, residuals


def costs(first: dict, fused: dict, slm: Shape, llm: Shape, name: str) -> dict[str, ShapeCosts]:
    """R2R's costs and the LLM alone's on the same engine, with the first run's constants, host time per step and the
    router folded into the SLM's read (its per-row cost kept: ``calibrated.today``)."""
    constants = fit(first, fused)
    parts = {k: first["components_ms"][k]["captured"]["t_router"] / 1e3 for k in ("1", "8")}
    host = [r["outside_graphs_ms_per_step"] / 1e3 for r in fused["serving"]["R2R, waiting"]["runs"]]
    r2r = ShapeCosts(slm, llm, constants, router=(0.0, (parts["8"] - parts["1"]) / 7), step=sum(host) / len(host),
                     name=name)
    return {"r2r": r2r, "alone": replace(r2r, slm=llm, llm_free=True, name=f"{name}, the LLM alone")}


VARIANTS = {  # what each row prices of the hybrid's own costs
    "hybrid, as served": {},
    "every width 1-64 captured": {"widths": tuple(range(1, BUCKETS[-1] + 1))},
    "no split (rows padded)": {"split": False},
    "no state traffic": {"state": False},
    "no rollback to a checkpoint": {"rewind": False},
    "plain (none of the three)": {"split": False, "state": False, "rewind": False},
}
SERVERS = ("R2R waiting", "R2R speculating", "lossless")
LOSSLESS_AGREEMENT = 0.9  # lossless.py's: the agreement the GPU's lossless depth was chosen at


KEPT = ("tokens_per_s", "llm_calls_per_token", "llm_forwards_per_token", "slm_forwards_per_token", "thrown_per_token",
        "time_share")


def cell(pair: dict[str, ShapeCosts], server: str, users: int, variant: str) -> dict:
    """One server at ``users`` under one variant (the server's default: draft blocks; and one step per
    synchronisation beside it), against the LLM alone under the same variant: the faster of its draft blocks and one
    step per synchronisation (a block reads every slot: where few rows run, a hybrid's per-row costs can make the
    blocks slower)."""
    flags = VARIANTS[variant]
    r2r, alone_costs = (replace(pair[k], **flags) for k in ("r2r", "alone"))
    if server == "lossless":
        load, policy, routes = lossless.answers(users, LOSSLESS_AGREEMENT), serving_policy("cuda", SLOTS,
                                                                                            speculate=16), True
    else:
        load, routes = served_answers(users, 0.1, 256), None
        base = speculative_policy("cuda", SLOTS, 4) if server == "R2R speculating" else default_policy("cuda", SLOTS)
        policy = replace(base, block=DRAFT_BLOCK)
    by_block = {block: alone_on_the_engine(load, users, alone_costs, SLOTS, block) for block in (DRAFT_BLOCK, 1)}
    alone = max(by_block.values())
    got = simulate(load, users, policy, r2r, SLOTS, routes=routes)
    one_step = simulate(load, users, replace(policy, block=1), r2r, SLOTS, routes=routes)["tokens_per_s"]
    return {"server": server, "users": users, "variant": variant, **{k: got[k] for k in KEPT},
            "vs_llm_alone": got["tokens_per_s"] / alone, "llm_alone_tokens_per_s": alone,
            "llm_alone_tokens_per_s_by_block": {str(b): v for b, v in by_block.items()},
            "one_step_per_synchronisation": {"tokens_per_s": one_step, "vs_llm_alone": one_step / alone}}


def against_first_run(first: dict, fused: dict) -> list[dict]:
    """The first run's served loads (its servers on HF's forward on graphs, not gathering, one step per
    synchronisation, the router in its own graph) replayed with the shape model at the run's Qwen2.5 shapes and
    each configuration's measured host time per step, beside the tokens/s measured."""
    base = costs(first, fused, SHAPES["qwen2.5-1.5b"], SHAPES["qwen2.5-32b"], "Qwen2.5 1.5B + 32B")["r2r"]
    parts = {k: first["components_ms"][k]["captured"]["t_router"] / 1e3 for k in ("1", "8")}
    slope = (parts["8"] - parts["1"]) / 7
    shaped = replace(base, recurrent=(), gathered_rows=False, router=(parts["1"] - slope, slope))
    out = []
    for server in ("R2R, waiting", "R2R, m = 1", "LLM alone"):
        for run in first["serving"][server]["runs"]:
            c = run["concurrency"]
            answers = served_answers(c, 0.1, run["tokens"] // run["requests"])
            at = replace(shaped, step=run["outside_graphs_ms_per_step"] / 1e3)
            if server == "LLM alone":  # (built from (llm, llm) with a router: each prompt read twice, nothing routed)
                never = [(prompt, [False] * len(routed)) for prompt, routed in answers]
                got = simulate(never, c, IMMEDIATE, replace(at, slm=at.llm), SLOTS)
            else:
                policy = IMMEDIATE if "m = 1" in server else default_policy("cuda", SLOTS)
                got = simulate(answers, c, policy, at, SLOTS)
            out.append({"server": server, "users": c, "measured_tokens_per_s": run["tokens_per_s"],
                        "replayed_tokens_per_s": got["tokens_per_s"],
                        "replayed_over_measured": got["tokens_per_s"] / run["tokens_per_s"]})
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--fused", default="benchmarks/results/gpu_check_rerun.json")
    parser.add_argument("--out", default="benchmarks/results/hybrid_h200_predicted.json")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--table", action="store_true", help="print the tables of --out and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return {}
    first, fused = (json.loads(Path(p).read_text()) for p in (args.first, args.fused))
    constants = fit(first, fused)
    slm, llm = SHAPES["qwen3.5-0.8b"], SHAPES["qwen3.5-27b"]
    pair = costs(first, fused, slm, llm, "H200, Qwen3.5-0.8B + Qwen3.5-27B shapes (predicted)")
    result = {
        "predicted": True,
        "conditions": {
            "what": "predicted, not measured: no device has served a hybrid pair",
            "pair": {s.name: {"params": s.params(), "weight_bytes_per_forward": s.weight_bytes(),
                              "state_bytes_per_row": s.state_bytes(), "kv_bytes_per_column_per_row": s.kv_bytes(),
                              "layers": {"gated_deltanet": s.linear, "full_attention": s.attention},
                              "source": s.source} for s in (slm, llm)},
            "constants": constants.as_dict(),
            "constants_from": "the first H200 run (benchmarks/results/gpu_check.json, gpu_check_rerun.json): "
                              "bandwidth and the fused per-layer overhead from the fused 1.5B and 32B one-token steps; "
                              "the per-layer and per-row overheads and the compute rate from the 32B's captured reads "
                              "on HF's forward at 1x1, 8x1 and 8x64 tokens",
            "host_ms_per_step": 1e3 * pair["r2r"].step, "plan_ms_per_drafted_step": 1e3 * pair["r2r"].plan,
            "router": "folded into the SLM's read: its measured cost per row kept ("
                      f"{1e6 * pair['r2r'].router[1]:.1f} us)",
            "engine": "captured, HF's forward on graphs (hybrids are not fused), the LLM's reads gathering their "
                      f"rows, {SLOTS} slots, widths {list(BUCKETS)}, draft blocks of {DRAFT_BLOCK}",
            "loads": {"R2R waiting / speculating": "calibrated.served_answers: 2 x users answers (at least 4), "
                                                   "64-token prompts, 256 new tokens, p = 0.1 per token (seeded), "
                                                   f"agreement {AGREEMENT} at routed positions",
                      "lossless": f"lossless.answers: 4 x users answers (at least 8), 64 + 256 tokens, every token "
                                  f"routed, agreement {LOSSLESS_AGREEMENT}"},
            "policies": {"R2R waiting": "default_policy('cuda', 16), blocks of 4",
                         "R2R speculating": "speculative_policy('cuda', 16, 4), blocks of 4",
                         "lossless": "serving_policy('cuda', 16, speculate=16) (depth by load, blocks of 4)"},
            "variants": VARIANTS,
        },
        "residuals_32b_grid": residuals(first, constants),
        "against_first_run": against_first_run(first, fused),
        "cells": [],
    }
    unfused = {name: sum(r["outside_graphs_ms_per_step"] for r in first["serving"][name]["runs"]) / 2e3
               for name in ("R2R, waiting", "LLM alone")}
    slow = {"r2r": replace(pair["r2r"], step=unfused["R2R, waiting"]),
            "alone": replace(pair["alone"], step=unfused["LLM alone"])}
    result["sensitivity"] = {
        "what": "the hybrid as served with the host time per step the first run's servers on HF's forward spent "
                "outside the graph replays (R2R waiting and the LLM alone, mean of 8 and 16 users), in place of "
                "the fused rerun's",
        "host_ms_per_step": {k: 1e3 * v for k, v in unfused.items()},
        "cells": [cell(slow, server, users, "hybrid, as served") for server in SERVERS for users in args.users]}
    for variant in VARIANTS:
        for server in SERVERS:
            for users in args.users:
                row = cell(pair, server, users, variant)
                result["cells"].append(row)
                print(f"{variant:28s} {server:16s} {users:3d} users: {row['vs_llm_alone']:.2f}x the LLM alone "
                      f"({row['tokens_per_s']:.0f} against {row['llm_alone_tokens_per_s']:.0f} tokens/s)", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return result


def table(result: dict) -> str:
    """The markdown tables: per server and users, R2R over the LLM alone under each variant (R2R / the LLM alone,
    tokens/s); one step per synchronisation and the sensitivity to host time; the replay of the first run's loads."""
    cells = {(c["server"], c["users"], c["variant"]): c for c in result["cells"]}
    users = sorted({c["users"] for c in result["cells"]})
    lines = ["| server | users | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
    for server in SERVERS:
        for n in users:
            here = [cells.get((server, n, v)) for v in VARIANTS]
            lines.append(f"| {server} | {n} | " + " | ".join(
                "-" if c is None else f"{c['vs_llm_alone']:.2f}x ({c['tokens_per_s']:.0f} / "
                                      f"{c['llm_alone_tokens_per_s']:.0f})" for c in here) + " |")
    slow = {(c["server"], c["users"]): c for c in result["sensitivity"]["cells"]}
    lines += ["", "| server | users | as served (blocks of 4) | one step per synchronisation | with the first run's "
              "unfused host time | LLM forwards / token | the same, plain |", "|---|---|---|---|---|---|---|"]
    for server in SERVERS:
        for n in users:
            c, plain = cells[(server, n, "hybrid, as served")], cells[(server, n, "plain (none of the three)")]
            lines.append(f"| {server} | {n} | {c['vs_llm_alone']:.2f}x | "
                         f"{c['one_step_per_synchronisation']['vs_llm_alone']:.2f}x | "
                         f"{slow[(server, n)]['vs_llm_alone']:.2f}x | {c['llm_forwards_per_token']:.3f} | "
                         f"{plain['llm_forwards_per_token']:.3f} |")
    lines += ["", "| first run's server | users | measured tokens/s | replayed (shapes) | replayed / measured |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['users']} | {r['measured_tokens_per_s']:.1f} | {r['replayed_tokens_per_s']:.1f} | "
              f"{r['replayed_over_measured']:.2f} |" for r in result["against_first_run"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
