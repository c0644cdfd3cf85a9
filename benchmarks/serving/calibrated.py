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
makes a smaller rows bucket (``gathering``: ``fast/slot_reads.PaddedSteps``, since the first device run).
Results: ``benchmarks/results/gpu_calibrated.json``; benchmarks/results/gpu_first_run.md.

**A second path, from one run's grid only** (``grid_costs``, ``grid_check``; ``--grid JSON``): the second device
run (issue 51) times every kind of forward the server replays on the engine's own captured steps (the check's
``grid_*`` sections, ``benchmarks/gpu/grid.py``). The costs are read from those sections alone — no served number
is among their inputs — and the same run's served loads (``serving``) are then replayed with them and set beside
what was measured: each within 15 %, or the result says where not.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from r2r_hf.core.layouts.packed import GROUPS, tokens_buckets
from r2r_hf.core.policy import DRAFT_BLOCK, IMMEDIATE, WaitPolicy, default_policy, speculative_policy

from .cost_model import AGREEMENT, Costs, alone_on_the_engine, llm_alone, simulate, synthetic
from .replay import replay
from .speculative import by_fraction

TOKENS = (1, 2, 4, 8, 16, 32, 64)
SLOTS = 16
PACKED_TOKENS = tokens_buckets(64 * GROUPS[-1])  # every packed read's tokens bucket up to 64 slots (the grids' most)


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


def today(first: dict, fused: dict, p: float = 0.1, depth: int = 4) -> list[dict]:
    """Today's server priced with the first run's measured costs (``first_run_costs``: the LLM's reads packed, the
    joining prompts' pieces riding in them), the router folded into the SLM's reads (its fixed cost per step gone; its
    cost per row kept, as the first run measured it growing 46 us per row for a reason not yet known), speculating
    with draft blocks (``core/fast/drafts.py``) and without, at batch 1 and 8 and 16 users, 256- and 2,048-token
    answers, against the fair LLM alone (each prompt read once, its steps drafted in blocks as R2R's)."""
    costs = first_run_costs(first, fused)
    folded = replace(costs["r2r"], router=(0.0, costs["r2r"].router[1]))
    out = []
    for c in (1, 8, 16):
        for tokens in (256, 2048):
            answers = served_answers(c, p, tokens)
            alone = alone_on_the_engine(answers, c, costs["alone"], SLOTS, DRAFT_BLOCK)
            speculating, waiting = speculative_policy("cuda", SLOTS, depth), default_policy("cuda", SLOTS)
            for name, policy in (("m = 1", IMMEDIATE), ("waiting, one step per synchronisation", waiting),
                                 (f"waiting default, blocks of {DRAFT_BLOCK}", replace(waiting, block=DRAFT_BLOCK)),
                                 (f"speculative, d{depth}, one step per synchronisation", speculating),
                                 (f"speculative default, d{depth}, blocks of {DRAFT_BLOCK}",
                                  replace(speculating, block=DRAFT_BLOCK))):
                run, done = replay(answers, c, policy, folded, SLOTS)
                k, produced = run.counters, sum(len(a.routed) for a in done)
                out.append({"concurrency": c, "tokens": tokens, "policy": name,
                            "tokens_per_s": produced / run.clock.now, "vs_llm_alone": produced / run.clock.now / alone,
                            "llm_alone_tokens_per_s": alone,
                            "llm_rows_useful": k.llm_rows_real / k.llm_rows_read if k.llm_rows_read else None,
                            "llm_calls_per_token": k.llm_calls / produced, "thrown_per_token": k.thrown / produced})
    return out


def _linear(points: dict[int, float]) -> tuple[float, float]:
    """Least squares ``a + b k`` through ``{k: t}`` (one point: flat)."""
    ks = sorted(points)
    if len(ks) == 1:
        return points[ks[0]], 0.0
    mean_k, mean_t = sum(ks) / len(ks), sum(points.values()) / len(ks)
    slope = sum((k - mean_k) * (points[k] - mean_t) for k in ks) / sum((k - mean_k) ** 2 for k in ks)
    return mean_t - slope * mean_k, slope


def grid_costs(data: dict) -> dict[str, Costs]:
    """The costs of a check's grid sections alone (seconds): R2R's server (the SLM's reads per rows x tokens, the
    LLM's packed reads per total-token bucket, the router's graph in rows unless the SLM's reads fold it, the host per
    step) and the LLM alone's
    (the LLM's padded reads in the SLM's place, the top-k of its logits as its router, its own LLM-side reads none:
    each prompt is read once, by the model in the SLM's place)."""
    def section(name: str) -> dict:
        found = data.get(f"grid_{name}")
        if not found:
            raise ValueError(f"the check's JSON has no grid_{name} section: the grid phase did not measure it")
        return found

    by_shape = lambda name: {(v["rows"], v["tokens"]): v["ms"] / 1e3 for v in section(name).values()}  # noqa: E731
    packed = {(1, v["width"]): v["ms"] / 1e3 for v in section("llm_packed").values()}
    router = _linear({int(k): v["ms"] / 1e3 for k, v in section("router").items()})
    if data.get("grid_slots", {}).get("folded"):  # the SLM's reads carry the router: its time is in theirs
        router = (0.0, 0.0)
    topk = _linear({int(k): v["ms"] / 1e3 for k, v in section("topk").items()})
    hosts = [v["host_ms_per_step"] / 1e3 for v in section("host").values()]
    step = sum(hosts) / len(hosts)
    r2r = Costs(slm=by_shape("slm"), llm=packed, router=router, step=step, packed=True, captured_shapes=True,
                name="fitted on the grid")
    never = {(1, t): 0.0 for t in PACKED_TOKENS}  # its LLM-side slots are never read (serve.ALONE_OPTIONS)
    alone = Costs(slm=by_shape("llm_padded"), llm=never, router=topk, step=step, packed=True, captured_shapes=True,
                  name="the LLM alone, fitted on the grid")
    return {"r2r": r2r, "alone": alone}


def _replayed(run: dict, server: str, costs: dict[str, Costs], plan: dict) -> float:
    """Tokens/s of one served load replayed with the grid's costs under its server's policy."""
    c, requests = run["concurrency"], run["requests"]
    tokens, prompt, p = run["tokens"] // requests, plan["prompt"], plan["headline"]
    long = "long" in server
    slots = plan["long_users"] if long else max(plan["serve"])
    block = run.get("block", 1)  # steps its server drafted per synchronisation (runs before blocks: 1)
    if server == "LLM alone":
        return alone_on_the_engine([(prompt, [False] * tokens)] * requests, c, costs["alone"], slots, block)
    lossless = "lossless" in server  # threshold 0: every token routes, no router step, frontier tokens
    answers = synthetic([(prompt, [False] * tokens)] * requests, 1.0 if lossless else p,
                        agreement=plan.get("agreement", AGREEMENT))
    policy = (speculative_policy("cuda", slots, run["speculate"]) if run.get("policy") == "speculative"
              else default_policy("cuda", slots))
    return simulate(answers, c, replace(policy, block=block), costs["r2r"], slots,
                    routes=True if lossless else None)["tokens_per_s"]


def grid_check(data: dict, tolerance: float = 0.15) -> dict:
    """The cost model fitted on ``data``'s grid (``grid_costs``), then each served load of ``data`` replayed with it
    beside what was measured: within ``tolerance``, or listed in ``outside``."""
    costs = grid_costs(data)
    rows = []
    for server, runs in data.get("serving", {}).items():
        if server == "ratios":
            continue
        for i, run in enumerate(runs):
            fitted = _replayed(run, server, costs, data["plan"])
            rows.append({"server": server, "concurrency": run["concurrency"], "run": i,
                         "measured_tokens_per_s": run["tokens_per_s"], "fitted_tokens_per_s": fitted,
                         "fitted_over_measured": fitted / run["tokens_per_s"],
                         "within": abs(fitted / run["tokens_per_s"] - 1) <= tolerance})
    r2r = costs["r2r"]
    return {"inputs": "the grid_* sections only (no served number)", "tolerance": tolerance,
            "costs": {"router_ms": [1e3 * r2r.router[0], 1e3 * r2r.router[1]], "host_ms_per_step": 1e3 * r2r.step},
            "against_served": rows, "outside": [f"{r['server']} at {r['concurrency']} (run {r['run']}): "
                                                f"{r['fitted_over_measured']:.2f}x" for r in rows if not r["within"]]}


def first_run_costs(first: dict, fused: dict) -> dict[str, Costs]:
    """The first device run's costs (``measured_costs``) as today's server runs: the LLM's reads packed (a read of T
    tokens priced as one row of T, the weights' read or the 8 x 64 read's compute per token, whichever is more), the
    LLM alone with the LLM's padded reads in the SLM's place (and R2R's router cost: its own was not measured)."""
    costs = replace(measured_costs(first, fused), captured_shapes=True)
    parts = first["components_ms"]["8"]["captured"]["t_llm"]
    compute = parts["64"] / 1e3 / (8 * 64)  # seconds per token past the ridge (the 8 x 64 read, as measured_costs)
    packed = {(1, t): max(costs.forward("llm", 1, t), compute * t) for t in PACKED_TOKENS}  # roofline in the total
    never = {(1, t): 0.0 for t in PACKED_TOKENS}  # the LLM alone's LLM-side slots are never read (ALONE_OPTIONS)
    return {"r2r": replace(costs, llm=packed, packed=True),
            "alone": replace(costs, slm=costs.llm, llm=never, packed=True, name="the LLM alone, first device run")}


def predict_second(first: dict, fused: dict, plan: dict) -> dict:
    """What the cost model with the first run's costs predicts for each number the second run's check measures
    (``benchmarks/gpu/plan.DEVICE``): every grid point, and every served load of its plan, in ms and tokens/s."""
    costs = first_run_costs(first, fused)
    r2r, alone = costs["r2r"], costs["alone"]
    ms = lambda role, k, g: 1e3 * r2r.forward(role, k, g)  # noqa: E731
    slots = max(plan["serve"])
    totals = tokens_buckets(slots * plan["grid_tokens"][-1])
    grid = {"llm_padded": {f"{k}x{g}": 1e3 * alone.forward("slm", k, g) for k in plan["grid_rows"]
                           for g in plan["grid_tokens"]},
            "llm_packed": {str(t): ms("llm", 1, t) for t in totals},
            "llm_verify": {f"{k}x{g}": ms("llm", 1, k * g) for k in plan["verify_rows"] for g in plan["verify_tokens"]},
            "slm": {f"{k}x{g}": ms("slm", k, g) for k in plan["slm_rows"] for g in plan["slm_tokens"]},
            "router": {str(k): 1e3 * (r2r.router[0] + r2r.router[1] * k) for k in plan["slm_rows"]},
            "host_ms_per_step": 1e3 * r2r.step}
    loads = [("R2R, waiting", c, plan["serve_tokens"], "waiting") for c in plan["serve"]]
    loads += [("LLM alone", c, plan["serve_tokens"], "waiting") for c in plan["serve"]]
    loads += [("R2R, waiting, long", plan["long_users"], plan["long_tokens"], "waiting")]
    loads += [("R2R, speculative (oracle)", c, plan["serve_tokens"], "speculative") for c in plan["spec_users"]]
    served = []
    for server, c, tokens, policy in loads:
        requests = c if "long" in server else max(2 * c, 4)
        run = {"concurrency": c, "requests": requests, "tokens": requests * tokens, "policy": policy,
               "speculate": plan["speculate"], "block": DRAFT_BLOCK}  # (the servers' default on a GPU)
        served.append({"server": server, "concurrency": c, "tokens_per_s": _replayed(run, server, costs, plan)})
    return {"costs": "the first device run's (measured_costs), the LLM's reads packed", "grid": grid,
            "served": served}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", default="benchmarks/results/gpu_check.json")
    parser.add_argument("--fused", default="benchmarks/results/gpu_check_rerun.json")
    parser.add_argument("--out", default="benchmarks/results/gpu_calibrated.json")
    parser.add_argument("--grid", default=None, metavar="JSON",
                        help="a check with the grid (the second device run): its costs from the grid alone, checked "
                             "against its own served loads (printed; nothing else runs)")
    parser.add_argument("--predict-second", default=None, metavar="JSON",
                        help="write what the first run's costs predict for the second run's check (its plan: "
                             "benchmarks/gpu/plan.DEVICE) to JSON, and nothing else")
    parser.add_argument("--gathering", action="store_true",
                        help="--fused measured a server whose LLM reads gather their rows (any run after 2026-12-04)")
    args = parser.parse_args(argv)
    if args.grid:
        result = grid_check(json.loads(Path(args.grid).read_text()))
        print(json.dumps(result, indent=1))
        return result
    first, fused = (json.loads(Path(p).read_text()) for p in (args.first, args.fused))
    if args.predict_second:
        from dataclasses import asdict

        from benchmarks.gpu.plan import DEVICE

        result = predict_second(first, fused, asdict(DEVICE))
        Path(args.predict_second).write_text(json.dumps(result, indent=1))
        return result
    costs = replace(measured_costs(first, fused), gathered_rows=args.gathering)
    result = {"costs": {"slm_ms": {f"{k}x{g}": 1e3 * t for (k, g), t in costs.slm.items() if g == 1},
                        "llm_ms": {f"{k}x{g}": 1e3 * t for (k, g), t in costs.llm.items()},
                        "router_ms": [1e3 * costs.router[0], 1e3 * costs.router[1]], "host_ms_per_step": 1e3 * costs.step},
              "against_measured": against_measured(costs, fused),
              "speculative": [row for tokens in (128, 256) for row in speculative(costs, tokens)]}
    gathering = replace(costs, gathered_rows=True)  # today's server (the same as --fused's with --gathering)
    result["gathering"] = result["speculative"] if args.gathering else [
        row for tokens in (128, 256) for row in speculative(gathering, tokens)]
    result["today"] = today(first, fused)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for row in result["against_measured"] + result["speculative"] + result["gathering"] + result["today"]:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return result


if __name__ == "__main__":
    main()
