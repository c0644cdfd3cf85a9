"""Plot pass@1 against LLM token rate from benchmarks/results/humaneval.json.

    python -m benchmarks.plot_results [--out docs/img/humaneval.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(results: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["system"]: r for r in results["results"]}
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=150)

    def point(row, **style):
        low, high = row["ci95"]
        ax.errorbar(row["llm_token_rate"], row["pass_at_1"], yerr=[[row["pass_at_1"] - low], [high - row["pass_at_1"]]],
                    capsize=3, **style)

    curve = sorted((rows[s] for s in ("slm", "r2r-low", "r2r", "r2r-high", "llm") if s in rows),
                   key=lambda r: r["llm_token_rate"])
    ax.plot([r["llm_token_rate"] for r in curve], [r["pass_at_1"] for r in curve], "-", color="#e07b24", lw=1.5,
            label="R2R (thresholds), from SLM-only to LLM-only")
    for name, style in (("slm", dict(fmt="s", color="#4a7bd0", label="SLM only (0.5B)")),
                        ("llm", dict(fmt="s", color="#222", label="LLM only (1.5B)")),
                        ("r2r", dict(fmt="o", color="#e07b24", ms=8, label="R2R, calibrated threshold")),
                        ("r2r-low", dict(fmt="o", color="#e07b24", ms=5)),
                        ("r2r-high", dict(fmt="o", color="#e07b24", ms=5)),
                        ("entropy", dict(fmt="^", color="#2a9d8f", ms=7, label="entropy router (calibrated to R2R's rate)")),
                        ("random", dict(fmt="v", color="#999", ms=7, label="random router (calibrated to R2R's rate)"))):
        if name in rows:
            point(rows[name], **style)
    ax.set_xlabel("LLM token rate (share of tokens written by the 1.5B)")
    ax.set_ylabel("HumanEval pass@1 (95% bootstrap CI)")
    ax.set_xlim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Qwen2.5-Coder 0.5B + 1.5B, greedy, CPU", fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="benchmarks/results/humaneval.json")
    parser.add_argument("--out", default="docs/img/humaneval.png")
    args = parser.parse_args(argv)
    plot(json.loads(Path(args.results).read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
