"""The LLM budget on HumanEval: ``budget@P`` (llm_budget=P, spent online) against ``r2r@P`` (a threshold placed
offline to route P of the tokens), on the tasks both have answered.

    python -m benchmarks.budget_report --tag code-divergent-fp32 --against code-divergent --rates 0.04,0.08,0.15

For each rate: pass@1 of both on the shared tasks with the exact McNemar test, each budget answer's realised LLM
share (mean, max), and the cap re-checked from the positions the LLM wrote (``routed_positions``): at every
routed position t (1-based) the answer had fewer than P * t LLM tokens before it. Writes
``benchmarks/results/humaneval-budget.json`` and prints the markdown table of docs/results.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.humaneval_report import mcnemar_exact
from benchmarks.humaneval_results import RESULTS, read_rows, system_path

EPS = 1e-9  # as core/budget.py: b * t is compared with whole counts


def cap_violations(row: dict, share: float) -> int:
    """Routed positions at which the answer already held P * t LLM tokens or more (0 when the budget held)."""
    bad = 0
    for before, position in enumerate(sorted(row.get("routed_positions", []))):
        if not before < share * (position + 1) - EPS:
            bad += 1
    return bad


def point(rate: float, tag: str, against: str) -> dict | None:
    budget = read_rows(system_path(f"budget@{rate}", tag))
    r2r = read_rows(system_path(f"r2r@{rate}", against))
    shared = sorted(set(budget) & set(r2r))
    if not shared:
        return None
    passed = lambda rows: {t: rows[t]["status"] == "passed" for t in shared}  # noqa: E731
    b, r = passed(budget), passed(r2r)
    shares = [budget[t]["routed_tokens"] / max(budget[t]["generated_tokens"], 1) for t in shared]
    rate_of = lambda rows: sum(rows[t]["routed_tokens"] for t in shared) / sum(rows[t]["generated_tokens"] for t in shared)  # noqa: E731
    only_budget, only_r2r = sum(b[t] and not r[t] for t in shared), sum(r[t] and not b[t] for t in shared)
    alone = {kind: read_rows(system_path(kind, "")) for kind in ("slm", "llm")}  # the models alone, same tasks
    return {
        **{f"{kind}_passed": sum(rows[t]["status"] == "passed" for t in shared) if set(shared) <= set(rows) else None
           for kind, rows in alone.items()},
        "rate": rate, "tasks": len(shared), "budget_passed": sum(b.values()), "r2r_passed": sum(r.values()),
        "r2r_threshold": r2r[shared[0]]["threshold"], "budget_llm_token_rate": rate_of(budget),
        "r2r_llm_token_rate": rate_of(r2r), "budget_answer_share_mean": sum(shares) / len(shares),
        "budget_answer_share_max": max(shares), "cap_violations": sum(cap_violations(budget[t], rate) for t in shared),
        "budget_only": only_budget, "r2r_only": only_r2r, "p_value": mcnemar_exact(only_budget, only_r2r),
    }


def table(points: list[dict]) -> str:
    lines = ["| P | tasks | SLM / LLM alone pass | budget@P pass | r2r@P pass | McNemar p | budget LLM share: all / mean "
             "/ max answer | r2r@P LLM share | cap broken |", "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['rate']:.0%} | {p['tasks']} | {p['slm_passed']} / {p['llm_passed']} | {p['budget_passed']} | "
                     f"{p['r2r_passed']} | "
                     f"{p['p_value']:.2f} | {p['budget_llm_token_rate']:.1%} / {p['budget_answer_share_mean']:.1%} / "
                     f"{p['budget_answer_share_max']:.1%} | {p['r2r_llm_token_rate']:.1%} | {p['cap_violations']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default="code-divergent-fp32", help="where the budget@P answers are")
    parser.add_argument("--against", default="code-divergent", help="where the r2r@P answers are")
    parser.add_argument("--rates", default="0.04,0.08,0.15")
    parser.add_argument("--out", default=str(RESULTS / "humaneval-budget.json"))
    args = parser.parse_args(argv)
    points = [p for p in (point(float(r), args.tag, args.against) for r in args.rates.split(",")) if p]
    Path(args.out).write_text(json.dumps({"budget_from": args.tag, "r2r_from": args.against, "points": points},
                                         indent=1))
    print(table(points))


if __name__ == "__main__":
    main()
