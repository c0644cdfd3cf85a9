"""Lossless decoding on the H200, predicted: R2R at threshold 0 speculating (the LLM's own answer, the SLM as draft)
against the LLM alone, with the costs the first device run measured, beside vLLM's lossless speculative decoding.

    python -m benchmarks.serving.lossless        # writes benchmarks/results/lossless_h200_predicted.json

Costs: ``calibrated.measured_costs`` (the first H200 run: the fused SLM step and router, the LLM's captured reads by
rows and tokens, the host's time per step outside the graph replays; R1-Distill 1.5B + 32B shapes, random weights),
the LLM's reads gathering their rows as today's server does. Load: ``concurrency`` closed-loop users, each answer
64 prompt tokens and 256 new ones, every token routed (threshold 0: no router step, confirmed tails take their
frontier token: ``replay.replay(routes=True)``), the LLM agreeing with the SLM's token at each position with
probability ``agreement``. Random weights agree nowhere, so agreement is an input: the real pair's at threshold 0
(measured on this CPU: ``benchmarks/results/lossless_*.json``, 0.99 on HumanEval) and lower ones, where a harder
pair or task would sit. Per (concurrency, agreement): each depth x resolution trigger of a grid (the LLM resolves
once a fraction of the running rows wait for it with full tails, or once the oldest pending position is ``w`` steps
old; ``speculative.by_fraction``), the best, the server's default (``core.policy.speculative_policy``: depth by
load), and the LLM alone served the same way (``cost_model.llm_alone``).
vLLM V1's lossless speculative decoding on one H100 (Qwen3-32B + Qwen3-1.7B draft, k = 4, MT-Bench, third-party
logs): 2.22 / 1.95 / 1.84x its 32B alone at 1 / 8 / 16 users.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
from dataclasses import replace
from pathlib import Path

from r2r_hf.core.policy import DRAFT_BLOCK, serving_policy, speculative_policy

from .calibrated import first_run_costs, measured_costs
from .cost_model import alone_on_the_engine, llm_alone, simulate, synthetic
from .replay import Routed
from .speculative import VLLM_LOSSLESS, by_fraction

SLOTS = 16
DEPTHS = (2, 3, 4, 6, 8, 12, 16)
TRIGGERS = {"all wait": 1.0, "half wait": 0.5, "never by count": None}
WAITS = (32,)
AGREEMENTS = (0.99, 0.9, 0.8, 0.7)
CONCURRENCIES = (1, 2, 4, 8, 12, 16)


def answers(concurrency: int, agreement: float, tokens: int = 256, prompt: int = 64, seed: int = 0) -> list:
    """The load of one cell: 4 x ``concurrency`` answers (at least 8), every token routed."""
    return synthetic([(prompt, [False] * tokens)] * max(4 * concurrency, 8), 1.0, seed, agreement)


def cell(costs, concurrency: int, agreement: float) -> dict:
    """Every policy of the grid at one (concurrency, agreement), against the LLM alone."""
    load = answers(concurrency, agreement)
    alone = llm_alone(load, concurrency, costs)
    runs = []
    for depth in DEPTHS:
        for trigger, fraction in TRIGGERS.items():
            for wait in WAITS:
                got = simulate(load, concurrency, by_fraction(fraction, wait, depth, SLOTS), costs, SLOTS,
                               routes=True)
                runs.append({"depth": depth, "trigger": trigger, "wait": wait, "tokens_per_s": got["tokens_per_s"],
                             "vs_llm_alone": got["tokens_per_s"] / alone,
                             "llm_calls_per_token": got["llm_calls_per_token"],
                             "thrown_per_token": got["thrown_per_token"], "time_share": got["time_share"]})
    best = max(runs, key=lambda r: r["tokens_per_s"])
    shipped = simulate(load, concurrency, speculative_policy("cuda", SLOTS, 16), costs, SLOTS, routes=True)
    default = {"policy": "the server's default on a GPU (--speculate 16: depth by load)",
               "tokens_per_s": shipped["tokens_per_s"], "vs_llm_alone": shipped["tokens_per_s"] / alone}
    return {"concurrency": concurrency, "agreement": agreement, "llm_alone_tokens_per_s": alone, "best": best,
            "server_default": default, "runs": runs}


def today(first: dict, fused: dict, agreements=(0.99, 0.9), concurrencies=(1, 8, 16)) -> list[dict]:
    """Today's server at threshold 0 (``calibrated.today``'s costs: the LLM's reads packed, joining prompts riding in
    them; no router runs), its GPU default (``serving_policy("cuda", speculate=16)``: depth by load, blocks of
    ``DRAFT_BLOCK``) and the same without blocks, against the fair LLM alone drafting in blocks too."""
    costs, out = first_run_costs(first, fused), []
    default = serving_policy("cuda", SLOTS, speculate=16)
    for agreement in agreements:
        for c in concurrencies:
            load = answers(c, agreement)
            alone = alone_on_the_engine(load, c, costs["alone"], SLOTS, DRAFT_BLOCK)
            for name, policy in ((f"server default, blocks of {default.block}", default),
                                 ("server default, one step per synchronisation", replace(default, block=1))):
                got = simulate(load, c, policy, costs["r2r"], SLOTS, routes=True)
                out.append({"concurrency": c, "agreement": agreement, "policy": name,
                            "tokens_per_s": got["tokens_per_s"], "vs_llm_alone": got["tokens_per_s"] / alone,
                            "llm_alone_tokens_per_s": alone, "thrown_per_token": got["thrown_per_token"]})
            print(f"today: {c:2d} users, agreement {agreement}: " + ", ".join(
                f"{r['policy']} {r['vs_llm_alone']:.2f}x" for r in out[-2:]), flush=True)
    return out


def traced(concurrency: int, tokens: int = 256, prompt: int = 64) -> list:
    """The load of one cell with the real pair's agreement where the synthetic one is i.i.d.: 4 x ``concurrency``
    answers (at least 8), each the first ``tokens`` of a teacher-forced HumanEval trace
    (``results/depth_traces_bfloat16.json``: where the LLM's token is the SLM's, 0.98 of them, in clusters)."""
    traces = json.loads(Path("benchmarks/results/depth_traces_bfloat16.json").read_text())["traces"]
    picked = [traces[i % len(traces)] for i in range(max(4 * concurrency, 8))]
    return [(prompt, Routed([True] * len(t["agree"][:tokens]), t["agree"][:tokens], t["p"][:tokens])) for t in picked]


def calibrated(load: list, agreement: float) -> list:
    """``load`` (i.i.d. agreement) with the SLM's probability of every proposal ``agreement``: calibrated but blind
    (it cannot tell the tokens the LLM rejects), so the expected-gain rule reads one number everywhere."""
    return [(prompt, Routed(routed, routed.agrees, [agreement] * len(routed))) for prompt, routed in load]


def draft_cost(costs, tokens: int = 9) -> float:
    """An LLM forward's cost in SLM steps as ``costs`` price them at one row (``WaitPolicy.draft_cost``): the LLM's
    read of ``tokens`` (a draft of 8 and its bonus token) over an SLM step, its host time per step included."""
    return costs.forward("llm", 1, tokens) / (costs.forward("slm", 1, 1) + costs.step / DRAFT_BLOCK)


def served_by_policy(tag: str, policies: dict, costs: dict, agreements, concurrencies, iid) -> list[dict]:
    """Each policy of ``policies`` on today's server (``costs``: ``first_run_costs``) against the fair LLM alone, per
    agreement (``iid(concurrency, agreement)``'s load, or the real pair's traces) and concurrency."""
    out = []
    for agreement in agreements:
        for c in concurrencies:
            load = traced(c) if agreement == "real pair" else iid(c, agreement)
            alone = alone_on_the_engine(load, c, costs["alone"], SLOTS, DRAFT_BLOCK)
            for name, policy in policies.items():
                got = simulate(load, c, policy, costs["r2r"], SLOTS, routes=True)
                out.append({"concurrency": c, "agreement": agreement, "policy": name, "vs_llm_alone":
                            got["tokens_per_s"] / alone, "tokens_per_s": got["tokens_per_s"],
                            "llm_alone_tokens_per_s": alone, "llm_calls_per_token": got["llm_calls_per_token"],
                            "thrown_per_token": got["thrown_per_token"]})
            print(f"{tag}: {c:2d} users, agreement {agreement}: " + ", ".join(
                f"{r['policy']} {r['vs_llm_alone']:.2f}x" for r in out[-len(policies):]), flush=True)
    return out


def gains(first: dict, fused: dict, agreements=("real pair", 0.9, 0.99), concurrencies=(1, 8, 16)) -> dict:
    """The expected-gain rule (``core.moves.draft_ends``, ``WaitPolicy.draft_cost``) on today's server (``today``'s
    costs and fair LLM alone), beside the GPU default (fixed depths by load) and depth by acceptance up to 16, the
    rule's cost the ratio the same costs give (``draft_cost``) and half and twice it, alone (up to 32 tokens) or
    within depths by load; on the real pair's traces (the SLM's own probabilities, ``traced``) and on i.i.d.
    agreement with a calibrated, blind SLM (``calibrated``)."""
    costs = first_run_costs(first, fused)
    ratio = draft_cost(costs["r2r"])
    fixed = serving_policy("cuda", SLOTS, speculate=16)  # (on a GPU: fixed depths by load)
    policies = {"fixed depths by load (8, 8, 6)": fixed,
                "adapting up to 16 at any load": replace(fixed, adapts=True, depths=())}
    for scale in (0.5, 1.0, 2.0):  # (the rule bounds drafts by speculate only: deeper where the SLM is sure)
        policies[f"expected gain, cost {scale * ratio:.1f}, up to 32"] = replace(
            fixed, speculate=32, depths=(), adapts=False, draft_cost=scale * ratio)
    policies[f"expected gain, cost {ratio:.1f}, within the depths by load (8, 8, 6)"] = replace(
        fixed, speculate=32, adapts=False, draft_cost=ratio)
    server = serving_policy("cuda", SLOTS, speculate=32, draft_cost=ratio)  # (--speculate 32 --draft-cost)
    policies[f"expected gain, cost {ratio:.1f}: the server's (depths {server.depths})"] = server
    out = served_by_policy("gains", policies, costs, agreements, concurrencies,
                           lambda c, a: calibrated(answers(c, a), a))
    return {"draft_cost": ratio, "rows": out}


def adaptive(first: dict, fused: dict, agreements=(0.99, 0.9, 0.8, "real pair"), concurrencies=(1, 8, 16)) -> list:
    """Drafts that adapt (``plan.adapted``) on today's server (``today``'s costs and fair LLM alone): the GPU default
    with fixed depths by load (before), adapting within them (the default now), and adapting up to ``--speculate``
    16 at any load; the agreement i.i.d. per position, or the real pair's traces (clustered)."""
    costs = first_run_costs(first, fused)
    fixed = serving_policy("cuda", SLOTS, speculate=16)  # (on a GPU: fixed depths by load)
    policies = {"fixed depths by load (8, 8, 6)": fixed,
                "adapting within the depths by load": replace(fixed, adapts=True),
                "adapting up to 16 at any load": replace(fixed, adapts=True, depths=())}
    return served_by_policy("adaptive", policies, costs, agreements, concurrencies, answers)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--fused", default="benchmarks/results/gpu_check_rerun.json")
    parser.add_argument("--out", default="benchmarks/results/lossless_h200_predicted.json")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--today", action="store_true", help="only today's server (packed, blocks) into --out's today")
    parser.add_argument("--adaptive", action="store_true", help="only drafts that adapt on today's server into --out's "
                                                                "adaptive")
    parser.add_argument("--gains", action="store_true", help="only the expected-gain rule on today's server into "
                                                             "--out's gains")
    args = parser.parse_args(argv)
    first, fused = (json.loads(Path(p).read_text()) for p in (args.first, args.fused))
    part = next((name for name in ("today", "adaptive", "gains") if getattr(args, name)), None)
    if part:
        result = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        result[part] = {"today": today, "adaptive": adaptive, "gains": gains}[part](first, fused)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return result
    costs = replace(measured_costs(first, fused), gathered_rows=True)
    grid = [(c, a) for a in AGREEMENTS for c in CONCURRENCIES]
    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        cells = list(pool.map(cell, [costs] * len(grid), *zip(*grid)))
    result = {"conditions": {"costs": costs.name, "host_ms_per_step": 1e3 * costs.step, "slots": SLOTS,
                             "answer": "64 prompt + 256 new tokens", "vllm_lossless": VLLM_LOSSLESS},
              "cells": cells}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for c in cells:
        b = c["best"]
        print(f"{c['concurrency']:3d} users, agreement {c['agreement']:.2f}: {b['vs_llm_alone']:.2f}x the LLM alone "
              f"(depth {b['depth']}, {b['trigger']}; server default {c['server_default']['vs_llm_alone']:.2f}x), "
              f"vLLM {VLLM_LOSSLESS.get(c['concurrency'], '-')}", flush=True)
    return result


if __name__ == "__main__":
    main()
