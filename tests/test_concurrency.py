"""Concurrent ``generate`` calls on one model each get what they would get alone.

The thresholds are quantiles of the router's own scores, so every call routes some tokens and not
others: a call that read another call's hidden state (or router state, or random stream) would
route differently and fail here.
"""

import threading

import pytest
import torch

from r2r_hf import R2RForCausalLM

GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)
SAMPLING = dict(max_new_tokens=10, do_sample=True, temperature=0.9, top_k=50, pad_token_id=0, eos_token_id=2)
PROMPTS = ["the old man said that he was", "water", "write a new line", "the first time you see"]


def _score_quantiles(model, enc, n: int) -> list[float]:
    probe = model.generate(**enc, **GREEDY, threshold=float("inf"), return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask]
    return torch.quantile(scores, torch.linspace(0.2, 0.8, n)).tolist()


def _in_threads(work, jobs: list) -> list:
    results, errors = [None] * len(jobs), []
    start = threading.Barrier(len(jobs))

    def run(i):
        try:
            start.wait()
            results[i] = work(jobs[i])
        except Exception as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    return results


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("sampling", [False, True])
def test_eight_threads_with_their_own_thresholds_equal_the_serial_calls(model, tok, cache, sampling):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    thresholds = _score_quantiles(model, enc, 8)
    kwargs = dict(SAMPLING if sampling else GREEDY, return_dict_in_generate=True, cache_implementation=cache)

    def call(job):
        threshold, seed = job
        out = model.generate(**enc, **kwargs, threshold=threshold, **({"seed": seed} if sampling else {}))
        return out.sequences, out.routed

    jobs = [(t, 100 + i) for i, t in enumerate(thresholds)]
    serial = [call(job) for job in jobs]
    assert any(r.any() and not r.all() for _, r in serial), "the thresholds give mixed routing"
    assert len({tuple(s.flatten().tolist()) for s, _ in serial}) > 1, "the calls differ from each other"
    for attempt in range(2):
        for (want_seq, want_routed), (got_seq, got_routed) in zip(serial, _in_threads(call, jobs)):
            assert torch.equal(got_seq, want_seq) and torch.equal(got_routed, want_routed)


def test_random_baseline_routes_each_call_from_its_own_generator(slm, llm, tok):
    random = R2RForCausalLM.from_models(slm, llm, router_type="random", threshold=0.5)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)

    def call(_):
        return random.generate(**enc, **GREEDY, return_dict_in_generate=True).routed

    serial = call(None)
    for got in _in_threads(call, range(6)):
        assert torch.equal(got, serial)


def test_a_seeded_call_draws_what_manual_seed_draws_and_leaves_the_global_stream(model, slm, llm, tok):
    enc = tok(PROMPTS[:2], return_tensors="pt", padding=True)
    for threshold, reference in ((float("inf"), slm), (0.0, llm)):
        torch.manual_seed(7)
        expected = reference.generate(**enc, **SAMPLING)
        torch.manual_seed(1)
        before = torch.get_rng_state()
        got = model.generate(**enc, **SAMPLING, threshold=threshold, seed=7)
        assert torch.equal(got, expected), f"threshold {threshold}"
        assert torch.equal(torch.get_rng_state(), before), "the global random stream is untouched"


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, "7", True])
def test_a_bad_seed_is_refused_in_one_sentence(model, tok, seed):
    enc = tok(PROMPTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="seed must be a whole number"):
        model.generate(**enc, **SAMPLING, seed=seed)



def test_the_logits_processor_reads_its_own_threads_forwards(model, slm, tok):
    from r2r_hf import R2RLogitsProcessor

    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    threshold = _score_quantiles(model, enc, 1)[0]

    def with_processor():
        with R2RLogitsProcessor(llm=model.llm, router=model, threshold=threshold) as proc:
            return slm.generate(**enc, **GREEDY, logits_processor=[proc]), proc.routed

    serial = with_processor()

    def job(kind):
        return with_processor() if kind == "processor" else model.generate(**enc, **GREEDY, threshold=threshold)

    for attempt in range(4):
        for got in _in_threads(job, ["processor", "processor"] + ["r2r"] * 6)[:2]:
            assert torch.equal(got[0], serial[0]) and torch.equal(got[1], serial[1])
