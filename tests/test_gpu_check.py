"""The device check (``benchmarks/gpu/check.sh``), rehearsed on this CPU: its runner, its order, its isolation, its
warm-up phases, its grid and served phases, and its peers' child (tiny shapes, emulated CUDA graphs)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_phases_fail_alone(tmp_path):
    # The runner on its own, in a second: an exception, a timeout (also one a library's `except Exception` would
    # swallow), a phase that needs a failed one, an injected failure and a broken process each cost their phase only.
    from benchmarks.gpu.runner import Phase, Report, run_phases

    report, ran = Report(tmp_path / "check.json", {}), []

    def stubborn() -> None:  # swallows every Exception, as some library code does
        for _ in range(100):
            try:
                time.sleep(0.1)
            except Exception:  # noqa: BLE001, S110 - what the PhaseTimeout must get through
                pass

    def boom() -> None:
        raise ValueError("shape mismatch")

    phases = [Phase("a", 5, lambda: ran.append("a")), Phase("b", 5, boom), Phase("c", 5, lambda: ran.append("c"), ("b",)),
              Phase("d", 0.3, lambda: time.sleep(10)), Phase("e", 0.3, stubborn), Phase("f", 5, lambda: ran.append("f")),
              Phase("g", 5, lambda: ran.append("g")), Phase("h", 5, lambda: ran.append("h"))]
    start = time.monotonic()
    run_phases(phases, report, until_s=60, fail="g", recover=lambda: "broken" if "g" in report.errors else None)
    assert time.monotonic() - start < 10, "the timeouts interrupted their phases"
    assert ran == ["a", "f"]
    errors = json.loads((tmp_path / "check.json").read_text())["errors"]
    assert {k: e["type"] for k, e in errors.items()} == {"b": "ValueError", "c": "Skipped", "d": "PhaseTimeout",
                                                          "e": "PhaseTimeout", "g": "InjectedFailure", "h": "Skipped"}
    assert errors["b"]["message"] == "shape mismatch" and any("boom" in line for line in errors["b"]["traceback"])
    assert "needs b" in errors["c"]["message"] and errors["h"]["message"] == "broken"
    assert "time.sleep(10)" in "".join(errors["d"]["traceback"]), "the tail says where the time went"


def test_a_phase_due_by_a_time_ends_there_and_warnings_are_kept_with_their_phase(tmp_path):
    # The warm phase must end by the headline's time whatever its budget; a fallback logged by r2r_hf (only a log line
    # otherwise) lands in the JSON under the phase that logged it.
    import logging

    from benchmarks.gpu.runner import Fallbacks, Phase, Report, run_phases

    report = Report(tmp_path / "check.json", {})
    warn = lambda: logging.getLogger("r2r_hf.core.fused_reads").warning("R2R captures X's HF forward: why")  # noqa
    with Fallbacks(report).attached():
        run_phases([Phase("warm", 30, lambda: time.sleep(5), by_s=1.2), Phase("next", 5, warn),
                    Phase("late", 5, lambda: None, by_s=1.2)], report, until_s=60)
    assert report.errors["warm"]["type"] == "PhaseTimeout" and report.data["phase_s"]["warm"] < 2.5
    # a phase that starts past its own end is skipped (not run for a moment and failed, which frees the device)
    assert report.errors["late"]["type"] == "Skipped" and "late" not in report.data.get("phase_s", {})
    assert report.data["fallbacks"] == [{"phase": "next", "logger": "r2r_hf.core.fused_reads",
                                         "message": "R2R captures X's HF forward: why"}]


def test_a_grid_point_that_cannot_run_costs_its_point_only(tmp_path):
    # One kind of read failing (say the LLM's packed reads, where the LLM could not be fused) must not lose the grid's
    # other points: each runs under its own guard, the phase fails once they all ran, and says which.
    from types import SimpleNamespace

    from benchmarks.gpu.grid import Point
    from benchmarks.gpu.runner import Report
    from benchmarks.gpu.slot_phases import each_point, failed

    def broken():
        raise RuntimeError("the LLM's reads are not packed here")

    points = [Point("slm", "1x1", {}, lambda: 1), Point("llm_packed", "8", {}, broken),
              Point("router", "1", {}, lambda: 2)]
    report, ran = Report(tmp_path / "check.json", {}), []
    each_point(SimpleNamespace(points=lambda: points), report, lambda point: ran.append(point.call()))
    assert ran == [1, 2] and list(report.data["grid_errors"]) == ["llm_packed 8"]
    with pytest.raises(RuntimeError, match="1 grid point.*llm_packed 8.*not packed"):
        failed(report)


def _written(data: dict, phase: str):
    """The number a phase of benchmarks/gpu/check.py writes (None if it wrote nothing)."""
    served = data.get("serving", {})
    found = {"conditions": data.get("conditions"), "build": data.get("fused_check"), "warm": data.get("warm"),
             "r2r_fused_1": data.get("r2r_captured", {}).get("1"), "llm_fused_1": data.get("llm_fused_ms", {}).get("1"),
             "warm_grid": data.get("warm", {}).get("grid"), "warm_servers": data.get("server_start"),
             "grid": data.get("grid_host"), "serving": served.get("ratios"), "long": served.get("R2R, waiting, long"),
             "speculative": served.get("R2R, speculative (oracle)"),
             "r2r_speculative_1": data.get("r2r_speculative_ms", {}).get("1"), "exact": data.get("exact"),
             "kernels": data.get("kernels"), "fit": data.get("fit"), "hf_generate_batch": data.get("hf_generate_batch"),
             "compiled_llm": data.get("llm_compiled_ms", {}).get("1", {}).get("ms_per_token")}
    return found[phase]


def _grid_is_whole(data: dict, plan) -> None:
    from benchmarks.gpu.grid import server_columns
    from r2r_hf.core.fast.fused import attended
    from r2r_hf.core.layouts.packed import tokens_buckets

    def keys(rows, tokens):
        return {f"{k}x{g}" for k in rows for g in tokens}

    assert set(data["grid_llm_padded"]) == keys(plan.grid_rows, plan.grid_tokens)
    assert set(data["grid_llm_packed"]) == {str(t) for t in tokens_buckets(max(plan.serve) * plan.grid_tokens[-1])}
    assert set(data["grid_llm_verify"]) == keys(plan.verify_rows, plan.verify_tokens)
    assert all(v["kept"] == v["tokens"] for v in data["grid_llm_verify"].values()), "every position's logits"
    assert len(data["grid_llm_long"]) == 3 and {v["span"] for v in data["grid_llm_long"].values()} == {
        attended(plan.long_span, server_columns(plan)[1])}, "on the long answers' slots"
    assert set(data["grid_slm"]) == keys(plan.slm_rows, plan.slm_tokens)
    assert set(data["grid_router"]) == set(data["grid_topk"]) == {str(k) for k in plan.slm_rows}
    assert all(v["replays"] == plan.grid_replays for s in ("llm_padded", "slm") for v in data[f"grid_{s}"].values())
    assert set(data["grid_host"]) == {str(k) for k in plan.host_rows}


def _served_as_planned(served: dict, plan) -> None:
    assert list(served) == ["R2R, waiting", "LLM alone", "ratios", "R2R, waiting, long", "R2R, speculative (oracle)",
                            "R2R, lossless (oracle)"]
    assert [r["concurrency"] for r in served["R2R, waiting"]] == list(plan.serve) == [
        r["concurrency"] for r in served["LLM alone"]] == [r["concurrency"] for r in served["ratios"]]
    assert all(r["llm_token_rate"] == 0 for r in served["LLM alone"])
    for run in served["R2R, waiting"]:
        seen = {(h["role"], h["kind"]) for h in run["reads"]}
        assert {("slm", "step"), ("slm", "prefill"), ("llm", "catch-up")} <= seen, seen
        assert all(h["role"] != "unlabelled" for h in run["reads"]), "every replay belongs to a read"
        assert run["outside_graphs_ms_per_step"] > 0 and "prefill" in run["host_stages_ms_per_step"]
    long = served["R2R, waiting, long"][0]
    assert long["tokens"] == plan.long_users * plan.long_tokens
    for run in served["R2R, speculative (oracle)"] + served["R2R, lossless (oracle)"]:
        assert run["oracle"]["agreement"] == plan.agreement and "not R2R's" in run["oracle"]["note"]
        assert run["counters_total"]["speculative_agreed"] > 0 and run["resolution"]["resolutions"] > 0
    assert served["R2R, lossless (oracle)"][0]["llm_token_rate"] > 0.99, "threshold 0: every token the LLM's"


@pytest.mark.compile  # the compiled child's LLM compiles with inductor (seconds on a CPU)
def test_gpu_check_dry_run_keeps_every_phase_when_its_warm_ups_fail(tmp_path):
    # The whole device script, as CI rehearses it, with both warm-ups that compile failing (a first CUDA run's likeliest
    # failure): the headline pair after `warm` and the grid after `warm_grid` compile what they need themselves, and
    # every later phase still writes its numbers. After their own warm-ups (`warm_servers`, the grid phase) the timed
    # phases compile nothing: dynamo's guards decide that, the same here (its eager backend) as with inductor.
    from benchmarks.gpu.check import names
    from benchmarks.gpu.plan import DRY_RUN as plan

    env = {**os.environ, "GPU_CHECK_TESTS": "0", "PYTHON": sys.executable, "OUT": str(tmp_path),
           "GPU_CHECK_FAIL_PHASE": "warm,warm_grid"}
    done = subprocess.run(["bash", "benchmarks/gpu/check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=480)  # the script's steps: 330 + 110 + the merge
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 1, "a failed phase fails the check"
    assert set(data["errors"]) == {"warm", "warm_grid"}, (data["errors"], "phase seconds:", data["phase_s"])
    assert all(e["type"] == "InjectedFailure" and e["traceback"] for e in data["errors"].values())
    phases = names(plan)
    assert phases[:5] == ["conditions", "build", "warm", "r2r_fused_1", "llm_fused_1"], "the headline pair right after"
    ran = [t["step"] for t in data["timeline"] if t["step"] in phases]
    assert ran == phases[:-2], "in this order, the peers' child after them all (a step of its own)"
    assert set(data["phase_s"]) == set(phases), "every phase ran"
    assert [p for p in phases if p not in data["errors"] and not _written(data, p)] == [], "each wrote its numbers"
    compiled = {name: n for name, n in data["compiles"].items() if n}
    assert compiled.keys() <= {"build", "warm_servers", "r2r_fused_1", "llm_fused_1", "grid"} and compiled.get(
        "r2r_fused_1") and compiled.get("grid"), compiled
    headline = data["headline"]
    assert headline["p"] == 0.1 and headline["speedup"] > 0
    assert headline["fused"] == {"r2r": {"slm": True, "llm": True}, "llm": True}, "both on fused reads"
    assert all(c["problem"] is None and c["max_rel"] <= c["tolerance"] for c in data["fused_check"].values())
    assert "fallbacks" not in data, data.get("fallbacks")
    _grid_is_whole(data, plan)
    assert all(s["capture"]["fused"] == {"slm": True, "llm": True} and s["capture"]["packed"]
               for s in data["server_start"].values()), "every server on fused reads, the LLM's packed"
    _served_as_planned(data["serving"], plan)
    assert data["grid_slots"]["folded"] and data["server_start"]["R2R"]["capture"]["folded"], \
        "the router folded into the SLM's reads, in the grid as in the server"
    speculating = data["r2r_speculative_ms"]["1"]
    assert speculating["oracle"]["agreement"] == plan.agreement and speculating["counters"]["speculative_agreed"] > 0
    assert data["exact"]["llm"]["positions"] == plan.exact_rows * plan.exact_length
    assert {k: v["captured"]["kernels_per_step"] > 0 for k, v in data["kernels"].items()} == {
        str(k): True for k in plan.profile_rows}
    assert len(data["fit"]["against_served"]) == 2 * len(plan.serve) + 1 + len(plan.spec_users) + 1  # (+ lossless)
    assert data["llm_compiled_ms"]["status"] == "finished"
    assert data["hf_generate_batch"][0]["status"].startswith("not run in the dry run")
    from benchmarks.tables import gpu_tables

    tables = gpu_tables(data)
    assert "`warm` (InjectedFailure" in tables and "Headline" in tables and "The cost grid" in tables


def test_the_warm_phase_compiles_every_shape_class_the_timed_generate_phases_meet(tmp_path, monkeypatch):
    # What the order is for: after `warm`, the headline pair and batch-1 speculation compile nothing. Dynamo's guards
    # decide what recompiles, whatever backend it hands the graphs to, so the regions compile with its eager backend.
    from benchmarks.gpu import phases as ph
    from benchmarks.gpu.plan import DRY_RUN
    from benchmarks.gpu.runner import Report
    from r2r_hf.core.fast import fused

    monkeypatch.setattr(fused, "REGION_OPTIONS", {"backend": "eager", "dynamic": None, "fullgraph": True})
    plan, report = DRY_RUN, Report(tmp_path / "check.json", {"headline": 0.1})
    torch.set_num_threads(1)
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0)
    model = ph.build(plan, report)
    prompt = torch.randint(0, 1000, (1, plan.prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ph.warm(model, plan, prompt, gen, report)
        assert report.data["warm"]["1"]["compiles"] == 12, "3 regions x 2 models x (one token | a piece), one row"
        before = ph.compiles()
        ph.r2r_shares(model, plan, 1, prompt, gen, report, (0.0, 0.1, 0.2))
        ph.alone(model, "llm", plan, 1, prompt, report, fused=True)
        ph.speculative(model, plan, prompt, gen, report)
    assert ph.compiles() == before, "a timed phase compiled a region"
    assert report.data["fused"] == {"1": {"slm": True, "llm": True}}


def test_gpu_check_child_failure_is_reported_with_its_traceback(tmp_path):
    # The compiled baseline is a step of its own: its exception comes back through its JSON, merged with a status.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GPU_CHECK_FAIL_PHASE": "compiled_llm"}
    (tmp_path / "gpu_check.json").write_text(json.dumps({"plan": {"headline": 0.1}, "timeline": [], "errors": {},
                                                         "phase_s": {}}))
    child = subprocess.run([sys.executable, "-m", "benchmarks.gpu.compiled", "--out", str(tmp_path), "--dry-run"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert child.returncode == 1
    from benchmarks.gpu.compiled import merge

    data = merge(tmp_path, child.returncode, 110)
    error = data["errors"]["compiled_llm"]
    assert error["type"] == "InjectedFailure" and any("compiled_llm" in line for line in error["traceback"])
    assert data["llm_compiled_ms"]["status"].startswith("InjectedFailure")
    assert data["hf_generate_batch"][0]["status"].startswith("not run"), "the first peer, merged with it"
    (tmp_path / "killed").mkdir()  # a child killed by the step's timeout wrote nothing: the status says so
    cut = merge(tmp_path / "killed", 124, 110)
    assert cut["llm_compiled_ms"]["status"] == "cut at the step's timeout of 110 s"
    assert cut["errors"]["compiled_llm"]["type"] == "PhaseTimeout"
    skipped = merge(tmp_path / "killed", -1, 0)  # check.sh left it under 30 s: not started
    assert skipped["llm_compiled_ms"]["status"].startswith("not run") and skipped["errors"]["compiled_llm"]["type"] == \
        "Skipped"


def test_gpu_check_refuses_an_unknown_fail_phase(tmp_path):
    from benchmarks.gpu.check import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--dry-run", "--fail-phase", "r2r_captured"])
