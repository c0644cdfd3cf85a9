"""Labels kept as data: what a run commits (token ids, verdicts, the prompts' hashes) is enough to retrain on a
fresh machine, where one SLM read rebuilds the features; the committed run of the shipped router is checked."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline_helpers import fast_settings, write_prompts
from r2r_hf.pipeline import label, load_labels, read_prompts
from r2r_hf.pipeline.continuation import RECORD_FIELDS
from r2r_hf.pipeline.runner import _Models
from r2r_hf.pipeline.shards import prompt_hash
from r2r_hf.pipeline.store import WorkDir, read_json

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "benchmarks" / "data" / "labels" / "qwen-coder"
KEPT = ("manifest.json", "responses", "continuations", "verdicts")  # what a run commits (see .gitignore)


def test_a_fresh_copy_of_the_kept_files_relabels_to_the_same_labels_without_the_llm(models, tmp_path, monkeypatch):
    work, fresh = tmp_path / "work", tmp_path / "fresh"
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    settings = dict(verifiers="code,maths,logprob,divergent", logprob_threshold=-2.0)
    summary = label(fast_settings(*models, **settings), prompts, work, progress=False)
    fresh.mkdir()
    for name in KEPT:
        (shutil.copytree if (work / name).is_dir() else shutil.copy)(work / name, fresh / name)
    loaded = []
    real_get = _Models.get
    monkeypatch.setattr(_Models, "get", lambda self, name, role="model": loaded.append(role) or real_get(self, name, role))
    again = label(fast_settings(*models, **settings), prompts, fresh, progress=False)
    assert set(loaded) == {"SLM"}, "only the SLM is read: the answers and continuations are on disk"
    assert again["counts"] == summary["counts"] and again["decided_by"] == summary["decided_by"]
    a, b = load_labels(work).tensors(), load_labels(fresh).tensors()
    for key in ("label", "slm_token", "real_token"):
        assert torch.equal(a[key], b[key])
    torch.testing.assert_close(a["hidden"], b["hidden"])


def test_continuation_shards_keep_token_ids_only(models, tmp_path):
    work = tmp_path / "work"
    label(fast_settings(*models, verifiers="code,divergent"), write_prompts(tmp_path / "p.jsonl", 4), work,
          progress=False)
    records = read_json(work / "continuations" / "shard-00000.json")["mismatches"]
    assert records and all(set(m) == set(RECORD_FIELDS) for m in records)
    assert not any(isinstance(v, str) for m in records for v in m.values())


def _git_tracked(folder: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", str(folder)], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.decode().split()


@pytest.mark.skipif(not (COMMITTED / "manifest.json").exists(), reason="the shipped router's labels are not here")
def test_the_committed_labels_match_their_prompts_and_stay_small():
    work = WorkDir(COMMITTED)
    manifest = work.manifest()
    assert manifest["slm"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct" and manifest["llm"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    prompts = read_prompts(ROOT / "benchmarks" / "data" / "router_prompts.jsonl")
    start = 0
    for k in work.shards("responses"):
        samples = work.read("responses", k)["samples"]
        assert work.read("responses", k)["prompt_hash"] == prompt_hash(prompts[start : start + len(samples)])
        start += len(samples)
        if work.done("continuations", k):
            offsets = [sum(len(s["response_ids"]) for s in samples[:i]) for i in range(len(samples))]
            for m in work.read("continuations", k)["mismatches"]:
                assert set(m) == set(RECORD_FIELDS) and m["row"] == offsets[m["sample"]] + m["position"]
                assert samples[m["sample"]]["response_ids"][m["position"]] == m["real_token"] != m["slm_token"]
    tracked = _git_tracked(COMMITTED)
    assert not any("/features/" in t or t.endswith(".safetensors") for t in tracked), "features are recomputed"
    size = sum((ROOT / t).stat().st_size for t in tracked if (ROOT / t).exists())
    assert size < 40e6, f"the committed labels take {size / 1e6:.1f} MB"
    if (COMMITTED / "labels").is_dir():
        for summary in (COMMITTED / "labels").glob("*/summary.json"):
            assert json.loads(summary.read_text())["tokens"] > 0


def test_the_training_prompts_mix_both_sources_in_every_shard_after_the_first():
    """A labeling run stopped part-way (or labelled in parts) must train on code and maths differences alike."""
    from benchmarks.router.gsm8k_prompts import KEPT as FIRST, interleave

    merged = interleave(list("aaaaaa"), list("bbb"))
    assert merged == list("aabaabaab") and interleave([], [1]) == [1] and interleave([1], []) == [1]
    ids = [p.id for p in read_prompts(ROOT / "benchmarks" / "data" / "router_prompts.jsonl")]
    stdlib = [json.loads(line)["id"] for line in (ROOT / "benchmarks" / "data" / "stdlib_prompts.jsonl").open()]
    assert ids[:FIRST] == stdlib[:FIRST] and len(set(ids)) == len(ids) == 768
    for start in range(FIRST, len(ids), 64):
        maths = sum(i.startswith("gsm8k-train-") for i in ids[start : start + 64])
        assert 30 <= maths <= 36, (start, maths)
