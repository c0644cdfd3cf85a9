"""Markdown tables from the benchmark JSON files (pasted into docs/ so numbers are never retyped).

    python -m benchmarks.tables speed [benchmarks/results/speed.json]
    python -m benchmarks.tables humaneval [benchmarks/results/humaneval.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def speed_tables(results: dict) -> str:
    lines = []
    for batch, row in results["batches"].items():
        c = row["components_ms"]
        lines.append(f"**Batch {batch}.** t_SLM {c['t_slm']:.1f} ms, t_router {c['t_router']:.1f} ms, "
                     f"t_LLM(g) for g = 1 / 10 / 64: {c['t_llm']['1']:.1f} / {c['t_llm']['10']:.1f} / "
                     f"{c['t_llm']['64']:.1f} ms. `slm.generate` {row['slm_generate_ms']:.1f} ms/step, "
                     f"`llm.generate` {row['llm_generate_ms']:.1f} ms/step"
                     + (f", assisted generation {row['assisted_ms']:.1f} ms/token ({row['assisted_speedup']:.2f}x LLM)"
                        if "assisted_ms" in row else "") + ".\n")
        lines.append("| p | P(LLM call) | ms / step | tokens/s | speed-up vs LLM-only | ideal ms / step | loop efficiency |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in row["r2r"]:
            lines.append(f"| {r['p']:.2f} | {r['p_llm_call']:.2f} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.2f} | "
                         f"{r['speedup_vs_llm']:.2f}x | {r['ideal_ms']:.1f} | {r['loop_efficiency']:.2f} |")
        lines.append(f"\nnever-route / `slm.generate` = {row['never_route_vs_slm_generate']:.3f}; always-route / "
                     f"(`llm.generate` + `slm.generate`) = {row['always_route_vs_llm_plus_slm']:.3f}\n")
    return "\n".join(lines)


def humaneval_table(results: dict) -> str:
    lines = ["| system | pass@1 | 95% CI | LLM token rate | generated tokens | avg. active params | tokens/s | agrees with LLM |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["results"]:
        tps = f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "—"
        agree = f"{r['agree_with_llm']:.1%}" if r.get("agree_with_llm") is not None else "—"
        lines.append(f"| {r['name']} | {r['pass_at_1']:.1%} | {r['ci95'][0]:.1%}–{r['ci95'][1]:.1%} | "
                     f"{r['llm_token_rate']:.1%} | {r['generated_tokens']} | {r['avg_activated_params'] / 1e9:.2f}B | "
                     f"{tps} | {agree} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    kind = argv[0] if argv else "speed"
    path = Path(argv[1]) if len(argv) > 1 else Path(f"benchmarks/results/{kind}.json")
    data = json.loads(path.read_text())
    print(speed_tables(data) if kind == "speed" else humaneval_table(data))


if __name__ == "__main__":
    main()
