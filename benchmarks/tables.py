"""Markdown tables from the benchmark JSON files (pasted into docs/ so numbers are never retyped).

    python -m benchmarks.tables speed [benchmarks/results/speed.json]
    python -m benchmarks.tables gpu [benchmarks/results/gpu_check.json]    # the GPU check (benchmarks/gpu/check.py)
    python -m benchmarks.tables humaneval [benchmarks/results/humaneval.json]
    python -m benchmarks.tables equal-rate benchmarks/results/humaneval-TAG.json   # R2R vs entropy/random per rate
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu.ratios import ms


def _f(value, fmt: str = ".2f") -> str:
    return "—" if value is None else format(value, fmt)


def speed_tables(results: dict) -> str:
    lines = []
    for batch, row in results["batches"].items():
        base, comps = row["baselines_ms"], row["components_ms"]
        parts = comps.get("captured", comps["eager"])
        kind = "captured" if "captured" in comps else "eager"
        lines.append(
            f"**Batch {batch}**{' (rows routed independently)' if row.get('per_row') else ''}. Components ({kind}): "
            f"t_SLM {parts['t_slm']:.2f} ms, t_router {parts['t_router']:.2f} ms, t_LLM(g) for g = 1 / 8 / 64: "
            f"{parts['t_llm']['1']:.1f} / {parts['t_llm'].get('8', parts['t_llm'].get('10', 0)):.1f} / "
            f"{parts['t_llm']['64']:.1f} ms"
            + (f" (eager: t_SLM {comps['eager']['t_slm']:.1f} ms, t_LLM(1) {comps['eager']['t_llm']['1']:.1f} ms)"
               if kind == "captured" else "") + ". "
            + ", ".join(f"`{name.replace('_', '.generate ', 1)}` {ms:.2f} ms/token" for name, ms in base.items()
                        if name != "assisted")
            + (f", assisted generation {base['assisted']:.1f} ms/token" if "assisted" in base else "") + "."
            + "".join(f" Warm-up: {name.replace('_', ' ')} {sec:.1f} s." for name, sec in row.get("warmup_s", {}).items())
            + "".join(f" Note: {name}: {text}." for name, text in row.get("notes", {}).items()) + "\n")
        vs = "llm_compiled" if "llm_compiled" in base else "llm_eager"
        if vs == "llm_compiled":
            lines.append("| p | P(LLM call) | ms / step | tokens/s | vs `llm.generate` (compiled) | "
                         "vs `llm.generate` (eager) | eager R2R vs eager LLM | ideal ms / step | loop efficiency |")
            lines.append("|---|---|---|---|---|---|---|---|---|")
        else:  # an eager run (the CPU default): one speed-up column
            lines.append("| p | P(LLM call) | ms / step | tokens/s | vs `llm.generate` | ideal ms / step | loop efficiency |")
            lines.append("|---|---|---|---|---|---|---|")
        for r in row["r2r"]:
            eager = (f" {r[f'speedup_vs_{vs}']:.2f}x | {r['speedup_vs_llm_eager']:.2f}x | "
                     f"{_f(r.get('eager_speedup_vs_llm_eager'))}{'x' if 'eager_speedup_vs_llm_eager' in r else ''} |"
                     if vs == "llm_compiled" else f" {r['speedup_vs_llm_eager']:.2f}x |")
            lines.append(f"| {r['p']:.2f} | {r['p_llm_call']:.2f} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} |"
                         f"{eager} {r['ideal_ms']:.2f} | {r['loop_efficiency']:.2f} |")
        by_p = {r["p"]: r for r in row["r2r"]}
        slm = base.get("slm_compiled", base["slm_eager"])
        ratios = []
        if 0.0 in by_p:
            ratios.append(f"never-route / `slm.generate` ({'compiled' if 'slm_compiled' in base else 'eager'}) = "
                          f"{by_p[0.0]['ms_per_step'] / slm:.3f}")
        if 1.0 in by_p and vs == "llm_eager":  # the loop's overhead when the LLM writes every token
            ratios.append(f"always-route / (`llm.generate` + `slm.generate`) = "
                          f"{by_p[1.0]['ms_per_step'] / (base['llm_eager'] + base['slm_eager']):.3f}")
        if ratios:
            lines.append("\n" + "; ".join(ratios) + "\n")
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


def _p(value: float) -> str:
    return "< 0.001" if value < 0.001 else format(value, ".3f" if value < 0.01 else ".2f")


def equal_rate_table(results: dict) -> str:
    """R2R against the entropy and random routers point by point (same target rate), then summed over the points."""
    lines = ["| target rate | R2R passed (rate) | entropy passed (rate) | R2R only / entropy only | McNemar p | "
             "random passed (rate) | R2R only / random only | McNemar p |", "|---|---|---|---|---|---|---|---|"]

    def cells(point: dict, kind: str) -> str:
        other = point.get(kind)
        if other is None:
            return "— | — | —"
        return (f"{other['passed']} ({other['llm_token_rate']:.1%}) | {other['r2r_only']} / {other['other_only']} | "
                f"{_p(other['p_value'])}")

    for point in results["equal_rate_points"]:
        r2r = point["r2r"]
        lines.append(f"| {point['rate']:.0%} | {r2r['passed']} ({r2r['llm_token_rate']:.1%}) | {cells(point, 'entropy')} | "
                     f"{cells(point, 'random')} |")
    # Summed per baseline: each sum runs over the points where that baseline was run.
    for kind, t in results["summed_over_points"].items():
        other = f"{t['other_passed']} | {t['r2r_only']} / {t['other_only']} | {_p(t['p_value'])}"
        blank = "— | — | —"
        lines.append(f"| summed over {t['points']} point{'s' if t['points'] > 1 else ''} | {t['r2r_passed']} | "
                     f"{other if kind == 'entropy' else blank} | {other if kind == 'random' else blank} |")
    return "\n".join(lines)


def gpu_tables(results: dict) -> str:
    """The GPU check (benchmarks/gpu/check.py): R2R captured per batch and share, with what was measured beside it."""
    c, lines = results.get("conditions", {}), []
    lines.append(f"{c.get('hardware')}, torch {c.get('torch')}, transformers {c.get('transformers')}, "
                 f"graphs: {c.get('graphs')}; {results['plan']['slm']} + {results['plan']['llm']}, "
                 f"{results['plan']['dtype']}, prompt {results['plan']['prompt']}, {results['plan']['tokens']} new "
                 "tokens, greedy.\n")
    head = results.get("headline")
    if head:  # the pair the device is lent for, in one process, both on graphs of fused reads
        lines.append(f"**Headline** (batch 1, p = {head['p']}): R2R {head['r2r_ms_per_token']:.2f} ms/token against the "
                     f"LLM alone on fused graphs {head['llm_fused_ms_per_token']:.2f}: **{head['speedup']:.2f}x** "
                     f"(fused: {head['fused']}).\n")
    for batch, runs in results.get("r2r_captured", {}).items():
        model = {r["p"]: r for r in results.get("cost_model", {}).get(batch, [])}
        speed = results.get("speedups", {}).get(batch, {})
        parts = results.get("components_ms", {}).get(batch, {}).get("captured")
        base = {k: ms(results.get(f"{k}_ms", {}).get(batch))
                for k in ("llm_fused", "llm_graphs", "slm_fused", "llm_eager", "slm_eager")}
        compiled = results.get("llm_compiled_ms", {}).get(batch)
        bits = [f"{k.replace('_', ' ')} {v:.2f} ms/token" for k, v in base.items() if isinstance(v, (int, float))]
        if isinstance(compiled, dict) and "ms_per_token" in compiled:
            bits.append(f"llm compiled {compiled['ms_per_token']:.2f} ms/token (first call {compiled['first_call_s']:.0f} s)")
        never = results.get("never_route_over_slm_fused", {}).get(batch)
        if never is not None:
            bits.append(f"never-route / the SLM on fused graphs {never:.3f}")
        if parts:
            bits.append(f"captured t_SLM {parts['t_slm']:.2f} ms, t_router {parts['t_router']:.2f} ms, "
                        f"t_LLM(1 / 8 / 64) {parts['t_llm']['1']:.2f} / {parts['t_llm']['8']:.2f} / "
                        f"{parts['t_llm']['64']:.2f} ms")
        lines.append(f"**Batch {batch}**{' (rows routed independently)' if int(batch) > 1 else ''}. " + "; ".join(bits)
                     + ".\n")
        lines.append("| p | P(LLM call) | first call (s) | ms / token | tokens/s | vs LLM on fused graphs | vs LLM on "
                     "graphs | vs eager LLM | vs compiled LLM | ideal ms | loop efficiency |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            key, m = str(r["p"]), model.get(r["p"], {})
            vs = [speed.get(k, {}).get(key) for k in ("llm_fused", "llm_graphs", "llm_eager", "llm_compiled")]
            lines.append(f"| {r['p']:.2f} | {r['p_llm_call']:.2f} | {r['first_call_s']:.1f} | {r['ms_per_token']:.2f} | "
                         f"{r['tokens_per_s']:.1f} | " + " | ".join("—" if v is None else f"{v:.2f}x" for v in vs)
                         + f" | {_f(m.get('ideal_ms'))} | {_f(m.get('loop_efficiency'))} |")
        lines.append("")
    agreement = results.get("agreement")
    if agreement:
        lines.append("Teacher-forced agreement, captured vs eager ({dtype}): ".format(**agreement) + "; ".join(
            f"{role}: largest |Δlogit| {a['max_abs']:.3g} ({a['max_rel']:.2%} of the step's largest logit), argmax "
            f"equal on {a['argmax']:.1%} of {a['steps']} steps" for role, a in agreement.items() if role in ("slm", "llm")))
    lines += serving_lines(results.get("serving") or {})
    for item in results.get("fallbacks") or []:  # a fused read that did not compile, a model left unfused...
        lines.append(f"\nFallback in `{item['phase']}`: {item['message'][:300]}")
    status = (results.get("llm_compiled_ms") or {}).get("status")
    if status:
        lines.append(f"\nCompiled `llm.generate`: {status}.")
    lines += second_run_lines(results, _predicted() if results["plan"].get("device") == "cuda" else {})
    errors = results.get("errors") or {}  # each phase runs under its own guard: what failed is said, not lost
    if errors:
        lines.append("\nPhases that did not complete: " + "; ".join(
            f"`{name}` ({e['type']}: {e['message'][:160]})" for name, e in errors.items()) + ".")
    return "\n".join(lines)


def serving_lines(serving: dict) -> list[str]:
    """The serving phase: tokens/s, ms per step and the time outside the graphs per step, per server and
    concurrency, and R2R over the LLM alone."""
    rows = [f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['ms_per_step']:.2f} | "
            f"{_f(r.get('outside_graphs_ms_per_step'))} | {r['llm_token_rate']:.3f} |"
            for name, server in serving.items() if isinstance(server, dict) and "runs" in server
            for r in server["runs"]]
    if not rows:
        return []
    ratios = serving.get("ratios") or {}
    return ["", "| server | concurrency | tokens/s | ms / step | outside the graphs, ms / step | LLM token share |",
            "|---|---|---|---|---|---|", *rows, "",
            "R2R over the LLM alone, served: " + ", ".join(f"{v:.2f}x at {c}" for c, v in ratios.items()) + "."]


# What the first device run's costs predict for the second run's numbers (calibrated.py --predict-second): the device's
# plan only (a dry run's tiny shapes have no prediction).
PREDICTED = Path("benchmarks/results/gpu_second_predicted.json")


def _predicted() -> dict:
    return json.loads(PREDICTED.read_text()) if PREDICTED.is_file() else {}


def _ms(point: dict | None, predicted: float | None = None) -> str:
    """A grid point's median ms, and what the first run's costs predicted for it beside it."""
    got = "—" if point is None else f"{point['ms']:.2f}"
    return got if predicted is None else f"{got} ({predicted:.1f})"


def second_run_lines(results: dict, predicted: dict) -> list[str]:
    """The second device run's sections (issue 51): the cost grid, the served loads, the fused LLM against eager, the
    SLM's kernels and the fit; predictions (the first run's costs) in parentheses where there are any."""
    if not any(k.startswith("grid_") or k in ("server_start", "exact", "kernels", "fit") for k in results):
        return []
    plan, guess = results["plan"], predicted.get("grid", {})
    lines = ["", f"**The cost grid** (the engine's captured steps, {plan['grid_replays']} event-timed replays each: "
             "median ms; in parentheses what the first run's costs predict):", ""]
    grid = lambda name: results.get(f"grid_{name}", {})  # noqa: E731
    for name, rows, cols in (("llm_padded", plan["grid_rows"], plan["grid_tokens"]),
                             ("llm_verify", plan["verify_rows"], plan["verify_tokens"]),
                             ("slm", plan["slm_rows"], plan["slm_tokens"])):
        lines += [f"| {name}: rows \\ tokens | " + " | ".join(map(str, cols)) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(_ms(grid(name).get(f"{k}x{g}"), guess.get(name, {}).get(f"{k}x{g}"))
                                          for g in cols) + " |" for k in rows] + [""]
    packed = grid("llm_packed")
    lines.append("LLM packed reads by total tokens: " + ", ".join(
        f"{t}: {_ms(v, guess.get('llm_packed', {}).get(t))}" for t, v in packed.items()) + ".")
    lines.append("Long span: " + ", ".join(f"{k} at {v['span']} columns {_ms(v)}" for k, v in grid("llm_long").items())
                 + "; router graph / top-k alone by rows: " + ", ".join(
                     f"{k}: {_ms(v, guess.get('router', {}).get(k))} / {_ms(grid('topk').get(k))}"
                     for k, v in grid("router").items())
                 + "; host per step: " + ", ".join(f"{k} rows {v['host_ms_per_step']:.2f} ms"
                                                   for k, v in grid("host").items()) + ".")
    return lines + served_lines(results, predicted) + check_lines(results)


def served_lines(results: dict, predicted: dict) -> list[str]:
    """Every served load (tokens/s, ms per step, outside the graphs, ITL), the ratios, the largest reads."""
    guess = {}
    for row in predicted.get("served", []):
        guess.setdefault((row["server"], row["concurrency"]), row["tokens_per_s"])
    serving = results.get("serving") or {}
    lines = ["", "| server | users | tokens/s (predicted) | ms / step | outside the graphs, ms / step | "
             "ITL p50 / p95 ms | LLM token share | oracle |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in serving.items():
        for r in runs if name != "ratios" else []:
            want = guess.get((name, r["concurrency"]))
            lines.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.1f} ({_f(want, '.0f')}) | "
                         f"{r['ms_per_step']:.2f} | {_f(r.get('outside_graphs_ms_per_step'))} | "
                         f"{_f(r.get('itl_p50_ms'), '.1f')} / {_f(r.get('itl_p95_ms'), '.1f')} | "
                         f"{r['llm_token_rate']:.3f} | {r.get('oracle', {}).get('agreement', '—')} |")
    ratios = serving.get("ratios") or []
    if ratios:
        lines += ["", "R2R over the LLM alone, served: " + ", ".join(
            f"{r['r2r_over_llm_alone']:.2f}x at {r['concurrency']}" for r in ratios) + "."]
    runs = serving.get("R2R, waiting") or []
    if runs:  # the largest load's reads: where its step goes
        lines += ["", f"Reads of R2R at {runs[-1]['concurrency']} users (largest total first):", "",
                  "| role | kind | rows | tokens | bucket | span | reads | ms mean | ms total |", "|---" * 9 + "|"]
        lines += [f"| {h['role']} | {h['kind']} | {h['rows']} | {h['tokens']} | {h['bucket']} | {h['span']} | "
                  f"{h['reads']} | {h['ms_mean']:.2f} | {h['ms_total']:.1f} |" for h in runs[-1].get("reads", [])[:12]]
    return lines


def check_lines(results: dict) -> list[str]:
    """The fused LLM against eager, the SLM's kernels, the fit, the peers."""
    lines = []
    exact = (results.get("exact") or {}).get("llm")
    if exact:
        lines.append("\nFused LLM against its eager forward, teacher-forced: argmax equal at "
                     f"{exact['argmax_equal']:.2%} of {exact['positions']} positions; largest difference "
                     f"{exact['max_rel']:.2%} of the position's "
                     f"largest logit (tolerance {_f(exact.get('tolerance'), '.3f')}).")
    for rows, k in (results.get("kernels") or {}).items():
        for path in ("captured", "without a graph"):
            if path in k:
                t = k[path]
                lines.append(f"\nSLM step, {rows} rows, {path}: {t['kernels_per_step']:.0f} {t['what']} per step, "
                             f"{t['kernel_ms_per_step']:.3f} ms of kernels in {t['wall_ms_per_step']:.3f} ms; "
                             "costliest: " + ", ".join(f"{x['name'][:60]} {x['us_per_step']:.0f} us"
                                                       for x in t["top"][:5]) + ".")
    fit = results.get("fit")
    if fit:
        lines += ["", "| fitted on the grid: server | users | measured tokens/s | fitted | fitted / measured |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['server']} | {r['concurrency']} | {r['measured_tokens_per_s']:.1f} | "
                  f"{r['fitted_tokens_per_s']:.1f} | {r['fitted_over_measured']:.2f} |" for r in fit["against_served"]]
        lines.append("\nOutside 15 %: " + ("; ".join(fit["outside"]) or "none") + ".")
    for row in results.get("hf_generate_batch") or []:
        lines.append(f"\nHF generate_batch: {row}")
    return lines


TABLES = {"speed": speed_tables, "humaneval": humaneval_table, "equal-rate": equal_rate_table, "gpu": gpu_tables}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", nargs="?", default="speed",
                        help=f"{', '.join(TABLES)} (speed_*: another speed run, read from its own file)")
    parser.add_argument("path", nargs="?", help="the JSON file (default: benchmarks/results/KIND.json)")
    args = parser.parse_args(argv)
    kind = "speed" if args.kind.startswith("speed") else args.kind
    if kind not in TABLES:
        parser.error(f"no table of kind {args.kind!r}; choose one of {', '.join(TABLES)}")
    path = Path(args.path or f"benchmarks/results/{'gpu_check' if kind == 'gpu' else args.kind}.json")
    if not path.is_file():
        parser.error(f"{path} does not exist; run the benchmark that writes it, or name the file")
    print(TABLES[kind](json.loads(path.read_text())))


if __name__ == "__main__":
    main()
