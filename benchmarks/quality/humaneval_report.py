"""The HumanEval report: each system's pass@1, LLM token rate and speed, and R2R against the entropy
and random routers at equal rates, point by point, with exact McNemar tests.

    python -m benchmarks.quality.humaneval --report --tag NAME     # -> benchmarks/results/humaneval-NAME.json
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.quality.humaneval_results import RESULTS, bootstrap_ci, parse_system, read_rows, system_path

TASKS = 164


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for b and c discordant pairs (a binomial test of b against n = b + c, p = 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def system_row(system: str, rows: dict[str, dict], params: dict, timing: dict, llm_pass: dict[str, bool]) -> dict:
    """One system's numbers from its per-task answers."""
    passed = [1.0 if r["status"] == "passed" else 0.0 for r in rows.values()]
    generated = sum(r["generated_tokens"] for r in rows.values())
    routed = sum(r["routed_tokens"] for r in rows.values())
    threshold = next(iter(rows.values())).get("threshold")
    return {
        "name": system if threshold is None else f"{system} (threshold {threshold:.3g})",
        "system": system,
        "threshold": threshold,
        "passed": int(sum(passed)),
        "pass_at_1": sum(passed) / len(passed),
        "ci95": bootstrap_ci(passed),
        "llm_token_rate": routed / generated,
        "generated_tokens": generated,
        "avg_activated_params": ((generated - routed) * params["slm"] + routed * params["llm"]) / generated,
        "tokens_per_s": timing.get(system, {}).get("tokens_per_s"),
        "agree_with_llm": (sum((r["status"] == "passed") == llm_pass[t] for t, r in rows.items()) / len(rows))
        if len(llm_pass) == TASKS else None,
        "statuses": {s: sum(r["status"] == s for r in rows.values()) for s in ("passed", "failed", "timeout", "crashed")},
    }


def compare(r2r: dict[str, dict], other: dict[str, dict]) -> dict:
    """Discordant tasks of R2R against another router and the exact McNemar p-value."""
    only_r2r = sorted(t for t in r2r if r2r[t]["status"] == "passed" and other[t]["status"] != "passed")
    only_other = sorted(t for t in r2r if r2r[t]["status"] != "passed" and other[t]["status"] == "passed")
    return {"r2r_only": len(only_r2r), "other_only": len(only_other),
            "p_value": mcnemar_exact(len(only_r2r), len(only_other)), "r2r_only_tasks": only_r2r,
            "other_only_tasks": only_other}


def report(tag: str, systems: list[str], conditions: dict) -> dict:
    """Aggregate the per-task files of ``systems`` (and the timing file) into ``humaneval-TAG.json``."""
    rows = {s: read_rows(system_path(s, tag)) for s in systems}
    complete = {s: r for s, r in rows.items() if len(r) == TASKS}
    timing_path = RESULTS / f"humaneval_timing-{tag}.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    params = json.loads((RESULTS / "humaneval" / "params.json").read_text())
    llm_pass = {t: r["status"] == "passed" for t, r in complete.get("llm", {}).items()}
    entries = [system_row(s, r, params, timing, llm_pass) for s, r in complete.items()]
    points = []
    for rate in sorted({parse_system(s)[1] for s in complete if parse_system(s)[1] is not None}):
        r2r = complete.get(f"r2r@{rate}")
        if r2r is None:
            continue
        point = {"rate": rate, "r2r": system_row(f"r2r@{rate}", r2r, params, timing, llm_pass)}
        for kind in ("entropy", "random"):
            other = complete.get(f"{kind}@{rate}")
            if other is not None:
                point[kind] = {**system_row(f"{kind}@{rate}", other, params, timing, llm_pass), **compare(r2r, other)}
        points.append(point)
    totals = {}
    for kind in ("entropy", "random"):
        paired = [p for p in points if kind in p]
        if paired:
            b, c = sum(p[kind]["r2r_only"] for p in paired), sum(p[kind]["other_only"] for p in paired)
            totals[kind] = {"points": len(paired), "r2r_passed": sum(p["r2r"]["passed"] for p in paired),
                            "other_passed": sum(p[kind]["passed"] for p in paired), "r2r_only": b, "other_only": c,
                            "p_value": mcnemar_exact(b, c)}
    slm, llm = complete.get("slm"), complete.get("llm")
    gap = None
    if slm and llm:
        base, top = (sum(r["status"] == "passed" for r in x.values()) for x in (slm, llm))
        gap = {"slm_passed": base, "llm_passed": top, "recovered": {
            s: (e["passed"] - base) / (top - base) if top != base else None for s, e in
            ((e["system"], e) for e in entries) if s not in ("slm", "llm")}}
    out = {"benchmark": f"HumanEval ({TASKS} tasks)", "router": tag, "conditions": conditions, "results": entries,
           "equal_rate_points": points, "summed_over_points": totals, "gap": gap}
    Path(RESULTS / f"humaneval-{tag}.json").write_text(json.dumps(out, indent=1))
    return out
