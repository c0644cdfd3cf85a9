"""The LLM budget on HumanEval: ``budget@P`` (llm_budget=P, spent online) against ``r2r@P`` (a threshold placed
offline to route P of the tokens), on the tasks both have answered.

    python -m benchmarks.quality.budget_report --tag code-divergent-fp32 --against code-divergent --rates 0.04,0.08,0.15

For each rate: pass@1 of both on the shared tasks with the exact McNemar test (and, where ``r2r@P`` has also run
under the budget's tag, against that one: same dtype, same conditions), each budget answer's realised LLM
share (mean, max), and the cap re-checked from the positions the LLM wrote (``routed_positions``): at every
routed position t (1-based) the answer had fewer than P * t LLM tokens before it. Writes
``benchmarks/results/humaneval-budget.json`` and prints the markdown table of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.quality.humaneval_report import mcnemar_exact
from benchmarks.quality.humaneval_results import RESULTS, read_rows, system_path
from r2r_hf.core.budget import cap



def cap_violations(row: dict, share: float) -> int:
    """Routed positions at which the answer already held P * t LLM tokens or more (0 when the budget held)."""
    bad = 0
    for before, position in enumerate(sorted(row.get("routed_positions", []))):
        if not before < cap(share, position + 1):
            bad += 1
    return bad


def _against(budget: dict, other: dict, shared: list[str]) -> dict:
    """pass@1 of another system on the shared tasks, its LLM share and threshold, and McNemar against the budget."""
    passed = lambda rows: {t: rows[t]["status"] == "passed" for t in shared}  # noqa: E731
    b, o = passed(budget), passed(other)
    only_budget, only_other = sum(b[t] and not o[t] for t in shared), sum(o[t] and not b[t] for t in shared)
    return {"passed": sum(o.values()), "threshold": other[shared[0]]["threshold"],
            "llm_token_rate": _rate(other, shared), "budget_only": only_budget, "other_only": only_other,
            "p_value": mcnemar_exact(only_budget, only_other)}


def _rate(rows: dict, tasks: list[str]) -> float:
    return sum(rows[t]["routed_tokens"] for t in tasks) / max(sum(rows[t]["generated_tokens"] for t in tasks), 1)


def point(rate: float, tag: str, against: str) -> dict | None:
    """One rate: budget@P (from ``tag``) against r2r@P from ``against`` and, where it has run, from ``tag`` too.

    The second comparison has the budget's own conditions (dtype), so it separates the dtype from the rule.
    """
    budget = read_rows(system_path(f"budget@{rate}", tag))
    r2r = read_rows(system_path(f"r2r@{rate}", against))
    shared = sorted(set(budget) & set(r2r))
    if not shared:
        return None
    same = read_rows(system_path(f"r2r@{rate}", tag)) if tag != against else {}
    shares = [budget[t]["routed_tokens"] / max(budget[t]["generated_tokens"], 1) for t in shared]
    alone = {kind: read_rows(system_path(kind, "")) for kind in ("slm", "llm")}  # the models alone, same tasks
    return {
        **{f"{kind}_passed": sum(rows[t]["status"] == "passed" for t in shared) if set(shared) <= set(rows) else None
           for kind, rows in alone.items()},
        "rate": rate, "tasks": len(shared), "budget_passed": sum(budget[t]["status"] == "passed" for t in shared),
        "budget_llm_token_rate": _rate(budget, shared), "budget_answer_share_mean": sum(shares) / len(shares),
        "budget_answer_share_max": max(shares), "cap_violations": sum(cap_violations(budget[t], rate) for t in shared),
        "r2r": _against(budget, r2r, shared),
        "r2r_same_conditions": _against(budget, same, shared) if set(shared) <= set(same) else None,
    }


def summed(points: list[dict], against: str) -> dict | None:
    """Both systems' passes and discordant tasks summed over the points (each point's tasks count once per point)."""
    runs = [p[against] for p in points]
    if not runs or any(r is None for r in runs):
        return None
    only_budget, only_other = sum(r["budget_only"] for r in runs), sum(r["other_only"] for r in runs)
    return {"points": len(runs), "budget_passed": sum(p["budget_passed"] for p in points),
            "other_passed": sum(r["passed"] for r in runs), "budget_only": only_budget, "other_only": only_other,
            "p_value": mcnemar_exact(only_budget, only_other)}


def table(points: list[dict]) -> str:
    """The markdown table of docs/results.md (one row per rate)."""
    lines = ["| P | tasks | SLM / LLM alone | budget@P pass | r2r@P pass (p) | r2r@P, budget's dtype (p) | budget LLM "
             "share: all / mean / max answer | r2r@P LLM share (budget's dtype) | cap broken |", "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        same = p["r2r_same_conditions"]
        same_text = f"{same['passed']} ({same['p_value']:.2f})" if same else "—"
        same_rate = f" ({same['llm_token_rate']:.1%})" if same else ""
        lines.append(f"| {p['rate']:.0%} | {p['tasks']} | {p['slm_passed']} / {p['llm_passed']} | {p['budget_passed']} | "
                     f"{p['r2r']['passed']} ({p['r2r']['p_value']:.2f}) | {same_text} | "
                     f"{p['budget_llm_token_rate']:.1%} / {p['budget_answer_share_mean']:.1%} / "
                     f"{p['budget_answer_share_max']:.1%} | {p['r2r']['llm_token_rate']:.1%}{same_rate} | {p['cap_violations']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default="code-divergent-fp32", help="where the budget@P answers are")
    parser.add_argument("--against", default="code-divergent", help="where the r2r@P answers are")
    parser.add_argument("--rates", default="0.04,0.08,0.15")
    parser.add_argument("--out", default=str(RESULTS / "humaneval-budget.json"))
    args = parser.parse_args(argv)
    points = [p for p in (point(float(r), args.tag, args.against) for r in args.rates.split(",")) if p]
    totals = {kind: summed(points, kind) for kind in ("r2r", "r2r_same_conditions")}
    Path(args.out).write_text(json.dumps({"budget_from": args.tag, "r2r_from": args.against, "points": points,
                                          "summed": totals}, indent=1))
    print(table(points))
    for kind, total in totals.items():
        if total:
            print(f"summed over {total['points']} points, budget against {kind}: {total['budget_passed']} against "
                  f"{total['other_passed']}, {total['budget_only']} / {total['other_only']} discordant, "
                  f"McNemar p = {total['p_value']:.2f}")


if __name__ == "__main__":
    main()
