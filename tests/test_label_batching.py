"""The labeling run's continuous batch: rows leave as they end and waiting rows take their places, and every row
writes what it writes alone; the continuations and log-probabilities a run records are the LLM's own."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline_helpers import fast_settings, write_prompts
from r2r_hf.pipeline import label
from r2r_hf.pipeline.batching import Batch, Row, cut, read_alone
from r2r_hf.pipeline.store import read_json
from r2r_hf.testing import make_tiny_llm

STOPS = frozenset({2, 17, 40})  # a few common ids of the tiny tokenizer end rows early, at different steps


def alone(model, prompt, max_new):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(STOPS),
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def test_rows_that_join_and_leave_write_what_they_write_alone():
    model = make_tiny_llm().eval()
    prompts = [[5 + (i * 7 + j * 3) % 300 for j in range(1 + (i * 5) % 13)] for i in range(11)]
    batch, queue, ended, widths = Batch(model, 4), list(range(len(prompts))), {}, []
    while queue or batch.rows:
        while batch.free and queue:
            i = queue.pop(0)
            batch.join(Row(i, prompts[i][-1], 4 + i % 9, STOPS, keep_hidden=True), read_alone(model, prompts[i][:-1]))
        widths.append(batch.mask.shape[1])
        for row in batch.step(keep_cache=True):
            ended[row.key] = row
    assert len(ended) == len(prompts)
    for i, prompt in enumerate(prompts):
        assert ended[i].written == alone(model, prompt, 4 + i % 9)[: len(ended[i].written)]
        assert ended[i].done
        # What a row read is kept when it ends: its cache equals reading it alone.
        read = read_alone(model, prompt + ended[i].written[:-1])
        for (k, v), (k2, v2) in zip(ended[i].kv, read):
            torch.testing.assert_close(k, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, v2, atol=1e-5, rtol=1e-5)
    assert any(len(r.written) < r.max_new for r in ended.values()), "some rows ended on a stop token"
    assert any(b < a for a, b in zip(widths, widths[1:])), "columns no row uses are cut"


def test_steps_keep_no_autograd_history_and_rows_keep_only_their_own_states():
    """Labeling holds hundreds of rows for minutes: a graph through the cache, or a kept view of a whole step's
    states, grows memory with every step (a real run reached 13 GB before this was guarded)."""
    model = make_tiny_llm()
    assert torch.is_grad_enabled()
    batch = Batch(model, 3)
    for i in range(3):
        batch.join(Row(i, 7 + i, 5, frozenset(), keep_hidden=True), read_alone(model, [3, 4, 5 + i]))
    batch.step()
    batch.step()
    assert all(layer.keys.grad_fn is None and not layer.keys.requires_grad for layer in batch.cache.layers)
    state = batch.rows[0].hidden[0]
    assert state.grad_fn is None and state.untyped_storage().nbytes() == state.numel() * state.element_size()


@torch.no_grad()
def test_a_row_started_from_a_cut_cache_continues_as_from_its_prefix():
    model = make_tiny_llm().eval()
    text = [11, 23, 35, 47, 59, 71, 83, 95]
    kv = read_alone(model, text)
    batch = Batch(model, 3)
    batch.join(Row("long", 7, 6, STOPS), read_alone(model, [3, 4, 5, 6, 8, 9, 10, 12, 13, 14]))
    batch.join(Row("cut", 101, 6, STOPS), cut(kv, 5))  # the first five tokens read, then token 101
    batch.join(Row("empty", 9, 6, STOPS), [])  # a one-token prompt has read nothing
    ended = {}
    while batch.rows:
        ended.update({r.key: r for r in batch.step()})
    assert ended["cut"].written == alone(model, text[:5] + [101], 6)[: len(ended["cut"].written)]
    assert ended["empty"].written == alone(model, [9], 6)[: len(ended["empty"].written)]
    with pytest.raises(RuntimeError, match="full"):
        full = Batch(model, 1)
        full.join(Row("a", 1, 2, STOPS), [])
        full.join(Row("b", 1, 2, STOPS), [])


def test_recorded_log_probabilities_are_the_llms_at_that_prefix(models, tmp_path):
    work = tmp_path / "work"
    label(fast_settings(*models), write_prompts(tmp_path / "p.jsonl", 4), work, progress=False)
    llm = AutoModelForCausalLM.from_pretrained(models[1]).eval()
    samples = read_json(work / "responses" / "shard-00000.json")["samples"]
    checked = 0
    for m in read_json(work / "continuations" / "shard-00000.json")["mismatches"]:
        sample = samples[m["sample"]]
        prefix = sample["prompt_ids"] + sample["response_ids"][: m["position"]]
        with torch.no_grad():
            logp = llm(torch.tensor([prefix])).logits[0, -1].float().log_softmax(-1)
        assert m["llm_logprob"] == pytest.approx(float(logp[m["slm_token"]]), abs=1e-3)
        assert m["llm_own_logprob"] == pytest.approx(float(logp[m["real_token"]]), abs=1e-3)
        assert m["llm_own_logprob"] >= m["llm_logprob"]  # the LLM's own token is its argmax
        checked += 1
    assert checked > 0


def test_continuations_started_from_answers_on_disk_are_the_same(models, tmp_path):
    """Answers written by an earlier run (or committed) are read once to start their continuations: the same."""
    work = tmp_path / "work"
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    label(fast_settings(*models), prompts, work, progress=False)
    before = {p.name: read_json(p) for p in (work / "continuations").iterdir()}
    shutil.rmtree(work / "continuations")
    shutil.rmtree(work / "features")
    label(fast_settings(*models), prompts, work, progress=False, steps=("responses", "features", "continuations"))
    for name, old in before.items():
        new = read_json(work / "continuations" / name)
        for a, b in zip(old["mismatches"], new["mismatches"]):
            assert {k: v for k, v in a.items() if "logprob" not in k} == {k: v for k, v in b.items() if "logprob" not in k}
            assert a["llm_logprob"] == pytest.approx(b["llm_logprob"], abs=1e-3)
        assert len(old["mismatches"]) == len(new["mismatches"])


def test_batching_does_not_change_the_labels_in_float32(models, tmp_path):
    """How many rows decode together is not part of the labels (in bf16 it is up to rounding): two batch sizes,
    the same answers and labels, as benchmarks/router/labeling_speed.py compares the real runs."""
    from benchmarks.router.labeling_speed import compare

    prompts = write_prompts(tmp_path / "p.jsonl", 7)
    for size in (2, 7):
        label(fast_settings(*models, verifiers="code,divergent", batch_size=size), prompts, tmp_path / f"b{size}",
              progress=False)
    result = compare(str(tmp_path / "b2"), str(tmp_path / "b7"), "code+divergent")
    assert result["identical_answers"] == result["prompts"] == 7
    assert result["same_label"] == result["same_slm_proposal"] == result["tokens_of_identical_answers"] > 0
    assert result["counts"]["before"] == result["counts"]["after"] and result["batch_size"] == {"before": 2, "after": 7}
