"""Verifiers and label sets: what the code verifier calls neutral, chains, relabeling without loss."""

import json
import os

import pytest
import torch

from pipeline_helpers import fast_settings, write_prompts
from r2r_hf.pipeline import label, load_labels
from r2r_hf.pipeline.store import WorkDir, read_json, read_tensors
from r2r_hf.pipeline.verifiers import CodeVerifier, Mismatch, parse_chain

ANSWER = '''Here is the function:

```python
def add(a, b):
    """Return the sum of a and b."""
    # add the two numbers
    total = a + b
    return total
```

This works for integers and floats.
'''


def _mismatch(before: str, slm_token: str, llm_token: str, slm_rest: str = "", llm_rest: str = "") -> Mismatch:
    """A mismatch in ANSWER right before the first occurrence of ``before``."""
    at = ANSWER.index(before)
    prefix = ANSWER[:at]
    return Mismatch(index=0, prompt="", prefix=prefix, slm_token=slm_token, llm_token=llm_token,
                    slm=slm_token + slm_rest, llm=llm_token + llm_rest, context="", slm_sentence="",
                    llm_sentence="", response=ANSWER)


@pytest.mark.parametrize("case, verdict, why", [
    (("This works", "It", "This", " works.\n", " works for integers and floats.\n"), 0, "after the program"),
    (("Here is", "Below", "Here", " is the code:\n", " is the function:\n"), None, "before the program"),
    (("sum of a", "total", "sum", " of a and b.\"\"\"\n", " of a and b.\"\"\"\n"), 0, "in a docstring"),
    (("sum of a", '"""', "sum", "\n", " of a and b.\"\"\"\n"), None, "closes a docstring"),
    (("two numbers", "inputs", "two", "\n", " numbers\n"), 0, "in a comment"),
    (("two numbers", "\n", "two", "    total = a + b\n", " numbers\n"), None, "the code differs"),
    (("a + b\n", "a+b", "a", "\n", " + b\n"), 0, "same tokens"),
    (("a + b\n", "(a + b)", "a", "\n", " + b\n"), 0, "same syntax tree"),
    (("a + b\n", "a - b", "a", "\n", " + b\n"), None, "the code differs"),
    (("total = a", "result", "total", " = a + b\n", " = a + b\n"), None, "the code differs"),  # the line after a comment
])
def test_code_verifier_rules(case, verdict, why):
    got = CodeVerifier().judge_one(_mismatch(*case))
    assert (got.verdict, got.why) == (verdict, why)


def test_code_verifier_quote_style_and_strings_the_code_uses():
    answer = "```python\ndef f():\n    return 'yes'\n```\n"
    at = answer.index("'yes'")
    same = Mismatch(0, "", answer[:at], '"', "'", '"yes"\n', "'yes'\n", "", "", "", answer)
    assert CodeVerifier().judge_one(same).verdict == 0
    inside = Mismatch(0, "", answer[: at + 2], "n", "e", "no'\n", "es'\n", "", "", "", answer)
    assert CodeVerifier().judge_one(inside).why == "in a string the code uses"


def test_chain_names_are_checked():
    assert parse_chain("code, llm") == ("code", "llm")
    with pytest.raises(ValueError, match="Unknown verifier 'cod'; choose from code, maths, logprob, llm"):
        parse_chain("cod")
    with pytest.raises(ValueError, match="twice"):
        parse_chain("llm,llm")
    with pytest.raises(ValueError, match="can only end a chain"):
        parse_chain("divergent,code")
    assert parse_chain("code,divergent") == ("code", "divergent")


def _mtimes(folder):
    return {p: p.stat().st_mtime_ns for p in folder.rglob("shard-*")}


def test_relabeling_reuses_the_run_and_never_overwrites_labels(models, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    work = tmp_path / "work"
    first = label(fast_settings(*models), prompts, work, progress=False)
    kept = {p: p.read_bytes() for p in (work / "labels" / "llm").rglob("*")}
    generation = _mtimes(work / "responses") | _mtimes(work / "features") | _mtimes(work / "continuations")
    judge_verdicts = _mtimes(work / "verdicts")
    # A second chain with the same judge: steps 0-2 and the judge's verdicts are reused, a new set appears.
    second = label(fast_settings(*models, verifiers="code,llm"), prompts, work, progress=False)
    assert second["label_set"] == "code+llm" and sorted(WorkDir(work).label_sets()) == ["code+llm", "llm"]
    assert {p: p.read_bytes() for p in (work / "labels" / "llm").rglob("*")} == kept
    assert _mtimes(work / "responses") | _mtimes(work / "features") | _mtimes(work / "continuations") == generation
    assert {p: t for p, t in _mtimes(work / "verdicts").items() if p in judge_verdicts} == judge_verdicts
    # The code verifier never calls divergent: every divergent label of the chain comes from the judge.
    rows = load_labels(work, labels="code+llm").tensors()
    assert second["decided_by"]["code"]["divergent"] == 0
    assert second["counts"]["divergent"] <= first["counts"]["divergent"] + second["counts"]["excluded"]
    assert len(rows["label"]) == second["tokens"] - second["counts"]["excluded"]
    # Same name, other settings: refused with the flag that allows it.
    with pytest.raises(ValueError, match="--labels NAME"):
        label(fast_settings(*models, judge_threshold=0.9), prompts, work, progress=False)
    third = label(fast_settings(*models, judge_threshold=0.9, labels="strict"), prompts, work, progress=False)
    assert third["counts"]["divergent"] <= first["counts"]["divergent"]
    with pytest.raises(ValueError, match="several label sets"):
        load_labels(work)


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_holds_it(tmp_path):
    work = WorkDir(tmp_path / "work")
    with work.lock():
        with pytest.raises(ValueError, match=r"Another labeling run \(pipeline.label; `r2r-hf label` on the command "
                                             r"line\) is writing"):
            with WorkDir(tmp_path / "work").lock():
                pass
    with work.lock():  # released: a resume goes ahead
        pass


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    import subprocess
    import sys

    script = (f"from r2r_hf.pipeline.store import WorkDir\nimport os\nw = WorkDir({str(tmp_path / 'work')!r})\n"
              "with w.lock():\n    os.kill(os.getpid(), 9)\n")
    subprocess.run([sys.executable, "-c", script], check=False)
    assert (tmp_path / "work" / ".lock").exists()
    with WorkDir(tmp_path / "work").lock():
        pass


@pytest.mark.parametrize("content, message", [
    (b'{"id": "a", "prompt": "   "}\n', r"p.jsonl:1: \"prompt\" must be a string with text in it"),
    (b'{"id": "a", "prompt": "caf\xe9"}\n', r"p.jsonl:1: not valid UTF-8"),
])
def test_bad_prompts_are_refused_before_anything_is_written(models, tmp_path, content, message):
    (tmp_path / "p.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        label(fast_settings(*models), tmp_path / "p.jsonl", tmp_path / "work", progress=False)
    assert not (tmp_path / "work").exists()


def test_a_prompt_that_becomes_no_tokens_is_refused_naming_its_line(tmp_path):
    from r2r_hf.pipeline import read_prompts

    class Drops:  # a tokenizer that knows none of the prompt's characters
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": []}

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "ok", "prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: the prompt 'ok' becomes no tokens"):
        read_prompts(path, tokenizer=Drops())


def test_prompts_folder_and_messages_without_template_are_one_sentence(models, tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        label(fast_settings(*models), tmp_path, tmp_path / "work", progress=False)
    from transformers import AutoTokenizer

    from r2r_hf.pipeline import read_prompts

    tok = AutoTokenizer.from_pretrained(models[0])
    tok.chat_template = None
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="chat template"):
        read_prompts(path, tokenizer=tok)


def test_unknown_verifier_and_unloadable_judge_are_one_sentence(models, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    with pytest.raises(ValueError, match="Unknown verifier"):
        fast_settings(*models, verifiers="exec")


def test_code_then_divergent_keeps_only_the_provably_neutral(models, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    summary = label(fast_settings(*models, verifiers="code,divergent"), prompts, tmp_path / "w", progress=False)
    by = summary["decided_by"]
    assert by["divergent"]["neutral"] == 0 and by["code"]["divergent"] == 0 and summary["excluded"] == 0
    assert summary["counts"]["neutral"] == by["code"]["neutral"] + by["identical sentences"]["neutral"]
    with pytest.raises(OSError, match="Could not load the judge tokenizer"):
        label(fast_settings(models[0], models[1], str(tmp_path / "no-judge")), prompts, tmp_path / "w", progress=False)


def test_damaged_shards_and_stray_files_name_the_file(models, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    work = tmp_path / "work"
    label(fast_settings(*models), prompts, work, progress=False)
    shard = work / "features" / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"shard-00000.safetensors is corrupt .* delete it"):
        load_labels(work).tensors()
    (work / "labels" / "llm" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes.txt is not a shard of this run; move it out"):
        load_labels(work)
    (work / "labels" / "llm" / "notes.txt").unlink()
    (work / "manifest.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"manifest.json is corrupt"):
        label(fast_settings(*models), prompts, work, progress=False)


def test_a_run_of_the_first_format_is_relabeled_in_place(models, tmp_path):
    # Runs written before label sets existed: steps 0-2 are reused, the old labels stay readable.
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    work = tmp_path / "work"
    label(fast_settings(*models), prompts, work, progress=False)
    manifest = read_json(work / "manifest.json")
    manifest.update(format=1, verifier=models[2], verifier_max_new_tokens=4, share_verifier_prefix=True,
                    verifier_tokenizer_hash=manifest["tokenizer_hash"])
    (work / "manifest.json").write_text(json.dumps(manifest))
    os.rename(work / "labels" / "llm", tmp_path / "old")
    for path in (tmp_path / "old").glob("shard-*"):
        os.rename(path, work / "labels" / path.name)
    os.rename(tmp_path / "old" / "summary.json", work / "summary.json")
    before = _mtimes(work / "continuations")
    summary = label(fast_settings(*models, verifiers="code,llm"), prompts, work, progress=False)
    assert summary["label_set"] == "code+llm" and _mtimes(work / "continuations") == before
    assert WorkDir(work).label_sets() == ["legacy", "code+llm"]
    legacy, _ = read_tensors(work / "labels" / "shard-00000.safetensors")
    assert len(load_labels(work, labels="legacy").shard(0)["label"]) == int((legacy["label"] >= 0).sum())
    assert torch.is_tensor(load_labels(work, labels="code+llm").shard(0)["label"])
