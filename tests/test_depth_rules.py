"""The depth rules' replay (``benchmarks/speed/depth_rules.py``): the counters follow from a trace, the foresight bound
is above every rule, and the expected-gain rule stops where the SLM doubts."""

import random

from benchmarks.speed import depth_rules as dr


def _trace(n: int, seed: int) -> dict:
    """Agreement in runs with rare disagreements, the SLM's probability low where it disagrees (as the real pair's)."""
    rng = random.Random(seed)
    agree = [rng.random() > 0.06 for _ in range(n)]
    p = [round(rng.uniform(0.9, 1.0) if a and rng.random() > 0.1 else rng.uniform(0.2, 0.8), 3) for a in agree]
    return {"agree": agree, "p": p, "tokens": n}


def test_a_fixed_depth_replays_as_counted_by_hand():
    trace = {"agree": [True, True, False, True, True, True], "p": [0.99] * 6}
    c = dr.replay(trace, dr.rules(2)["fixed"], 2, 0.0)
    # a draft of 2 at 0, confirmed, and the LLM's own token at 2 (the frontier); the same at 3: 6 tokens in 2 LLM
    # forwards, nothing thrown
    assert (c["tokens"], c["llm"], c["slm"], c["thrown"]) == (6, 2, 4, 0)
    c = dr.replay(trace, dr.rules(4)["fixed"], 4, 0.0)
    # a draft of 4 at 0 is rejected at its 3rd token (it and the 4th thrown; the LLM writes the 3rd), then the 3 left
    assert (c["tokens"], c["llm"], c["slm"], c["thrown"]) == (6, 2, 4 + 3, 2)


def test_foresight_throws_nothing_and_no_rule_beats_it():
    traces = [_trace(400, seed) for seed in range(6)]
    rows = dr.compare(traces, bounds=(8, 16), confidences=(0.0, 0.8))
    for bound in (8, 16):
        best = next(r for r in rows if r["rule"] == dr.FORESIGHT and r["bound"] == bound)
        assert best["thrown"] == 0 and best["tokens"] == sum(t["tokens"] for t in traces)
        others = [r for r in rows if r["bound"] == bound and r["rule"] != dr.FORESIGHT]
        assert others and all(r["predicted_vs_llm_alone"] <= best["predicted_vs_llm_alone"] for r in others)


def test_the_expected_gain_rule_stops_where_the_slm_doubts_and_drafts_deep_where_it_is_sure():
    sure = {"agree": [True] * 40, "p": [0.999] * 40, "tokens": 40}
    assert dr.expected_gain(sure, 16)["llm"] == 3, "sure all along: drafts of 16, 16 and the last 5 (+ frontiers)"
    doubt = {"agree": [True] * 40, "p": [0.999, 0.3] * 20, "tokens": 40}
    c = dr.expected_gain(doubt, 16)
    assert c["slm"] / c["llm"] <= 2, "a token the SLM doubts ends the draft"
