"""Plot pass@1 against LLM token rate from a HumanEval report (one curve per router kind).

    python -m benchmarks.quality.plot_results [--results benchmarks/results/humaneval-TAG.json] \
        [--out docs/img/humaneval.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot(results: dict, out: str, xmax: float = 1.03) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=150)

    def kind(system: str) -> str:
        # r2r@0.08, r2r-low, r2r (calibrated) are all points of one R2R curve; likewise entropy@P, random@P.
        return system.split("@")[0].removesuffix("-low").removesuffix("-high")

    # Zoomed in on low rates, LLM-only (rate 1) is off the axis: a dashed line marks its pass@1 instead.
    zoomed = xmax < 1
    ends = [r for r in rows if r["system"] == "slm" or (r["system"] == "llm" and not zoomed)]
    styles = {"r2r": dict(fmt="o", color="#e07b24", label="R2R (trained router)"),
              "entropy": dict(fmt="^", color="#2a9d8f", label="entropy router"),
              "random": dict(fmt="v", color="#999", label="random router")}
    for name, style in styles.items():
        points = sorted((r for r in rows if kind(r["system"]) == name), key=lambda r: r["llm_token_rate"])
        if not points:
            continue
        curve = sorted(points + (ends if name != "random" else []), key=lambda r: r["llm_token_rate"])
        ax.plot([r["llm_token_rate"] for r in curve], [r["pass_at_1"] for r in curve], "-", color=style["color"], lw=1.2)
        for i, row in enumerate(points):
            low, high = row["ci95"]
            calibrated = row["system"] == "r2r"
            ax.errorbar(row["llm_token_rate"], row["pass_at_1"], capsize=3, ms=8 if calibrated else 5,
                        yerr=[[row["pass_at_1"] - low], [high - row["pass_at_1"]]],
                        **{**style, "label": style["label"] if i == 0 else None})
            if calibrated:
                ax.annotate("calibrated", (row["llm_token_rate"], row["pass_at_1"]), fontsize=6,
                            xytext=(4, -10), textcoords="offset points")
    for row, color, label in ((r, c, t) for r in ends for s, c, t in
                              (("slm", "#4a7bd0", "SLM only (0.5B)"), ("llm", "#222", "LLM only (1.5B)"))
                              if r["system"] == s):
        low, high = row["ci95"]
        ax.errorbar(row["llm_token_rate"], row["pass_at_1"], fmt="s", color=color, capsize=3, label=label,
                    yerr=[[row["pass_at_1"] - low], [high - row["pass_at_1"]]])
    for row in (r for r in rows if r["system"] == "llm" and zoomed):
        ax.axhline(row["pass_at_1"], ls="--", color="#222", lw=1, label="LLM only (1.5B), rate 1")
    ax.set_xlabel("LLM token rate (share of tokens written by the 1.5B)")
    ax.set_ylabel("HumanEval pass@1 (95% bootstrap CI)")
    ax.set_xlim(-0.03 * xmax, xmax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("Qwen2.5-Coder 0.5B + 1.5B, greedy, CPU", fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="benchmarks/results/humaneval.json")
    parser.add_argument("--xmax", type=float, default=1.03, help="right end of the x axis (zoom on low rates)")
    parser.add_argument("--out", default="docs/img/humaneval.png")
    args = parser.parse_args(argv)
    plot(json.loads(Path(args.results).read_text()), args.out, args.xmax)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
