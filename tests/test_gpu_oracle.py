"""The agreement oracle of the device check (``benchmarks/gpu/oracle.py``): its verdicts, and the answers they imply.

Under the oracle an answer is no longer R2R's: at each routed position the token is the SLM's where the oracle agrees
and the next id after it where it does not. These tests hold the oracle to that, on ``generate``'s path (one row and a
left-padded batch) and on the server's slots, at agreement 1 (nothing rejected), 0 (every resolution rejects) and in
between.
"""

import pytest
import torch
from test_batching import PROMPTS, Driver, _threshold

from benchmarks.gpu.oracle import agreement_oracle, agrees, disagreeing, install, stamp
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing.agreement import argmax_without_cache

GREEDY = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=2)
SEED = 5


def test_the_oracle_draws_one_verdict_on_the_host_and_the_device_at_its_rate():
    index, token = torch.arange(4000).repeat(5), torch.arange(20000) * 7 % 151_936
    for p in (0.0, 0.3, 0.876, 1.0):
        device = agrees(SEED, p, index, token)
        host = [agrees(SEED, p, int(i), int(t)) for i, t in zip(index[:500], token[:500])]
        assert device[:500].tolist() == host, "the test's reference draws what the device draws"
        assert abs(device.float().mean().item() - p) < 0.01
    assert not agrees(SEED, 0.5, 3, 10) == agrees(SEED + 1, 0.5, 3, 10) or agrees(SEED, 0.5, 4, 10) != agrees(
        SEED, 0.5, 3, 10), "the draw depends on the seed and the index"
    assert disagreeing(torch.tensor([5, 99]), 100).tolist() == [6, 0]
    with pytest.raises(ValueError, match="probability"):
        install(type("B", (), {"choice": None, "layout": None})(), 1.5)
    assert "not R2R's" in stamp({"x": 1}, 0.876)["oracle"]["note"]


def _check_implied(model, seqs, prompt: int, mask, by_llm, live, p: float) -> int:
    """Every token is what the oracle's verdicts imply: the SLM's cache-free argmax where the SLM wrote it; where the
    LLM did (``by_llm`` [B, N]), the oracle's token at a position it judged (the SLM's where it agrees, the next id
    where not) or, where the row waited for the LLM instead of going on, the LLM's own cache-free argmax. Returns how
    many tokens were the oracle's disagreeing ones."""
    disagreed = 0
    for t in range(seqs.shape[1] - prompt):
        ids, seen = seqs[:, : prompt + t], mask[:, : prompt + t]
        slm = argmax_without_cache(model.slm, ids, seen, model.shared_vocab_size)
        llm = argmax_without_cache(model.llm, ids, seen, model.shared_vocab_size)
        oracle = torch.where(agrees(SEED, p, t, slm), slm, disagreeing(slm, model.shared_vocab_size))
        got = seqs[:, prompt + t]
        ok = torch.where(by_llm[:, t], (got == oracle) | (got == llm), got == slm)
        assert ok[live[:, t]].all(), f"position {t}"
        disagreed += int((by_llm[:, t] & live[:, t] & (got == oracle) & (oracle != slm)).sum())
    return disagreed


@pytest.mark.parametrize("inputs", ["single", "batch"])
@pytest.mark.parametrize("p", [1.0, 0.0, 0.5])
def test_generate_under_the_oracle_answers_what_its_verdicts_imply(model, inputs, p, request):
    enc = request.getfixturevalue(inputs)
    probe = model.generate(**enc, **GREEDY, threshold=float("inf"), return_dict_in_generate=True)
    threshold = probe.router_scores[probe.generated_mask].median().item()
    with agreement_oracle(p, SEED):  # every routed position may go pending: the oracle judges each of them
        out = model.generate(**enc, **GREEDY, threshold=threshold, speculate=14, llm_max_wait=64,
                             return_dict_in_generate=True)
    c = out.counters
    assert c["speculative_agreed"] + c["speculative_rejected"] > 0 and out.routed[out.generated_mask].any()
    if p == 1.0:
        assert c["speculative_rejected"] == 0 and c["thrown"] == 0, "nothing rejected"
    if p == 0.0:
        assert c["speculative_agreed"] == 0, "every resolution rejects (at its first pending position)"
    prompt = enc["input_ids"].shape[1]
    mask = torch.cat([enc["attention_mask"], torch.ones_like(out.sequences[:, prompt:])], dim=1)
    disagreed = _check_implied(model, out.sequences, prompt, mask, out.routed, out.generated_mask, p)
    assert (disagreed > 0) == (p < 1.0), "its rejections are in the answer"
    plain = model.generate(**enc, **GREEDY, threshold=threshold, speculate=14, llm_max_wait=64)
    assert torch.equal(plain, model.generate(**enc, **GREEDY, threshold=threshold)), "outside it: R2R's own answer"


def test_served_rows_under_the_oracle_answer_what_its_verdicts_imply(model, tok):
    # The server's slots at agreement 0: every resolution rejects, and the rejections are in the answers.
    tau = _threshold(model, tok, 0.5)
    run = Driver(model, tok, slots=3, policy=WaitPolicy((3,), 8, speculate=6))
    install(run.batch, 0.0, SEED)
    for name, prompt in (("a", 0), ("b", 1), ("c", 4)):
        run.join(name, prompt, max_new_tokens=12, do_sample=False, threshold=tau)
    run.run()
    c = run.batch.counters
    assert c.resolutions > 0 and c.agreed == 0 and c.rejected >= c.resolutions and c.thrown > 0
    disagreed = 0
    for name, prompt in (("a", 0), ("b", 1), ("c", 4)):
        ids = tok([PROMPTS[prompt]], return_tensors="pt")["input_ids"]
        tokens = torch.tensor([[token for token, _ in run.out[name]]])
        by_llm = torch.tensor([[by for _, by in run.out[name]]])
        seqs = torch.cat([ids, tokens], dim=1)
        disagreed += _check_implied(model, seqs, ids.shape[1], torch.ones_like(seqs), by_llm, torch.ones_like(by_llm),
                                    0.0)
    assert disagreed > 0, "its rejections are in the answers"
