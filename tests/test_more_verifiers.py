"""The verifiers that call more differences neutral: ``maths`` (the same numbers and operators in prose), ``logprob``
(the LLM finds the SLM's token likely), and the code verifier leaving prose answers alone."""

import pytest

from pipeline_helpers import fast_settings, write_prompts
from r2r_hf.pipeline import LabelSettings, label
from r2r_hf.pipeline.store import WorkDir, read_json
from r2r_hf.pipeline.verifiers import CodeVerifier, LogprobVerifier, MathsVerifier, Mismatch
from r2r_hf.pipeline.verifiers.maths import arithmetic

MATHS = ("Natalia sold 48 / 2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips in April and May.\n#### 72\n")
CODE = "Here it is:\n\n```python\ndef half(n):\n    return n / 2\n```\n\nIt returns 2.5 for 5.\n"


def mismatch(response: str, before: str, slm: str, llm: str, logprob: float | None = None) -> Mismatch:
    """A mismatch of ``response`` right before ``before``: the SLM's side writes ``slm``, the LLM's ``llm``."""
    prefix = response[: response.index(before)]
    return Mismatch(0, "", prefix, slm[:3], llm[:3], slm, llm, "", "", "", response, llm_logprob=logprob,
                    llm_own_logprob=0.0 if logprob is not None else None)


@pytest.mark.parametrize("slm, llm, verdict, why", [
    ("She sold 24 clips in May.", "In May she sold 24 clips.", 0, "same numbers and operators"),
    ("Half of $48 is 24.0, so", "Half of 48 is 24, so", 0, "same numbers and operators"),
    ("2 × 3 = 6 and 1,000 ÷ 10", "2 * 3 = 6 and 1000 / 10", 0, "same numbers and operators"),
    ("She sold 48 / 2 = 24 clips.", "She sold 48 * 2 = 96 clips.", None, "the numbers or operators differ"),
    ("She sold 24 clips.", "She sold 25 clips.", None, "the numbers or operators differ"),
    ("48 - 24 left.", "48 + 24 left.", None, "the numbers or operators differ"),
    ("So she sold them all.", "Then she sold them all.", None, "no numbers"),
])
def test_maths_verifier_compares_numbers_and_operators_in_prose(slm, llm, verdict, why):
    got = MathsVerifier().judge_one(mismatch(MATHS, "Natalia", slm, llm))
    assert (got.verdict, got.why) == (verdict, why)


def test_maths_verifier_leaves_programs_to_the_code_verifier():
    inside = mismatch(CODE, "return n", "return n / 2\n", "return n * 0.5\n")
    assert MathsVerifier().judge_one(inside).why == "inside the program"
    after = mismatch(CODE, "It returns", "It gives 2.5 for 5.\n", "It returns 2.5 for 5.\n")
    assert MathsVerifier().judge_one(after).verdict == 0  # the prose after the program is prose
    assert arithmetic("3x4 = 12, 3 x 4, box") == ["3", "*", "4", "=", "12", "3", "*", "4"]


def test_the_code_verifier_passes_prose_answers_on():
    got = CodeVerifier().judge_one(mismatch(MATHS, "Natalia", "She sold 24.", "Natalia sold 24."))
    assert (got.verdict, got.why) == (None, "not a program")
    bare = "def f(x):\n    # twice x\n    return 2 * x\n"  # no fence, but a program: its rules apply
    assert CodeVerifier().judge_one(mismatch(bare, "twice", "double x\n", "twice x\n")).why == "in a comment"


def test_logprob_verifier_decides_by_its_threshold_and_keeps_the_score():
    likely, unlikely = mismatch(MATHS, "Natalia", "a", "b", -0.4), mismatch(MATHS, "Natalia", "a", "b", -3.2)
    verdicts = LogprobVerifier(-1.0).judge([likely, unlikely])
    assert [v.verdict for v in verdicts] == [0, None] and [v.score for v in verdicts] == [-0.4, -3.2]
    # Another threshold decides the stored scores without judging again.
    assert LogprobVerifier(-4.0).decide(verdicts[1].to_json()) == 0
    assert LogprobVerifier(-0.1).decide(verdicts[0].to_json()) is None
    with pytest.raises(ValueError, match="record no log-probabilities"):
        LogprobVerifier().judge([mismatch(MATHS, "Natalia", "a", "b")])
    with pytest.raises(ValueError, match="at most 0"):
        LogprobVerifier(0.5)


def test_a_chain_with_maths_and_logprob_labels_and_relabels_from_kept_scores(models, tmp_path):
    work = tmp_path / "work"
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    chain = "code,maths,logprob,divergent"
    summary = label(fast_settings(*models, verifiers=chain, logprob_threshold=-2.0), prompts, work, progress=False)
    decided = summary["decided_by"]
    assert set(decided) == {"identical sentences", "code", "maths", "logprob", "divergent", "undecided"}
    assert decided["logprob"]["neutral"] > 0 and decided["divergent"]["divergent"] > 0
    folder = WorkDir(work).folder("verdicts", "logprob-v1")
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    strict = label(fast_settings(*models, verifiers=chain, logprob_threshold=-0.05, labels="strict"), prompts, work,
                   progress=False)
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps, "the kept scores served the new threshold"
    assert strict["decided_by"]["logprob"]["neutral"] < decided["logprob"]["neutral"]
    assert strict["counts"]["divergent"] > summary["counts"]["divergent"]
    settings = read_json(work / "labels" / "strict" / "settings.json")["verifiers"]
    assert {"name": "logprob", "version": 1, "threshold": -0.05} in settings
    with pytest.raises(ValueError, match="log-probability"):
        LabelSettings(slm="a", llm="b", logprob_threshold=0.2)


def test_matching_the_checked_mismatches_twice_appends_them_once(tmp_path):
    """``calibrate_verifiers match`` keeps the hand-checked set beside the labels: run again, it adds no duplicates."""
    import json

    from benchmarks.router.calibrate_verifiers import append_new

    checked = tmp_path / "checked.jsonl"
    checked.write_text(json.dumps({"id": "0:3", "label": 0}) + "\n", encoding="utf-8")
    rows = [{"id": "0:3", "label": 0}, {"id": "2:17", "label": 1}]
    assert append_new(checked, rows) == 1 and append_new(checked, rows) == 0
    assert [json.loads(line)["id"] for line in checked.read_text().splitlines()] == ["0:3", "2:17"]
