"""The cost model fitted on a device check's grid alone (``benchmarks/serving/calibrated.grid_costs``) and checked
against the same check's served loads (``grid_check``), on a synthetic check JSON whose costs are known."""

import copy

import pytest

from benchmarks.serving.calibrated import grid_check, grid_costs
from benchmarks.serving.cost_model import Costs, simulate, synthetic
from r2r_hf.core.layouts.packed import tokens_buckets
from r2r_hf.core.policy import WaitPolicy, default_policy, speculative_policy

PLAN = {"prompt": 16, "headline": 0.1, "serve": [4, 8, 8], "long_users": 2, "agreement": 0.876, "speculate": 4}
ROWS, GS = (1, 2, 4, 8, 16), (1, 8, 16, 32, 64)


def slm(k, g):  # seconds: linear in rows x tokens, so the grid's linear interpolation is exact
    return 2e-3 + 1e-5 * k * g


def padded(k, g):
    return 19e-3 + 1e-4 * k * g


def packed(t):
    return 19e-3 + 1.2e-4 * t


def router(k):
    return 2e-4 + 2e-5 * k


def topk(k):
    return 5e-5 + 1e-5 * k


HOST = 1e-3


def _grid() -> dict:
    ms = lambda t, **shape: {**shape, "ms": 1e3 * t, "replays": 20}  # noqa: E731
    return {"grid_slm": {f"{k}x{g}": ms(slm(k, g), rows=k, tokens=g) for k in (1, 8, 16) for g in (1, 64)},
            "grid_llm_padded": {f"{k}x{g}": ms(padded(k, g), rows=k, tokens=g) for k in ROWS for g in GS},
            "grid_llm_packed": {str(t): ms(packed(t), rows=min(t, 16), tokens=t, width=t) for t in tokens_buckets(1024)},
            "grid_router": {str(k): ms(router(k), rows=k) for k in (1, 8, 16)},
            "grid_topk": {str(k): ms(topk(k), rows=k) for k in (1, 8, 16)},
            "grid_host": {str(k): {"rows": k, "host_ms_per_step": 1e3 * HOST} for k in (8, 16)}}


def _truth() -> dict[str, Costs]:
    dense = lambda f: {(k, g): f(k, g) for k in range(1, 17) for g in range(1, 65)}  # noqa: E731
    pack = {(1, t): packed(t) for t in tokens_buckets(4096)}
    r2r = Costs(slm=dense(slm), llm=pack, router=(router(0), router(1) - router(0)), step=HOST, packed=True,
                captured_shapes=True)
    alone = Costs(slm=dense(padded), llm={key: 0.0 for key in pack}, router=(topk(0), topk(1) - topk(0)), step=HOST,
                  packed=True, captured_shapes=True)  # (each prompt read once, by the LLM in the SLM's place)
    return {"r2r": r2r, "alone": alone}


def _served(truth: dict) -> dict:
    """Served loads whose tokens/s are the replay of the true costs (what a device would measure if the model
    were right), with junk in every other served field: none of it may reach the fit."""
    def run(c, requests, tokens, costs, routed, wait, slots, **extra):
        answers = (synthetic([(16, [False] * tokens)] * requests, 0.1, agreement=0.876) if routed
                   else [(16, [False] * tokens)] * requests)
        got = simulate(answers, c, wait, costs, slots)["tokens_per_s"]
        return {"concurrency": c, "requests": requests, "tokens": requests * tokens, "tokens_per_s": got,
                "ms_per_step": 1e6, "outside_graphs_ms_per_step": 1e6, **extra}

    r2r, alone = truth["r2r"], truth["alone"]
    return {"R2R, waiting": [run(c, 2 * c, 16, r2r, True, default_policy("cuda", 8), 8, policy="waiting")
                             for c in (4, 8, 8)],
            "LLM alone": [run(c, 2 * c, 16, alone, False, WaitPolicy(), 8, policy="waiting") for c in (4, 8, 8)],
            "ratios": [{"concurrency": 4, "r2r_over_llm_alone": 9.9}],
            "R2R, waiting, long": [run(2, 2, 48, r2r, True, default_policy("cuda", 2), 2, policy="waiting")],
            "R2R, speculative (oracle)": [run(c, 2 * c, 32, r2r, True, speculative_policy("cuda", 8, 4), 8,
                                              policy="speculative", speculate=4) for c in (4, 8)]}


def test_the_fit_from_a_grid_alone_replays_what_its_costs_imply():
    data = {"plan": PLAN, **_grid(), "serving": _served(_truth())}
    result = grid_check(data)
    assert result["outside"] == [] and len(result["against_served"]) == 9
    assert all(r["fitted_over_measured"] == pytest.approx(1.0, rel=1e-6) for r in result["against_served"])
    assert result["costs"]["router_ms"] == pytest.approx([1e3 * router(0), 1e3 * (router(1) - router(0))])
    costs = grid_costs(data)
    assert costs["r2r"].forward("llm", 5, 24) == pytest.approx(packed(24)), "a packed read by its total tokens"
    assert costs["alone"].forward("slm", 4, 8) == pytest.approx(padded(4, 8))


def test_a_served_run_the_grid_does_not_explain_is_named():
    data = {"plan": PLAN, **_grid(), "serving": _served(_truth())}
    off = copy.deepcopy(data)
    off["serving"]["R2R, waiting"][1]["tokens_per_s"] *= 1.3  # the device served faster than its parts add up to
    result = grid_check(off)
    assert result["outside"] == ["R2R, waiting at 8 (run 1): 0.77x"]
    for field in ("ms_per_step", "outside_graphs_ms_per_step"):  # the served runs' own timings are not inputs
        junk = copy.deepcopy(data)
        for runs in junk["serving"].values():
            for r in runs if isinstance(runs, list) else []:
                r[field] = 0.001
        assert grid_check(junk)["against_served"] == grid_check(data)["against_served"]


def test_a_grid_missing_a_section_is_refused_by_name():
    data = {"plan": PLAN, **_grid(), "serving": {}}
    del data["grid_host"]
    with pytest.raises(ValueError, match="grid_host"):
        grid_costs(data)


def test_the_committed_predictions_are_the_first_runs_costs_for_the_second_runs_plan():
    # benchmarks/results/gpu_check.md ("Predicted") tables these: they must be what the first run's costs give for
    # every number the device's plan measures (a plan or cost-model change without them fails here).
    import json
    from dataclasses import asdict
    from pathlib import Path

    from benchmarks.gpu.plan import DEVICE
    from benchmarks.serving.calibrated import predict_second

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    first, fused = (json.loads((results / name).read_text()) for name in ("gpu_check.json", "gpu_check_rerun.json"))
    fresh = json.loads(json.dumps(predict_second(first, fused, asdict(DEVICE))))
    assert fresh == json.loads((results / "gpu_second_predicted.json").read_text())
    assert set(fresh["grid"]["llm_padded"]) == {f"{k}x{g}" for k in DEVICE.grid_rows for g in DEVICE.grid_tokens}
    assert len(fresh["served"]) == 2 * len(DEVICE.serve) + 1 + len(DEVICE.spec_users)


def test_a_router_folded_into_the_slms_reads_is_not_priced_twice():
    # Where the server folds the router into the SLM's reads (grid_slots.folded), the grid's SLM points carry its time:
    # the router's own graph, measured beside them, is no cost of the step.
    data = {"plan": PLAN, **_grid(), "serving": {}}
    assert grid_costs(data)["r2r"].router == pytest.approx((router(0), router(1) - router(0)))
    data["grid_slots"] = {"folded": True}
    assert grid_costs(data)["r2r"].router == (0.0, 0.0)
