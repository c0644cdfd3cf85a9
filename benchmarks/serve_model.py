"""The server's cost model: replay served answers' routing under any waiting policy, with any forward costs.

    python -m benchmarks.serve_model                   # validate on this CPU, then predict the H200 table
    python -m benchmarks.serve_model --trace T.jsonl   # a trace of benchmarks/serve_load.py (R2R_SERVE_TRACE)

An answer's routing belongs to the answer (a row answers what it answers alone, whatever the policy or its
neighbours), so the answers a load run served, with which of their tokens the LLM wrote, can be replayed
under another policy, another concurrency or another machine's forward costs. ``simulate`` runs the engine's
schedule (``r2r_hf/serve/engine.py`` and ``core/step.py``) on them: closed-loop clients, free slots filled
between steps, the SLM's prefill of newcomers, each step's proposals, the real ``WaitPolicy``, the LLM's
catch-up over the rows it writes (each from where it last read, in pieces of 256 tokens), the SLM reading
what was committed, and the host reading a token one step after it was committed. Time is the sum of the
forwards' costs plus a fixed host cost per step.

Costs: on this CPU the fits of ``benchmarks/forward_costs.py`` (``t = a + b k + c k g`` for k rows of g tokens);
on an H200 the component costs of docs/performance.md (cost model, no device run yet), below. The validation
compares the replay of each measured serve_load run with its measured tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from r2r_hf.core.layouts import PIECE
from r2r_hf.core.policy import WaitPolicy, default_policy


@dataclass(frozen=True)
class Costs:
    """Seconds per forward of k rows x g tokens, per model; the router on k rows; host work per step.

    Either a roofline per model, ``max(a + b k, c k g)`` (a GPU: the weights' read, or compute past the ridge),
    or a measured grid per model (this CPU), interpolated linearly in k and g and extended past its largest g
    by the slope of its last two.
    """

    slm: tuple[float, float, float] | dict
    llm: tuple[float, float, float] | dict
    router: tuple[float, float]  # a + b k
    step: float
    name: str = ""

    def forward(self, role: str, rows: int, tokens: int) -> float:
        model = self.slm if role == "slm" else self.llm
        if isinstance(model, dict):
            return _interpolated(model, rows, tokens)
        a, b, c = model
        return max(a + b * rows, c * rows * tokens)


def _between(points: list[int], x: int) -> tuple[int, int]:
    for lo, hi in zip(points, points[1:]):
        if x <= hi:
            return lo, hi
    return points[-2], points[-1]


def _interpolated(grid: dict, rows: int, tokens: int) -> float:
    ks = sorted({k for k, _ in grid})
    gs = sorted({g for _, g in grid})

    def at_k(k: int) -> float:  # linear in g (and beyond the grid, by its last slope)
        g0, g1 = _between(gs, tokens)
        t0, t1 = grid[k, g0], grid[k, g1]
        return t0 + (t1 - t0) * (tokens - g0) / (g1 - g0)

    k0, k1 = _between(ks, rows)
    t0, t1 = at_k(k0), at_k(k1)
    return max(t0 + (t1 - t0) * (rows - k0) / (k1 - k0), 0.0)


# H200, bf16, R1-Distill 1.5B + 32B shapes, captured/compiled steps (docs/performance.md, serving.md): an SLM
# step ~2.5 ms and a 32B forward ~19 ms, both flat in rows below the FLOP:byte ridge; past it a token costs
# ~6 us (1.5B) / ~0.13 ms (32B) of compute at ~500 TFLOP/s. The router ~0.2 ms. Not measured on a device yet.
H200_CAPTURED = Costs(slm=(2.5e-3, 0.0, 6e-6), llm=(19e-3, 0.0, 1.3e-4), router=(2e-4, 0.0), step=1e-4,
                      name="H200, captured steps (cost model)")
# The same GPU running HF's eager forward (what the server runs there before issue 31 captures it): launch-bound,
# an eager 1.5B step measured at 18.5 ms and a 32B forward at 45-55 ms on an H200 (docs/performance.md).
H200_EAGER = Costs(slm=(18.5e-3, 0.0, 6e-6), llm=(50e-3, 0.0, 1.3e-4), router=(1e-3, 0.0), step=2e-4,
                   name="H200, eager steps (measured step costs)")


@dataclass
class _Row:
    prompt: int
    routed: list[bool]
    length: int = 0  # committed tokens (prompt included)
    llm_seen: int = 0
    written: int = 0  # answer tokens committed
    waiting_since: int | None = None
    slm_left: int = 0  # prompt tokens each model has still to read (chunked prefill)
    llm_left: int = 0
    times: list[float] = field(default_factory=list)  # when each token reached the host


def simulate(answers: list[tuple[int, list[bool]]], concurrency: int, policy: WaitPolicy, costs: Costs,
             slots: int = 16, catch_up_all: bool = False, chunk: int = 256) -> dict:
    """Serve ``answers`` (prompt length, routed flag per token) in order, ``concurrency`` at a time (closed loop:
    a request is sent when an earlier one ends), through the engine's schedule; tokens/s, latencies, counters.

    ``catch_up_all``: the LLM's forward also reads the unread tokens of the rows it does not write for (the
    engine reads only the writers'; this measures the alternative).
    """
    queue = list(range(len(answers)))
    clock, step_no, in_flight = 0.0, 0, 0
    rows: dict[int, _Row] = {}
    pending: list[int] = []  # rows whose token committed in the previous step reaches the host now
    done: list[_Row] = []
    llm_forwards = llm_calls = llm_rows = slm_forwards = 0
    waits: list[int] = []
    while queue or rows:
        # Decide: queued requests join free slots; then one chunk of every joining prompt is read by both models
        # (the LLM all but the last token: the engine's chunked prefill), before the others' step.
        while queue and in_flight < concurrency and len(rows) < slots:
            prompt, routed = answers[queue.pop(0)]
            slot = min(set(range(slots)) - set(rows))
            rows[slot] = _Row(prompt, routed, length=prompt, slm_left=prompt, llm_left=prompt - 1)
            in_flight += 1
        for side in ("slm", "llm"):
            left = [r for r in rows.values() if getattr(r, f"{side}_left") > 0]
            if left:
                width = min(chunk, max(getattr(r, f"{side}_left") for r in left))
                clock += costs.forward(side, len(left), width)
                slm_forwards += side == "slm"
                llm_forwards += side == "llm"
                for r in left:
                    setattr(r, f"{side}_left", max(0, getattr(r, f"{side}_left") - chunk))
                    if side == "llm" and not r.llm_left:
                        r.llm_seen = r.prompt - 1
        busy = any(not row.slm_left for row in rows.values())  # a step is taken (decoding() in the engine)
        # The step's host sync: the previous step's tokens reach the host; finished rows leave.
        for r in pending:
            row = rows[r]
            row.times.append(clock)
            if len(row.times) == len(row.routed):
                done.append(rows.pop(r))
                in_flight -= 1
        pending = []
        proposing = [r for r, row in rows.items() if row.waiting_since is None and row.written < len(row.routed)
                     and not row.slm_left]
        slm_writers = []
        for r in proposing:
            row = rows[r]
            if row.routed[row.written]:
                row.waiting_since = step_no
            else:
                slm_writers.append(r)
        waiting = [r for r, row in rows.items() if row.waiting_since is not None]
        oldest = max((step_no - rows[r].waiting_since for r in waiting), default=0)
        cost = costs.step + (costs.router[0] + costs.router[1] * len(proposing) if proposing else 0.0)
        llm_writers = waiting if policy.runs(len(waiting), len(rows), oldest, stalled=not slm_writers) else []
        if llm_writers:  # the catch-up: each writer from where the LLM last read it, pieces of PIECE tokens
            read = [r for r in rows if rows[r].length > rows[r].llm_seen and not rows[r].slm_left] if catch_up_all \
                else llm_writers
            left = [rows[r].length - rows[r].llm_seen for r in read]
            while left:
                cost += costs.forward("llm", len(left), min(PIECE, max(left)))
                llm_forwards += 1
                left = [n - PIECE for n in left if n > PIECE]
            llm_calls += 1
            llm_rows += len(llm_writers)
            for r in read:
                rows[r].llm_seen = rows[r].length
            for r in llm_writers:
                waits.append(step_no - rows[r].waiting_since)
                rows[r].waiting_since = None
        writers = slm_writers + llm_writers
        if writers:  # the SLM reads what was committed
            cost += costs.forward("slm", len(writers), 1)
            slm_forwards += 1
        for r in writers:
            rows[r].length += 1
            rows[r].written += 1
            pending.append(r)
        if busy:  # the engine steps only when a row decodes (not while every row is prefilling)
            clock += cost
            step_no += 1
    tokens = sum(len(row.routed) for row in done)
    gaps = [b - a for row in done for a, b in zip(row.times, row.times[1:])]
    return {"concurrency": concurrency, "tokens_per_s": tokens / clock, "wall_s": clock, "steps": step_no,
            "llm_forwards_per_token": llm_forwards / tokens, "slm_forwards_per_token": slm_forwards / tokens,
            "llm_calls": llm_calls, "llm_forwards": llm_forwards, "slm_forwards": slm_forwards,
            "rows_per_llm_call": llm_rows / llm_calls if llm_calls else None,
            "wait_p50": _quantile(waits, 0.5), "wait_p95": _quantile(waits, 0.95),
            "itl_p50_ms": 1000 * _quantile(gaps, 0.5), "itl_p95_ms": 1000 * _quantile(gaps, 0.95),
            "llm_token_rate": sum(sum(row.routed) for row in done) / tokens}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ----------------------------------------------------------------- inputs
def answers_of(trace: str | Path) -> list[tuple[int, list[bool]]]:
    """The answers a traced server served: (prompt length, routed flag per token), in the order they ended."""
    out = []
    for line in Path(trace).read_text().splitlines():
        record = json.loads(line)
        if "answer" in record:
            out.append((record["answer"]["prompt"], [bool(r) for r in record["answer"]["routed"]]))
    return out


def synthetic(answers: list[tuple[int, list[bool]]], p: float, seed: int = 0) -> list[tuple[int, list[bool]]]:
    """The same prompt and answer lengths, each token routed with probability ``p`` (a forced share)."""
    rng = random.Random(seed)
    return [(prompt, [rng.random() < p for _ in routed]) for prompt, routed in answers]


def cpu_costs(path: str | Path = "benchmarks/results/forward_costs.json", step: float = 2e-3) -> Costs:
    """This CPU's measured grids (``benchmarks/forward_costs.py``) and a host cost per step."""
    data = json.loads(Path(path).read_text())
    grids = {role: {tuple(int(x) for x in key.split("x")): t for key, t in data["reads"][role].items()}
             for role in ("slm", "llm")}
    router = data["router"]
    ks = sorted(int(k) for k in router)
    slope = (router[str(ks[-1])] - router[str(ks[0])]) / max(ks[-1] - ks[0], 1)
    return Costs(slm=grids["slm"], llm=grids["llm"], router=(router[str(ks[0])] - slope * ks[0], slope), step=step,
                 name=f"this CPU ({data['conditions']['dtype']}, 1 thread, benchmarks/forward_costs.py)")


def llm_alone(answers, concurrency: int, costs: Costs) -> float:
    """Tokens/s of the LLM alone served the same way: every token the LLM's, no SLM, no router."""
    everything = [(prompt, [True] * len(routed)) for prompt, routed in answers]
    free = Costs(slm=(0.0, 0.0, 0.0), llm=costs.llm, router=(0.0, 0.0), step=costs.step)
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
                        "(benchmarks/host_ops.py, the device check's serving phase); default: the cost model's 0.1 ms")
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
            policy = WaitPolicy(tuple(run["policy"]["min_rows"]), run["policy"]["max_wait"])
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
    for costs in (captured, cpu):  # 3. the LLM's forward reading the other rows too: what would it change?
        for c in (8, 16):
            answers = routings["p = 0.1, 256 tokens"]
            writers, everyone = (simulate(answers, c, default_policy("cuda", 16), costs, catch_up_all=a)["tokens_per_s"]
                                 for a in (False, True))
            out.setdefault("catch_up_all", []).append({"machine": costs.name, "concurrency": c,
                                                       "writers_only_tokens_per_s": writers,
                                                       "every_row_tokens_per_s": everyone})
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
    lines += ["", "| machine | concurrency | LLM reads the writers only (tokens/s) | every row's unread tokens too |",
              "|---|---|---|---|"]
    for c in out.get("catch_up_all", []):
        lines.append(f"| {c['machine']} | {c['concurrency']} | {c['writers_only_tokens_per_s']:.1f} | "
                     f"{c['every_row_tokens_per_s']:.1f} |")
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
