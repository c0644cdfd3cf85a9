"""Labeling runs on disk: a run without a single mismatch still gets its labels, every check comes before anything
is written, a larger --limit extends a run and keeps its shards, and run files of the wrong shape are named as
corrupt.

From issue 19's second hostile review (items 5-7 and 10); each test failed before its fix.
"""

import json
import shutil

import pytest
from conftest import one_line_error
from pipeline_helpers import fast_settings, write_prompts

from r2r_hf.cli import main as cli_main
from r2r_hf.pipeline import label, load_labels
from r2r_hf.pipeline.store import read_json


@pytest.fixture(scope="module")
def small_run(models, tmp_path_factory):
    """A run labelled with --limit 5: shards of 3 and 2 prompts."""
    root = tmp_path_factory.mktemp("small")
    prompts = write_prompts(root / "prompts.jsonl", 9)
    label(fast_settings(*models), prompts, root / "work", limit=5, progress=False)
    return root / "work", prompts


@pytest.fixture(scope="module")
def grown_run(small_run, models, tmp_path_factory):
    """The small run extended with --limit 7."""
    work = tmp_path_factory.mktemp("grown") / "work"
    shutil.copytree(small_run[0], work)
    first = {p: p.stat().st_mtime_ns for p in work.rglob("shard-*")}
    summary = label(fast_settings(*models), small_run[1], work, limit=7, progress=False)
    return work, small_run[1], first, summary


# ------------------------------------------------------------------ 5. a shard without a mismatch
def test_a_run_without_a_single_mismatch_gets_its_labels(models, tmp_path):
    slm, _, judge = models
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    summary = label(fast_settings(slm, slm, judge), prompts, tmp_path / "work", progress=False)  # SLM against itself
    assert summary["tokens"] > 0 and summary["counts"]["identical"] == summary["tokens"]
    assert label(fast_settings(slm, slm, judge), prompts, tmp_path / "work", progress=False) == summary


# ------------------------------------------------------------------ 6. everything checked before anything is written
def test_max_new_tokens_past_the_context_is_refused_before_writing(models, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    with pytest.raises(ValueError, match=r"with max_new_tokens=1020 \(--max-new-tokens\) it exceeds the models' "
                                         r"context of 1024 tokens: lower max_new_tokens \(--max-new-tokens\) to \d+ or less"):
        label(fast_settings(*models, max_new_tokens=1020), prompts, tmp_path / "work", progress=False)
    assert not (tmp_path / "work").exists()
    rc = cli_main(["--quiet", "label", "--slm", models[0], "--llm", models[1], "--prompts", prompts,
                   "--out", str(tmp_path / "work"), "--max-new-tokens", "1020"])
    one_line_error(capsys, rc, "exceeds the models' context of 1024 tokens")
    assert not (tmp_path / "work").exists()


def test_later_steps_on_a_new_folder_and_the_legacy_name_are_refused_before_writing(models, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    with pytest.raises(ValueError, match="holds no labeling run yet; run the 'responses' step first"):
        label(fast_settings(*models), prompts, tmp_path / "work", steps=("verdicts", "labels"), progress=False)
    with pytest.raises(ValueError, match="'legacy' names the labels of an older run format"):
        label(fast_settings(*models, labels="legacy"), prompts, tmp_path / "work", progress=False)
    assert not (tmp_path / "work").exists()


def test_a_judge_that_cannot_load_leaves_no_label_set_in_the_way(models, tmp_path):
    slm, llm, judge = models
    broken = tmp_path / "judge"
    shutil.copytree(judge, broken, ignore=shutil.ignore_patterns("*.safetensors"))  # tokenizer and config, no weights
    prompts = write_prompts(tmp_path / "prompts.jsonl", 3)
    with pytest.raises(OSError, match="Could not load the judge"):
        label(fast_settings(slm, llm, str(broken)), prompts, tmp_path / "work", progress=False)
    assert not (tmp_path / "work" / "labels").exists()
    assert label(fast_settings(slm, llm, judge), prompts, tmp_path / "work", progress=False)["tokens"] > 0


# ------------------------------------------------------------------ 7. a larger --limit extends a run
def test_a_larger_limit_extends_the_run_and_keeps_its_shards(grown_run):
    work, _, first, summary = grown_run
    assert all(p.stat().st_mtime_ns == t for p, t in first.items()), "the shards of --limit 5 were not rewritten"
    sizes = [len(read_json(work / "responses" / f"shard-{k:05d}.json")["samples"]) for k in range(3)]
    assert sizes == [3, 2, 2] and summary["responses"]["finished"] + summary["responses"]["truncated"] == 7
    assert summary["tokens"] == len(load_labels(work).tensors()["label"]) + summary["counts"]["excluded"]


def test_a_limit_inside_a_shard_the_run_holds_is_refused_in_terms_of_limit(grown_run, models):
    work, prompts, _, _ = grown_run
    with pytest.raises(ValueError, match=r"Labelling 4 prompts would end inside shard 1 of .*, which holds prompts "
                                         r"4 to 5; pass limit=3 or a limit of at least 5 \(--limit on the command "
                                         r"line"):
        label(fast_settings(*models), prompts, work, limit=4, progress=False)


# ------------------------------------------------------------------ 10. valid JSON of the wrong shape
@pytest.mark.parametrize("file, content", [
    ("responses/shard-00001.json", []), ("responses/shard-00000.json", {"samples": None}),
    ("continuations/shard-00001.json", None), ("labels/llm/settings.json", []),
])
def test_run_files_of_the_wrong_shape_are_named_as_corrupt(small_run, models, tmp_path, file, content):
    work, prompts = small_run
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    (copy / file).write_text(json.dumps(content))
    python_first = r"delete it and label the run again \(pipeline.label; `r2r-hf label`"
    with pytest.raises(ValueError, match=f"{copy / file} is corrupt .*; {python_first}"):
        label(fast_settings(*models), prompts, copy, limit=5, progress=False)
