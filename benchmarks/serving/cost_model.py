"""The server's cost model: replay served answers' routing under any waiting policy, with any forward costs.

    python -m benchmarks.serving.cost_model                   # validate on this CPU, then predict the H200 table
    python -m benchmarks.serving.cost_model --trace T.jsonl   # a trace of benchmarks/serving/load.py (R2R_SERVE_TRACE)

An answer's routing belongs to the answer (a row answers what it answers alone, whatever the policy or its
neighbours), so the answers a load run served, with which of their tokens the LLM wrote, can be replayed
under another policy, another concurrency or another machine's forward costs. ``simulate`` serves them
through the engine's own schedule (``replay.py``: the real ``core.turn.turn`` and ``core.plan.plan_step`` over a
batch whose forwards are priced instead of run): closed-loop clients, free slots filled between turns, chunked
prefill, each step's proposals, the real ``WaitPolicy``, the LLM's catch-up over the rows it writes (each from
where it last read, in pieces of 256 tokens), the SLM reading what was committed, and the host reading a token
one step after it was committed. Time is the sum of the forwards' costs plus a fixed host cost per step.
Speculative policies (``WaitPolicy.speculate``) replay too: each routed position carries whether the LLM agrees
with the SLM there (recorded, or drawn with the measured share ``AGREEMENT``); ``benchmarks/serving/speculative.py``
predicts their table.

Costs: on this CPU the fits of ``benchmarks/serving/forward_costs.py`` (``t = a + b k + c k g`` for k rows of g tokens);
on an H200 the estimated component costs (``H200_CAPTURED`` below; the costs an H200
measured, and the replay checked against its served runs, are ``benchmarks/serving/calibrated.py``'s). The validation
compares the replay of each measured serve_load run with its measured tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from r2r_hf.core.fast.static_reads import BUCKETS
from r2r_hf.core.policy import WaitPolicy, default_policy, serving_policy

from .replay import Routed, replay


@dataclass(frozen=True)
class Costs:
    """Seconds per forward of k rows x g tokens, per model; the router on k rows; host work per step.

    Either a roofline per model, ``max(a + b k, c k g)`` (a GPU: the weights' read, or compute past the ridge),
    or a measured grid per model (this CPU; a device check's grid: ``calibrated.grid_costs``), interpolated linearly
    in k and g and extended past its largest g by the slope of its last two (a grid of one rows value, as a packed
    read's by its total tokens, in g only).
    """

    slm: tuple[float, float, float] | dict
    llm: tuple[float, float, float] | dict
    router: tuple[float, float]  # a + b k
    step: float
    name: str = ""
    packed: bool = False  # the LLM's reads packed (one flat forward at a bucket of its total tokens, the joining
    # prompts' pieces riding in them: core/layouts/packed.py), as the server runs them on a fused captured path
    # price a read at the captured graph's shape, as the server runs it on a GPU: the rows bucket holding its
    # highest slot (a read of slots 3 and 12 of 16 is a 16-row read) and the tokens bucket of its longest row
    captured_shapes: bool = False
    gathered_rows: bool = False  # with it: an LLM read at the smaller of that and its rows' own bucket (the server
    # since the first device run gathers the LLM's rows: fast/slot_reads.py; the device ran the server without it)
    plan: float = 1e-4  # host seconds to plan and apply one step: a draft block's steps after its synchronisation
    # (host_ops.py measured 0.05-0.07 ms per step between the read-back and the device work at 8 and 16 rows)
    # the roles whose model has recurrent layers (``core/layouts/slot_state.py``): every row of one of its forwards
    # reads as many tokens, one of ``widths`` (``SlotBook.read``: a catch-up of rows with different counts takes
    # several forwards), its state is checkpointed where speculation may cut a row back, and a cut returns the row
    # to its checkpoint, from where the model reads again
    recurrent: tuple[str, ...] = ()
    widths: tuple[int, ...] = BUCKETS  # a recurrent model's widths: the captured server's (``fast/slot_reads.py``)
    split: bool = True  # False prices a what-if: a recurrent model's reads padded as a transformer's (no split)
    rewind: bool = True  # False prices a what-if: a cut leaves a recurrent model where the cut is (no re-read)

    def forward(self, role: str, rows: int, tokens: int, span: int = 0) -> float:
        """Seconds for one forward of ``role`` over ``rows`` rows of ``tokens`` tokens (``span``: the columns it
        attends, unused here: these costs were measured at their own spans)."""
        model = self.slm if role == "slm" else self.llm
        if isinstance(model, dict):
            return _interpolated(model, rows, tokens)
        a, b, c = model
        return max(a + b * rows, c * rows * tokens)

    def state_copy(self, role: str, rows: int) -> float:
        """Seconds to copy ``rows`` rows' recurrent state of ``role`` once (a checkpoint or a restore): these costs
        know no state size (``shape_costs.ShapeCosts`` prices it from shapes)."""
        return 0.0


def _between(points: list[int], x: int) -> tuple[int, int]:
    for lo, hi in zip(points, points[1:]):
        if x <= hi:
            return lo, hi
    return points[-2], points[-1]


def _interpolated(grid: dict, rows: int, tokens: int) -> float:
    ks = sorted({k for k, _ in grid})
    gs = sorted({g for _, g in grid})

    def at_k(k: int) -> float:  # linear in g (and beyond the grid, by its last slope)
        if len(gs) == 1:
            return grid[k, gs[0]]
        g0, g1 = _between(gs, tokens)
        t0, t1 = grid[k, g0], grid[k, g1]
        return t0 + (t1 - t0) * (tokens - g0) / (g1 - g0)

    if len(ks) == 1:  # (one rows value: a packed read's grid, by its total tokens)
        return max(at_k(ks[0]), 0.0)
    k0, k1 = _between(ks, rows)
    t0, t1 = at_k(k0), at_k(k1)
    return max(t0 + (t1 - t0) * (rows - k0) / (k1 - k0), 0.0)


# H200, bf16, R1-Distill 1.5B + 32B shapes, captured/compiled steps (benchmarks/results/serving_cost_model.md): an SLM
# step ~2.5 ms and a 32B forward ~19 ms, both flat in rows below the FLOP:byte ridge; past it a token costs
# ~6 us (1.5B) / ~0.13 ms (32B) of compute at ~500 TFLOP/s. The router ~0.2 ms. Estimates: the first H200 run
# measured the fused 32B at 18.0-20.4 ms for one token at 1-16 rows and the SLM at 2.2 ms (``calibrated.py``).
H200_CAPTURED = Costs(slm=(2.5e-3, 0.0, 6e-6), llm=(19e-3, 0.0, 1.3e-4), router=(2e-4, 0.0), step=1e-4,
                      name="H200, captured steps (cost model)")
# The same GPU running HF's eager forward (what the server runs there before issue 31 captures it): launch-bound,
# an eager 1.5B step measured at 18.5 ms and a 32B forward at 45-55 ms on an H200 (benchmarks/results/gpu_first_run.md).
H200_EAGER = Costs(slm=(18.5e-3, 0.0, 6e-6), llm=(50e-3, 0.0, 1.3e-4), router=(1e-3, 0.0), step=2e-4,
                   name="H200, eager steps (measured step costs)")


def simulate(answers: list[tuple[int, list[bool]]], concurrency: int, policy: WaitPolicy, costs: Costs,
             slots: int = 16, chunk: int = 256, routes: bool | None = None) -> dict:
    """Serve ``answers`` (prompt length, routed flag per token) through the real schedule (``replay.py``),
    ``concurrency`` at a time; tokens/s, latencies and counters (``routes``: ``replay.replay``'s)."""
    batch, done = replay(answers, concurrency, policy, costs, slots, chunk, routes=routes)
    c = batch.counters
    tokens = sum(len(a.routed) for a in done)
    gaps = [b - a for answer in done for a, b in zip(answer.times, answer.times[1:])]
    return {"concurrency": concurrency, "tokens_per_s": tokens / batch.clock.now, "wall_s": batch.clock.now,
            "steps": c.steps,
            "llm_forwards_per_token": c.llm_forwards / tokens, "slm_forwards_per_token": c.slm_forwards / tokens,
            "llm_calls": c.llm_calls, "llm_forwards": c.llm_forwards, "slm_forwards": c.slm_forwards,
            "rows_per_llm_call": c.llm_rows / c.llm_calls if c.llm_calls else None,
            "wait_p50": c.waits.quantile(0.5), "wait_p95": c.waits.quantile(0.95),
            "itl_p50_ms": 1000 * _quantile(gaps, 0.5), "itl_p95_ms": 1000 * _quantile(gaps, 0.95),
            "itl_p99_ms": 1000 * _quantile(gaps, 0.99), "llm_token_rate": sum(sum(a.routed) for a in done) / tokens,
            "llm_calls_per_token": c.llm_calls / tokens, "thrown_per_token": c.thrown / tokens,
            "resolutions": c.resolutions, "agreed": c.agreed, "rejected": c.rejected,
            "pending_per_resolution": (c.agreed + c.rejected) / c.resolutions if c.resolutions else None,
            "time_share": {what: seconds / batch.clock.now for what, seconds in batch.clock.spent.items()}}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ----------------------------------------------------------------- inputs
# The share of routed positions at which the LLM's token equals the SLM's proposal, measured on the shipped pair
# (Qwen2.5-Coder 0.5B + 1.5B and its router, greedy, 10 HumanEval answers: 113 of 129;
# benchmarks/results/speculation.md).
AGREEMENT = 0.876


def _agreement(routed: list[bool], agreement: float, rng: random.Random) -> Routed:
    """``routed`` with an agreement flag drawn at each routed position (True elsewhere: never read there)."""
    return Routed(routed, [rng.random() < agreement if hit else True for hit in routed])


def answers_of(trace: str | Path, agreement: float = AGREEMENT, seed: int = 0) -> list[tuple[int, Routed]]:
    """The answers a traced server served: (prompt length, routed flag per token), in the order they ended. Where
    the trace records whether the LLM agreed with the SLM at each token (``agrees``), that; else drawn at each routed
    position with probability ``agreement`` (seeded)."""
    out, rng = [], random.Random(f"agrees-{seed}")
    for line in Path(trace).read_text().splitlines():
        record = json.loads(line)
        if "answer" in record:
            answer = record["answer"]
            routed = [bool(r) for r in answer["routed"]]
            agrees = answer.get("agrees")
            out.append((answer["prompt"], _agreement(routed, agreement, rng) if agrees is None
                        else Routed(routed, [bool(a) for a in agrees])))
    return out


def synthetic(answers: list[tuple[int, list[bool]]], p: float, seed: int = 0,
              agreement: float = AGREEMENT) -> list[tuple[int, Routed]]:
    """The same prompt and answer lengths, each token routed with probability ``p`` (a forced share), and the LLM
    agreeing with the SLM at each routed position with probability ``agreement`` (its own stream: the routing is
    the same whatever ``agreement``)."""
    rng, agrees = random.Random(seed), random.Random(f"agrees-{seed}")
    return [(prompt, _agreement([rng.random() < p for _ in routed], agreement, agrees)) for prompt, routed in answers]


def cpu_costs(path: str | Path = "benchmarks/results/forward_costs.json", step: float = 2e-3) -> Costs:
    """This CPU's measured grids (``benchmarks/serving/forward_costs.py``) and a host cost per step."""
    data = json.loads(Path(path).read_text())
    grids = {role: {tuple(int(x) for x in key.split("x")): t for key, t in data["reads"][role].items()}
             for role in ("slm", "llm")}
    router = data["router"]
    ks = sorted(int(k) for k in router)
    slope = (router[str(ks[-1])] - router[str(ks[0])]) / max(ks[-1] - ks[0], 1)
    return Costs(slm=grids["slm"], llm=grids["llm"], router=(router[str(ks[0])] - slope * ks[0], slope), step=step,
                 name=f"this CPU ({data['conditions']['dtype']}, 1 thread, benchmarks/serving/forward_costs.py)")


def alone_on_the_engine(answers, concurrency: int, costs: Costs, slots: int, block: int) -> float:
    """Tokens/s of the fair LLM alone served on R2R's engine (``gpu/serve.ALONE_OPTIONS``: ``costs`` prices the LLM
    in the SLM's place and its LLM-side reads at nothing): the same answers never routing, the GPU's waiting default,
    drafting in blocks of ``block`` (nothing stops a block where nothing routes)."""
    never = [(prompt, [False] * len(routed)) for prompt, routed in answers]
    policy = replace(default_policy("cuda", slots), block=block)
    return simulate(never, concurrency, policy, costs, slots)["tokens_per_s"]


def llm_alone(answers, concurrency: int, costs: Costs) -> float:
    """Tokens/s of the LLM alone served the same way: every token the LLM's, no SLM, no router."""
    everything = [(prompt, [True] * len(routed)) for prompt, routed in answers]
    free = replace(costs, slm=(0.0, 0.0, 0.0), router=(0.0, 0.0))
    return simulate(everything, concurrency, WaitPolicy(), free)["tokens_per_s"]


POLICY_GRID = [WaitPolicy((m,), w) for m in (2, 3, 4, 6, 8) for w in (2, 4, 8, 16, 32, 64)]


def best_policies(answers, costs: Costs, concurrencies=(4, 8, 16)) -> list[dict]:
    """Each grid policy's tokens/s relative to ``m = 1`` at each concurrency, best first (by the geometric mean)."""
    base = {c: simulate(answers, c, WaitPolicy(), costs)["tokens_per_s"] for c in concurrencies}
    scored = []
    for policy in POLICY_GRID:
        gains = [simulate(answers, c, policy, costs)["tokens_per_s"] / base[c] for c in concurrencies]
        scored.append({"min_rows": policy.min_rows[0], "max_wait": policy.max_wait, "gains": gains,
                       "geomean": statistics.geometric_mean(gains)})
    return sorted(scored, key=lambda x: -x["geomean"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", default="benchmarks/results/serve_load.json", help="measured runs to validate on")
    parser.add_argument("--costs", default="benchmarks/results/forward_costs.json")
    parser.add_argument("--out", default="benchmarks/results/serve_model.json")
    parser.add_argument("--table", action="store_true", help="print the tables of --out and exit")
    parser.add_argument("--host-step-ms", type=float, help="the H200's host time per served step, measured "
                        "(benchmarks/speed/host_ops.py, the device check's serving phase); default: the cost "
                        "model's 0.1 ms")
    args = parser.parse_args(argv)
    captured = H200_CAPTURED if args.host_step_ms is None else replace(
        H200_CAPTURED, step=args.host_step_ms / 1e3, name=f"{H200_CAPTURED.name}, host {args.host_step_ms:g} ms/step")
    if args.table:
        print(tables(json.loads(Path(args.out).read_text())))
        return {}
    cpu = cpu_costs(args.costs)
    traces = Path(args.load).parent / f"{Path(args.load).stem}_traces"
    out: dict = {"costs": {c.name: {"slm": str(c.slm)[:200], "llm": str(c.llm)[:200], "router": c.router,
                                    "step": c.step} for c in (cpu, captured, H200_EAGER)},
                 "validation": [], "policies": {}, "prediction": []}
    measured = json.loads(Path(args.load).read_text()) if Path(args.load).exists() else {"runs": {}}
    for name, runs in measured["runs"].items():  # 1. each measured run, replayed with this CPU's costs
        for run in sorted(runs, key=lambda r: r["concurrency"]):
            trace = traces / f"{name}-c{run['concurrency']}.jsonl"
            if not trace.exists() or "policy" not in run:
                continue
            named = run["policy"]  # what the run's flags named (``load._policy_of``); the rest the server's
            min_rows = tuple(named["min_rows"]) if "min_rows" in named else None
            policy = serving_policy("cuda", 16, min_rows, named.get("max_wait"), named.get("speculate", 0),
                                    named.get("speculate_below"))
            got = simulate(answers_of(trace), run["concurrency"], policy, cpu)
            row = {"server": name, "concurrency": run["concurrency"], "measured_tokens_per_s": run["tokens_per_s"],
                   "predicted_tokens_per_s": got["tokens_per_s"],
                   "error": got["tokens_per_s"] / run["tokens_per_s"] - 1}
            out["validation"].append(row)
            print("validate", json.dumps(row), flush=True)
    routed = traces / "m1-c16.jsonl"
    recorded = answers_of(routed) if routed.exists() else synthetic([(120, [False] * 64)] * 16, 0.05)
    routings = {"recorded (the shipped router, HumanEval-style prompts)": recorded,
                "p = 0.1, 256 tokens": synthetic([(prompt, [False] * 256) for prompt, _ in recorded], 0.1)}
    for costs in (captured, H200_EAGER, cpu):  # 2. the best policies per machine (what chose the defaults)
        for label, answers in routings.items():
            ranked = best_policies(answers, costs)
            out["policies"][f"{costs.name} | {label}"] = ranked[:5]
    policies = {"m = 1": WaitPolicy(), "GPU default (m = rows / 3, w = 16)": default_policy("cuda", 16)}
    out["prediction"] = predict(routings, policies, machines=(captured, H200_EAGER))
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(tables(out))
    return out


def tables(out: dict) -> str:
    lines = ["| server | concurrency | measured tokens/s | predicted | error |", "|---|---|---|---|---|"]
    for v in out["validation"]:
        lines.append(f"| {v['server']} | {v['concurrency']} | {v['measured_tokens_per_s']:.2f} | "
                     f"{v['predicted_tokens_per_s']:.2f} | {v['error']:+.0%} |")
    lines += ["", "| machine | routing | concurrency | policy | tokens/s | vs LLM alone | LLM forwards / token | "
              "rows / LLM forward | inter-token p50 / p95 (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    for p in out["prediction"]:
        rows = "-" if p["rows_per_llm_call"] is None else f"{p['rows_per_llm_call']:.2f}"
        lines.append(f"| {p['machine']} | {p['routing']} | {p['concurrency']} | {p['policy']} | {p['tokens_per_s']:.0f} | "
                     f"{p['vs_llm_alone']:.2f}x | {p['llm_forwards_per_token']:.3f} | {rows} | "
                     f"{p['itl_p50_ms']:.1f} / {p['itl_p95_ms']:.1f} |")
    return "\n".join(lines)


def predict(answers_by_label: dict, policies: dict[str, WaitPolicy], machines=(H200_CAPTURED, H200_EAGER),
            concurrencies=(1, 8, 16)) -> list[dict]:
    """The predicted table: each policy against the LLM alone, per machine, routing and concurrency."""
    rows = []
    for costs in machines:
        for label, answers in answers_by_label.items():
            for c in concurrencies:
                alone = llm_alone(answers, c, costs)
                for name, policy in policies.items():
                    got = simulate(answers, c, policy, costs)
                    rows.append({"machine": costs.name, "routing": label, "concurrency": c, "policy": name,
                                 **got, "vs_llm_alone": got["tokens_per_s"] / alone, "llm_alone_tokens_per_s": alone})
    return rows


if __name__ == "__main__":
    main()
