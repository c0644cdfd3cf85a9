"""The device check (``benchmarks/gpu/check.sh``), rehearsed on this CPU: its runner, its order, its isolation, its
warm phase and its compiled child (tiny shapes, emulated CUDA graphs)."""

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


def _written(data: dict, phase: str):
    """The number a phase of benchmarks/gpu/check.py writes (None if it wrote nothing)."""
    if phase in ("conditions", "agreement", "serving", "warm"):
        return data.get(phase)
    if phase == "build":
        return data.get("fused_check")
    if phase == "compiled_llm":
        return data.get("llm_compiled_ms", {}).get("1", {}).get("ms_per_token")
    name, batch = phase.rsplit("_", 1)
    runs = data.get("r2r_captured", {}).get(batch, [])
    if name == "r2r_fused":  # the headline share at batch 1, every share above
        return [r["p"] for r in runs] if runs else None
    if name == "r2r_shares":
        return [r for r in runs if r["p"] != data["plan"]["headline"]] or None
    return data.get({"components": "components_ms"}.get(name, f"{name}_ms"), {}).get(batch)


@pytest.mark.compile  # the regions and the compiled child's LLM compile with inductor (~1-2 minutes on a CPU)
def test_gpu_check_dry_run_keeps_the_headline_when_the_warm_phase_fails(tmp_path):
    # The whole device script, as CI rehearses it, with the warm phase failing (it compiles every region; a first CUDA
    # run's likeliest failure): the headline pair right after it still writes its numbers (its calls compile what
    # they meet), and so does every later phase; the failure is in the JSON.
    from benchmarks.gpu.plan import DRY_RUN
    from benchmarks.gpu.check import names

    env = {**os.environ, "GPU_CHECK_TESTS": "0", "PYTHON": sys.executable, "OUT": str(tmp_path),
           "GPU_CHECK_FAIL_PHASE": "warm"}
    done = subprocess.run(["bash", "benchmarks/gpu/check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=480)  # the script's steps: 330 + 110 + the merge
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 1, "a failed phase fails the check"
    assert set(data["errors"]) == {"warm"}, (data["errors"], "phase seconds:", data["phase_s"])
    assert data["errors"]["warm"]["type"] == "InjectedFailure" and data["errors"]["warm"]["traceback"]
    phases = names(DRY_RUN)
    assert phases[:5] == ["conditions", "build", "warm", "r2r_fused_1", "llm_fused_1"], "the headline pair right after"
    ran = [t["step"] for t in data["timeline"] if t["step"] in phases]
    assert ran == phases[:-1], "in this order, the compiled child after them all (a step of its own)"
    assert set(data["phase_s"]) == set(phases), "every phase ran"
    assert [p for p in phases[3:] if not _written(data, p)] == [], "every phase after warm wrote its numbers"
    headline = data["headline"]
    assert headline["p"] == 0.1 and headline["speedup"] > 0
    assert headline["fused"] == {"r2r": {"slm": True, "llm": True}, "llm": True}, "both on fused reads"
    assert data["compiles"]["r2r_fused_1"] > 0, "without warm, the headline's calls compiled their regions"
    assert all(c["problem"] is None and c["max_rel"] <= c["tolerance"] for c in data["fused_check"].values())
    assert "fallbacks" not in data, data.get("fallbacks")
    assert data["r2r_router_ms"]["1"]["router"] == {"folded": True, "dtype": "torch.bfloat16"}
    speculating = data["r2r_speculative_ms"]["1"]["counters"]
    assert speculating["speculative_agreed"] + speculating["speculative_rejected"] > 0, "it speculated"
    served = data["serving"]
    assert list(served) == ["R2R, waiting", "LLM alone", "ratios", "R2R, m = 1", "R2R, speculative (worst case)"]
    assert set(served["ratios"]) == {str(c) for c in DRY_RUN.serve}
    alone = served["LLM alone"]["runs"]
    assert [r["concurrency"] for r in alone] == list(DRY_RUN.serve) and all(r["llm_token_rate"] == 0 for r in alone)
    assert all(r["outside_graphs_ms_per_step"] > 0 for s in ("R2R, waiting", "LLM alone") for r in served[s]["runs"])
    assert data["llm_compiled_ms"]["status"] == "finished"
    assert set(data["speedups"]["1"]) == {"llm_fused", "llm_graphs", "llm_eager", "llm_compiled"}
    assert set(data["speedups"]["8"]) == {"llm_fused", "llm_eager"}, "no compiled baseline at batch 8"
    assert set(data["never_route_over_slm_fused"]) == {"1"}
    assert all(r["loop_efficiency"] > 0 for b in ("1", "8") for r in data["cost_model"][b])
    from benchmarks.tables import gpu_tables

    assert "`warm` (InjectedFailure" in gpu_tables(data) and "Headline" in gpu_tables(data)


def test_the_warm_phase_compiles_every_shape_class_the_timed_phases_meet(tmp_path, monkeypatch):
    # What the order is for: after `warm`, no timed phase compiles. Dynamo's guards decide what recompiles, whatever
    # backend it hands the graphs to, so the regions compile with its eager backend here (seconds, not minutes).
    from benchmarks.gpu import phases as ph
    from benchmarks.gpu.plan import DRY_RUN
    from benchmarks.gpu.runner import Report
    from r2r_hf.core.fast import fused

    monkeypatch.setattr(fused, "REGION_OPTIONS", {"backend": "eager", "dynamic": None, "fullgraph": True})
    plan, report = DRY_RUN, Report(tmp_path / "check.json", {"headline": 0.1})
    torch.set_num_threads(1)
    gen = dict(max_new_tokens=plan.tokens, min_new_tokens=plan.tokens, do_sample=False, pad_token_id=0)
    model = ph.build(plan, report)
    prompts = {b: torch.randint(0, 1000, (b, plan.prompt), generator=torch.Generator().manual_seed(b)) for b in (1, 2, 8)}
    with torch.no_grad():
        ph.warm(model, plan, prompts, gen, report)
        assert report.data["warm"]["1"]["compiles"] == 12 and report.data["warm"]["2"]["compiles"] == 12, \
            "3 regions x 2 models x (one token | a piece) per rows class"
        before = ph.compiles()
        ph.r2r_shares(model, plan, 1, prompts[1], gen, report, plan.shares)
        for role in ("llm", "slm"):
            ph.alone(model, role, plan, 1, prompts[1], report, fused=True)
        ph.r2r_router(model, plan, prompts[1], gen, report)
        ph.speculative(model, plan, prompts[1], gen, report)
        ph.bf16_agreement(model, plan, report)
        ph.r2r_shares(model, plan, 8, prompts[8], gen, report, (0.1,))
        ph.components(model, plan, 8, prompts[8], gen, report)
        ph.alone(model, "llm", plan, 8, prompts[8], report, fused=True)
    assert ph.compiles() == before, "a timed phase compiled a region"
    assert report.data["fused"] == {"1": {"slm": True, "llm": True}, "8": {"slm": True, "llm": True}}


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
