"""The device check's derived numbers, from what its JSON holds so far (no torch: the merge after the compiled
child recomputes them too)."""

from __future__ import annotations

# R2R's denominators, fairest first: the LLM alone on graphs of fused reads (what R2R's own LLM reads replay), on
# graphs of HF's forward, eager, and HF's compiled ``llm.generate`` (a fresh process, compiled.py).
BASELINES = ("llm_fused", "llm_graphs", "llm_eager", "llm_compiled")


def ms(value) -> float | None:
    """ms per token from an entry (a number, or a dict holding ``ms_per_token``)."""
    value = value.get("ms_per_token") if isinstance(value, dict) else value
    return value if isinstance(value, (int, float)) else None


def ratios(data: dict) -> dict:
    """Sections to write: R2R's speed-up per batch, share and baseline; the headline pair; never-route over the SLM
    alone; fusing's gain for R2R and for the LLM alone."""
    found, never, runs_by_batch = {}, {}, data.get("r2r_captured", {})
    for batch, runs in runs_by_batch.items():
        for name in BASELINES:
            base = ms(data.get(f"{name}_ms", {}).get(batch))
            if base is not None:
                found.setdefault(batch, {})[name] = {str(r["p"]): base / r["ms_per_token"] for r in runs}
        slm = ms(data.get("slm_fused_ms", {}).get(batch))
        zero = [r["ms_per_token"] for r in runs if r["p"] == 0.0]
        if slm and zero:  # the docs' target: within 1.10x
            never[batch] = zero[0] / slm
    out = {"speedups": found, "never_route_over_slm_fused": never}
    share = data.get("plan", {}).get("headline")
    fused = [r for r in runs_by_batch.get("1", []) if r["p"] == share]
    alone = data.get("llm_fused_ms", {}).get("1")
    if fused and ms(alone):  # the pair the device is lent for: both on graphs of fused reads, in one process
        out["headline"] = {"p": share, "r2r_ms_per_token": fused[0]["ms_per_token"], "llm_fused_ms_per_token": ms(alone),
                           "speedup": ms(alone) / fused[0]["ms_per_token"],
                           "fused": {"r2r": data.get("fused", {}).get("1"),
                                     "llm": alone.get("fused") if isinstance(alone, dict) else None}}
    unfused = data.get("r2r_unfused_ms", {}).get("1")
    if unfused and fused:  # issue 32: the fused graphs' gain over HF's forward captured
        out["fused_over_unfused"] = {"r2r": unfused["ms_per_token"] / fused[0]["ms_per_token"]}
        graphs = ms(data.get("llm_graphs_ms", {}).get("1"))
        if graphs and ms(alone):
            out["fused_over_unfused"]["llm"] = graphs / ms(alone)
    return out
