"""HumanEval + MBPP+ as one benchmark: MBPP+ graded EvalPlus's way, batches planned once and answered whole on a
resume, thresholds placed on answers (never on outcomes), R2R paired with entropy by an exact McNemar test."""

import json

import pytest

from benchmarks.quality import code_tasks
from benchmarks.quality.suites import MBPP_PLUS, Task, first_assertion

needs_mbpp = pytest.mark.skipif(not MBPP_PLUS.exists(), reason="MBPP+ is not beside the repository")


def fake_task(task_id, suite="mbpp+"):
    return Task(task_id, suite, ({"role": "user", "content": task_id},), {})


def test_batches_hold_every_task_once_in_order_of_length():
    tasks = [fake_task(f"T/{i}") for i in range(19)]
    lengths = {f"T/{i}": (i * 7) % 11 for i in range(19)}
    batches = code_tasks.plan_batches(tasks, lengths, 8)
    flat = [t for b in batches for t in b]
    assert sorted(flat) == sorted(lengths) and [len(b) for b in batches] == [8, 8, 3]
    assert [lengths[t] for t in flat] == sorted(lengths[t] for t in flat)


@needs_mbpp
def test_mbpp_plus_is_graded_on_every_input_with_evalplus_shapes_and_oracles():
    from benchmarks.quality.suites import mbpp_tasks

    tasks = {t.task_id: t for t in mbpp_tasks()}
    assert len(tasks) == 399
    shared = tasks["Mbpp/2"]  # tuples as arguments; outputs compared as sets
    assert "similar_elements((3, 4, 5, 6),(5, 7, 4, 10))" in shared.messages[0]["content"]
    assert shared.grade("def similar_elements(a, b):\n    return tuple(set(a) & set(b))[::-1]").passed
    assert not shared.grade("def similar_elements(a, b):\n    return tuple(a)").passed
    assert shared.grade("def similar_elements(a, b):\n    return a + b").status == "failed"  # tuples, not lists
    match = tasks["Mbpp/737"]  # a regular expression's match object: only whether it matched counts
    assert match.grade(match.source["canonical_solution"]).passed
    assert first_assertion("\nassert f(1) == 2\nassert f(2) == 3\n") == "assert f(1) == 2"


class FakeRunner:
    """Answers as the real runner does, recording the batches it was asked."""

    def __init__(self):
        self.asked = []

    def generate(self, system, problems, threshold):
        self.asked.append([p.task_id for p in problems])
        return [{"answer": "```python\nx = 1\n```", "generated_tokens": 10, "routed_tokens": 0} for _ in problems]


def test_a_resumed_run_answers_its_unfinished_batch_whole_and_writes_only_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(code_tasks, "RESULTS", tmp_path)
    tasks = {f"HumanEval/{i}": fake_task(f"HumanEval/{i}", "humaneval") for i in range(5)}
    for t in tasks.values():
        object.__setattr__(t, "grade", lambda code: type("O", (), {"status": "failed", "detail": ""})())
    batches = [["HumanEval/0", "HumanEval/1"], ["HumanEval/2", "HumanEval/3"], ["HumanEval/4"]]
    done = {"task_id": "HumanEval/0", "status": "failed", "threshold": None, "generated_tokens": 1, "routed_tokens": 0}
    (tmp_path / "slm.jsonl").write_text(json.dumps(done) + "\n")
    runner = FakeRunner()
    code_tasks.run_system(runner, "slm", None, tasks, batches)
    assert runner.asked == batches  # the first batch again, whole: its composition decides bf16 answers
    rows = [json.loads(line) for line in (tmp_path / "slm.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in rows) == sorted(tasks)
    runner.asked.clear()
    code_tasks.run_system(runner, "slm", None, tasks, batches)
    assert runner.asked == []


def test_r2r_is_paired_with_entropy_at_its_rate(tmp_path, monkeypatch):
    monkeypatch.setattr(code_tasks, "RESULTS", tmp_path)
    (tmp_path / "t").mkdir()
    outcomes = {"r2r@0.04": "ppppfff", "entropy@0.04": "pffpppf"}
    for system, passes in outcomes.items():
        rows = [{"task_id": f"T/{i}", "suite": "humaneval" if i < 3 else "mbpp+", "generated_tokens": 100,
                 "routed_tokens": 4, "threshold": 0.5, "status": "passed" if c == "p" else "failed"}
                for i, c in enumerate(passes)]
        (tmp_path / "t" / f"{system}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = code_tasks.report(["r2r@0.04", "entropy@0.04"], "t", 7)
    pair = result["pairs"]["r2r@0.04 vs entropy@0.04"]
    assert (pair["only_first"], pair["only_second"]) == (2, 2) and pair["p_value"] == 1.0
    assert result["systems"]["r2r@0.04"]["by_suite"] == {"humaneval": 3, "mbpp+": 1}
    assert result["systems"]["r2r@0.04"]["llm_token_rate"] == pytest.approx(0.04)
    with pytest.raises(ValueError, match="--tag"):
        code_tasks.system_file("r2r@0.04", None)


def test_two_routers_are_compared_task_by_task(tmp_path, monkeypatch):
    """``compare``: the first router's system against another router's and an anchor, paired per task."""
    monkeypatch.setattr(code_tasks, "RESULTS", tmp_path)
    outcomes = {"old/r2r@0.04": "ppffp", "new/r2r@0.04": "pppff", "slm": "pffff"}
    for name, passes in outcomes.items():
        rows = [{"task_id": f"T/{i}", "suite": "mbpp+", "generated_tokens": 50, "routed_tokens": 2, "threshold": 0.5,
                 "status": "passed" if c == "p" else "failed"} for i, c in enumerate(passes)]
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = code_tasks.compare("r2r@0.04", ["new", "old"], ["slm"])
    against_old, against_slm = result["pairs"]["new/r2r@0.04 vs old/r2r@0.04"], result["pairs"]["new/r2r@0.04 vs slm"]
    assert (against_old["only_first"], against_old["only_second"], against_old["only_first_tasks"]) == (1, 1, ["T/2"])
    assert (against_slm["only_first"], against_slm["only_second"]) == (2, 0)
    assert result["systems"]["old/r2r@0.04"]["passed"] == 3
