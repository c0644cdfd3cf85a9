"""Issue #19, second hostile review: labeling runs and training (items 4-7, 10, 12).

Each test failed before its fix; loading, saving and the command line are in ``test_reliability_2.py``.
"""

import json
import shutil

import pytest
import torch
from pipeline_helpers import fast_settings, make_models, write_prompts
from synthetic_labels import write_synthetic_run
from test_reliability import QUICK_TRAIN, _one_line_error

from r2r_hf.cli import main as cli_main
from r2r_hf.pipeline import label, load_labels
from r2r_hf.pipeline.store import WorkDir, read_json, read_tensors, write_tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("models"))


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


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# ------------------------------------------------------------------ 4. calibrating on another SLM's labels
def test_calibrate_refuses_labels_of_another_slm(tmp_path, capsys):
    write_synthetic_run(tmp_path / "mine", slm="org/slm")
    router = tmp_path / "router"
    assert cli_main(["--quiet", "train", "--data", str(tmp_path / "mine"), "--out", str(router), *QUICK_TRAIN]) == 0
    before = _files(router)
    for other, kwargs, message in (
        ("other", {"slm": "org/other-slm"}, "was labelled with the SLM 'org/other-slm', but this router reads the "
                                            "SLM 'org/slm'"),
        ("wide", {"slm": "org/slm", "hidden": 32}, "(hidden 32, embedding 32, top 100 logits) are not the ones this "
                                                   "router reads (hidden 64, embedding 64, top 100)"),
    ):
        write_synthetic_run(tmp_path / other, **kwargs)
        capsys.readouterr()
        rc = cli_main(["calibrate", "--router", str(router), "--data", str(tmp_path / other), "--llm-rate", "0.2"])
        _one_line_error(capsys, rc, message)
        assert _files(router) == before
    write_synthetic_run(tmp_path / "copy", slm=str(tmp_path / "models" / "slm"))  # a local copy of org/slm
    assert cli_main(["--quiet", "calibrate", "--router", str(router), "--data", str(tmp_path / "copy"),
                     "--llm-rate", "0.2"]) == 0


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
    _one_line_error(capsys, rc, "exceeds the models' context of 1024 tokens")
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
                                         r"4 to 5; pass --limit 3 or a --limit of at least 5"):
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
    with pytest.raises(ValueError, match=f"{copy / file} is corrupt .*; delete it and rerun `r2r-hf label`"):
        label(fast_settings(*models), prompts, copy, limit=5, progress=False)


def test_a_summary_of_the_wrong_shape_is_refused_before_training(tmp_path, capsys):
    write_synthetic_run(tmp_path / "data")
    (tmp_path / "data" / "summary.json").write_text("{}")
    rc = cli_main(["--quiet", "train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "r"), *QUICK_TRAIN])
    _one_line_error(capsys, rc, "summary.json is corrupt (its 'counts' is NoneType, not a JSON object)")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ 12. diverging training
def test_training_that_diverges_is_one_sentence_and_writes_nothing(tmp_path, capsys):
    write_synthetic_run(tmp_path / "data")
    work = WorkDir(tmp_path / "data")
    tensors, meta = read_tensors(work.shard("features", 0))
    tensors["hidden"][0, 0] = float("inf")  # an SLM feature that overflowed (fp16, say)
    write_tensors(work.shard("features", 0), tensors, meta)
    rc = cli_main(["--quiet", "train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "r"), *QUICK_TRAIN])
    _one_line_error(capsys, rc, "Training diverged in epoch 1 (training loss nan", "lower the learning rate (--lr")
    assert not (tmp_path / "r").exists()
    assert torch.isinf(read_tensors(work.shard("features", 0))[0]["hidden"]).any()
