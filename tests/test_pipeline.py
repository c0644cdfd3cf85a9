"""The labeling pipeline on tiny models: correct, aligned, resumable, and strict about its inputs."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline_helpers import fast_settings, write_prompts
from r2r_hf.pipeline import label, load_labels, read_prompts
from r2r_hf.pipeline.sentences import compare_sentences, sentence_end_ids
from r2r_hf.pipeline.runner import shard_mismatches
from r2r_hf.pipeline.store import WorkDir, read_json, read_tensors
from r2r_hf.pipeline.verifiers.judge import JudgeVerifier, render


@pytest.fixture(scope="module")
def finished_run(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    prompts = write_prompts(root / "prompts.jsonl", 7)
    summary = label(fast_settings(*models), prompts, root / "work", progress=False)
    return root / "work", prompts, summary


def test_end_to_end_statistics_are_consistent(finished_run):
    work, _, summary = finished_run
    counts = summary["counts"]
    responses = [s for k in range(3) for s in read_json(work / "responses" / f"shard-{k:05d}.json")["samples"]]
    assert summary["tokens"] == sum(len(s["response_ids"]) for s in responses) == sum(counts.values())
    judged = summary["tokens"] - counts["excluded"]
    assert summary["mismatch_rate"] == pytest.approx((counts["neutral"] + counts["divergent"]) / judged)
    assert sum(summary["shares"].values()) == pytest.approx(1.0)
    assert counts["identical"] > 0 and counts["neutral"] + counts["divergent"] > 0
    assert summary["responses"]["finished"] + summary["responses"]["truncated"] == 7
    for step in ("responses", "features", "continuations"):
        assert summary["cost"][step]["tokens"] > 0 and summary["cost"][step]["seconds"] > 0
    assert summary["cost"]["verifier llm"]["judged"] > 0 and summary["cost"]["verifier llm"]["seconds"] > 0
    assert summary["label_set"] == "llm" and set(summary["seconds_per_1000_labelled_tokens"]) >= {"verifier llm"}
    data = load_labels(work)
    rows = data.tensors()
    assert len(rows["label"]) == summary["tokens"] - counts["excluded"]
    assert torch.equal(rows["label"] == 0, rows["slm_token"] == rows["real_token"])


def test_features_are_what_the_router_sees_at_that_step(finished_run, models):
    work, _, _ = finished_run
    slm = AutoModelForCausalLM.from_pretrained(models[0])
    samples = read_json(work / "responses" / "shard-00001.json")["samples"]
    tensors, meta = read_tensors(work / "features" / "shard-00001.safetensors")
    assert meta["ids"] == [s["id"] for s in samples]
    for row in range(0, len(tensors["slm_token"]), 5):
        sample = samples[int(tensors["sample"][row])]
        j = int(tensors["position"][row])
        prefix = torch.tensor([sample["prompt_ids"] + sample["response_ids"][:j]])
        out = slm(prefix, output_hidden_states=True)
        logits = out.logits[0, -1]
        assert int(tensors["real_token"][row]) == sample["response_ids"][j]
        assert int(tensors["slm_token"][row]) == int(logits.argmax())
        torch.testing.assert_close(tensors["topk_logits"][row], logits.topk(100).values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tensors["hidden"][row], out.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)
        emb = slm.get_input_embeddings().weight[int(tensors["slm_token"][row])]
        torch.testing.assert_close(tensors["token_embedding"][row], emb)


def test_identical_sentences_are_neutral_without_a_verifier_call(finished_run):
    work, _, summary = finished_run
    judged = 0
    for k in range(3):
        mismatches = read_json(work / "continuations" / f"shard-{k:05d}.json")["mismatches"]
        (folder,) = (work / "verdicts").iterdir()
        verdicts = read_json(folder / f"shard-{k:05d}.json")["verdicts"]
        labels, meta = read_tensors(work / "labels" / "llm" / f"shard-{k:05d}.safetensors")
        names = meta["decided_by"]
        for i, m in enumerate(mismatches):
            who = names[int(labels["decided_by"][m["row"]])]
            if m["identical"]:
                assert str(i) not in verdicts and who == "identical sentences" and labels["label"][m["row"]] == 1
            else:
                judged += 1
                assert who == "llm" and labels["label"][m["row"]] == 1 + verdicts[str(i)]["verdict"]
                assert verdicts[str(i)]["verdict"] == int(verdicts[str(i)]["score"] >= 0.5)
    assert judged == summary["cost"]["verifier llm"]["judged"] > 0


def test_shared_prefix_continuations_equal_plain_greedy_generation(finished_run, models):
    work, _, _ = finished_run
    llm = AutoModelForCausalLM.from_pretrained(models[1])
    tok = AutoTokenizer.from_pretrained(models[1])
    samples = read_json(work / "responses" / "shard-00000.json")["samples"]
    ends = sentence_end_ids(tok)
    for m in read_json(work / "continuations" / "shard-00000.json")["mismatches"][:6]:
        sample = samples[m["sample"]]
        prefix = sample["prompt_ids"] + sample["response_ids"][: m["position"]] + [m["slm_token"]]
        out = llm.generate(torch.tensor([prefix]), max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=2)
        plain = out[0, len(prefix) :].tolist()
        cut = next((i + 1 for i, t in enumerate(plain) if t in ends or t == 2), len(plain))
        assert m["continuation"] == ([] if m["slm_token"] == 2 else plain[:cut])


def test_judge_prefix_sharing_changes_no_score(models, finished_run):
    work, _, _ = finished_run
    verifier = AutoModelForCausalLM.from_pretrained(models[2])
    tok = AutoTokenizer.from_pretrained(models[2])
    samples = read_json(work / "responses" / "shard-00000.json")["samples"]
    items = shard_mismatches(WorkDir(work), 0, samples, tok, sentence_end_ids(tok), [2], 32)[:7]
    requests = [render(tok, i.context, i.slm_sentence, i.llm_sentence) for i in items]
    shared = JudgeVerifier(verifier, tok, batch_size=3, share_prefix=True).scores(requests)
    plain = [JudgeVerifier(verifier, tok, share_prefix=False).scores([r])[0] for r in requests]
    assert shared == pytest.approx(plain, abs=1e-4)
    assert any(s < 0.5 for s in plain) and any(s >= 0.5 for s in plain), "the tiny judge says both"


def test_resume_with_other_settings_is_refused(finished_run, models):
    work, prompts, _ = finished_run
    with pytest.raises(ValueError, match=r"max_new_tokens: 20 before, 30 now"):
        label(fast_settings(*models, max_new_tokens=30), prompts, work, progress=False)


def test_rerun_skips_finished_work_and_changed_prompts_are_refused(finished_run, models, tmp_path):
    work, prompts, summary = finished_run
    before = {p: p.stat().st_mtime_ns for p in work.rglob("shard-*")}
    assert label(fast_settings(*models), prompts, work, progress=False) == summary
    assert {p: p.stat().st_mtime_ns for p in work.rglob("shard-*")} == before
    changed = write_prompts(tmp_path / "changed.jsonl", 7, start=1)
    with pytest.raises(ValueError, match="prompts of shard 0 changed"):
        label(fast_settings(*models), changed, work, progress=False)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"prompts.jsonl:2: not valid JSON"),
        ('{"prompt": "x"}', r"prompts.jsonl:2: each line must be an object with an \"id\""),
        ('{"id": "a", "prompt": "x", "messages": []}', r"exactly one of"),
        ('{"id": "p0", "prompt": "dup"}', r"id 'p0' appears twice"),
        ('{"id": "b", "messages": [{"role": "user"}]}', r"\"messages\" must be a non-empty list"),
    ],
)
def test_malformed_prompts_name_file_and_line_and_write_nothing(models, tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "p0", "prompt": "hello"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        label(fast_settings(*models), path, tmp_path / "work", progress=False)
    assert not (tmp_path / "work").exists()


def test_different_tokenizers_and_unknown_models_are_refused_before_writing(models, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(models[1]).save_pretrained(other)
    tok = AutoTokenizer.from_pretrained(models[1])
    tok.add_tokens(["<new_token>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match="one tokenizer"):
        label(fast_settings(models[0], str(other), models[2]), prompts, tmp_path / "w1", progress=False)
    with pytest.raises(OSError, match="Could not load the LLM tokenizer"):
        label(fast_settings(models[0], "no-such-org/no-such-model", models[2]), prompts, tmp_path / "w2", progress=False)
    assert not (tmp_path / "w1").exists() and not (tmp_path / "w2").exists()


def _cli(*args, env=None):
    return [sys.executable, "-m", "r2r_hf.cli", "--quiet", "label", *args]


def _label_args(models, prompts, out):
    return ["--slm", models[0], "--llm", models[1], "--judge", models[2], "--prompts", prompts, "--out", str(out),
            "--dtype", "float32", "--max-new-tokens", "20", "--batch-size", "3", "--continuation-max-tokens", "8",
            "--context-tokens", "32"]


def _same_run(a, b):
    for step in ("features", "labels"):
        for path in sorted((a / step).rglob("shard-*")):
            ta, _ = read_tensors(path)
            tb, _ = read_tensors(b / path.relative_to(a))
            assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), path
    for step in ("responses", "continuations", "verdicts"):
        for path in sorted((a / step).rglob("shard-*")):
            ja, jb = read_json(path), read_json(b / path.relative_to(a))
            ja.pop("seconds"), jb.pop("seconds")
            assert ja == jb, path


def test_killed_run_resumes_to_the_same_dataset(finished_run, models, tmp_path):
    reference, prompts, _ = finished_run
    out = tmp_path / "work"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cli(*_label_args(models, prompts, out)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (out / "continuations" / "shard-00000.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list((out / "labels").rglob("shard-*")) and not list(out.rglob("shard-*.tmp"))
    result = subprocess.run(_cli(*_label_args(models, prompts, out)), env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    _same_run(reference, out)
    assert read_json(out / "labels" / "llm" / "summary.json")["counts"] == \
        read_json(reference / "labels" / "llm" / "summary.json")["counts"]


def test_two_accelerate_processes_label_the_same_as_one(finished_run, models, tmp_path):
    reference, prompts, _ = finished_run
    out = tmp_path / "work"
    # On a CPU-only machine accelerate starts several processes through its torchrun launcher
    # (--multi_gpu); its --cpu flag would start a single one.
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "r2r_hf.cli", "label", *_label_args(models, prompts, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    bars = result.stderr.replace("\r", "\n")
    assert "continuations (process 0)" in bars and "continuations (process 1)" in bars, "two processes shared the work"
    _same_run(reference, out)


def test_read_prompts_limit_and_chat_template(tmp_path, models):
    prompts = read_prompts(write_prompts(tmp_path / "p.jsonl", 5), limit=3)
    assert [p.id for p in prompts] == ["p0", "p1", "p2"]
    tok = AutoTokenizer.from_pretrained(models[0])
    assert tok.decode(prompts[0].ids(tok)).startswith("<|im_start|>user\nwrite")
    assert prompts[1].ids(tok) == tok(prompts[1].prompt)["input_ids"]


def test_sentence_ends_follow_the_paper_rule(models):
    tok = AutoTokenizer.from_pretrained(models[0])
    ends = sentence_end_ids(tok)
    vocab = tok.get_vocab()
    for text in (".", "?", "!"):
        assert tok.convert_tokens_to_ids(text) in ends
    for token, i in vocab.items():
        decoded = tok.decode([i])
        if i in ends:
            assert len(decoded) <= 4 and ":" not in decoded and decoded.endswith((".", "!", "?", "\n", "。", "！", "？"))


class _CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_compare_sentences_marks_the_divergence_and_keeps_only_its_sentence():
    tok = _CharTokenizer()
    ids = lambda s: [ord(c) for c in s]  # noqa: E731
    ends = frozenset(ids(".!?"))
    response = ids("Hi there. We add two. Then stop.")
    index = response.index(ord("a"))  # "We <a>dd two."
    comparison = compare_sentences(tok, response, index, ord("u"), ids("se it!"), ends, frozenset([0]), 100)
    assert comparison.context == "Hi there."
    assert comparison.slm_sentence == " We <<u>>se it!"
    assert comparison.llm_sentence == " We <<a>>dd two."
    assert not comparison.identical
    # A differing sentence end brings the next sentence along.
    dot = response.index(ord("."))
    comparison = compare_sentences(tok, response, dot, ord("!"), ids(" Go on."), ends, frozenset([0]), 3)
    assert comparison.slm_sentence == "Hi there<<!>> Go on." and comparison.llm_sentence == "Hi there<<.>> We add two."
    assert comparison.context == ""
