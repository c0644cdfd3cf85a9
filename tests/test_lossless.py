"""Threshold 0 with speculation is lossless speculative decoding with the SLM as draft (issue 50): the LLM's own
answer, token for token, in ``generate`` and in the server's slots. Where every pending position of a row is
confirmed, the resolving read also gives the LLM's token at the next position (the frontier token: no SLM step, no
second LLM forward); where the router cannot change a decision it does not run (router steps 0).

The identity pair (the LLM is the SLM itself) agrees at every position, so its counts are exact: one SLM forward
per token but the frontier tokens. The related pair mostly agrees (rollbacks happen too).
"""

import pytest
import torch
from conftest import PROMPTS as SHORT
from conftest import SMALL_ROUTER

from r2r_hf import R2RForCausalLM
from r2r_hf.core.policy import WaitPolicy, speculative_policy
from r2r_hf.testing import make_related_llm, make_tiny_slm
from test_batching import Driver, _alone

GREEDY = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=2)
SAMPLED = dict(GREEDY, do_sample=True, temperature=0.9, top_k=30)


@pytest.fixture(scope="module")
def related():
    slm = make_tiny_slm()
    return R2RForCausalLM.from_models(slm, make_related_llm(slm), **SMALL_ROUTER)


@pytest.fixture(scope="module")
def identity():
    slm = make_tiny_slm()
    return R2RForCausalLM.from_models(slm, slm, **SMALL_ROUTER)


def _llm(model, enc, options):
    torch.manual_seed(5)
    return model.llm.generate(**enc, **options)


def _r2r(model, enc, options, **r2r):
    torch.manual_seed(5)
    return model.generate(**enc, **options, threshold=0.0, return_dict_in_generate=True, **r2r)


@pytest.mark.parametrize("rows, options", [(1, GREEDY), (1, SAMPLED), (2, GREEDY)],
                         ids=["one-greedy", "one-seeded", "batch-greedy"])
@pytest.mark.parametrize("depth", [1, 4, 8])
def test_threshold_0_speculating_is_the_llms_answer_with_frontier_tokens_and_no_router(related, tok, rows, options,
                                                                                      depth):
    enc = tok(SHORT[:rows], return_tensors="pt", padding=True)
    want = _llm(related, enc, options)
    out = _r2r(related, enc, options, speculate=depth, llm_max_wait=64)
    assert torch.equal(out.sequences, want)
    c = out.counters
    assert c["router_steps"] == 0, "every position routes: the router cannot change a decision"
    assert c["frontier_tokens"] > 0 and c["speculative_agreed"] > 0
    assert torch.equal(out.routed, out.generated_mask) and torch.equal(out.llm_tokens, out.generated_mask.sum(-1))
    assert torch.isnan(out.router_scores).all(), "nothing was scored"


@pytest.mark.parametrize("depth", [1, 2, 4, 8])
def test_every_confirmed_tail_takes_its_frontier_token_instead_of_an_slm_step(identity, tok, depth):
    """With nothing rejected, the SLM reads once per token but the frontier tokens (and the LLM wrote those): before,
    it read every token, the last of each tail alone, and proposed a token the LLM then replaced."""
    enc = tok(SHORT[:1], return_tensors="pt")
    out = _r2r(identity, enc, dict(GREEDY, max_new_tokens=40, eos_token_id=None), speculate=depth, llm_max_wait=64)
    c = out.counters
    assert c["generated"] == 40 and c["speculative_rejected"] == 0
    assert c["frontier_tokens"] >= c["llm_forwards"] - 1, "each resolution but perhaps the last took one"
    assert c["slm_forwards"] == c["generated"] - c["frontier_tokens"], "the prompt's read, none for the last token"
    assert c["steps"] <= c["generated"] + 1


def test_captured_generate_takes_frontier_tokens_too(related, tok, monkeypatch):
    from r2r_hf.testing.graphs import emulated_store

    enc = tok(SHORT, return_tensors="pt", padding=True)
    want = _llm(related, enc, GREEDY)
    eager = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=16)
    monkeypatch.setattr(related, "capture_store", emulated_store())
    out = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=16, cache_implementation="static")
    assert torch.equal(out.sequences, want) and out.counters["frontier_tokens"] > 0
    assert out.counters["router_steps"] == 0
    assert out.counters["mean_depth"] == eager.counters["mean_depth"] < 8, "the drafts adapt as eager ones do"


@pytest.mark.parametrize("rows, options", [(1, GREEDY), (1, SAMPLED), (2, GREEDY)],
                         ids=["one-greedy", "one-seeded", "batch-greedy"])
def test_drafts_that_adapt_are_the_llms_answer_as_fixed_ones_are(related, tok, rows, options):
    """Each row's depth follows its own acceptance by default (``plan.adapted``; ``fixed_depth=True``: every draft may
    reach ``speculate``): the answer is the LLM's either way, only the drafts' depths differ."""
    enc = tok(SHORT[:rows], return_tensors="pt", padding=True)
    want = _llm(related, enc, options)
    fixed = _r2r(related, enc, options, speculate=16, llm_max_wait=64, fixed_depth=True)
    adapting = _r2r(related, enc, options, speculate=16, llm_max_wait=64)
    assert torch.equal(fixed.sequences, want) and torch.equal(adapting.sequences, want)
    assert adapting.counters["mean_depth"] < fixed.counters["mean_depth"], "its first drafts and those after a " \
                                                                           "rejection are shorter"


def test_drafts_deepen_while_they_are_confirmed_whole(identity, tok):
    """The identity pair confirms every draft: a row's depth grows by 4 from 4 to ``speculate`` (tails of 4, 8, 12,
    16), where a fixed depth drafts 16 at once; each draft is one LLM forward, so the fixed one takes fewer."""
    enc = tok(SHORT[:1], return_tensors="pt")
    options = dict(GREEDY, max_new_tokens=60, eos_token_id=None)
    adapting = _r2r(identity, enc, options, speculate=16, llm_max_wait=64)
    fixed = _r2r(identity, enc, options, speculate=16, llm_max_wait=64, fixed_depth=True)
    assert torch.equal(adapting.sequences, fixed.sequences)
    a, f = adapting.speculation, fixed.speculation
    assert int(a["drafts"][0]) == 5 and int(a["pending_resolved"][0]) == 4 + 8 + 12 + 16 + 16, "and 4 frontier " \
        "tokens (none after the last token)"
    assert int(f["drafts"][0]) == 4 and int(f["pending_resolved"][0]) == 16 + 16 + 16 + 9
    assert adapting.counters["llm_forwards"] == fixed.counters["llm_forwards"] + 1


def test_the_router_runs_at_a_threshold_that_routes_nothing_only_where_its_scores_are_returned(related, tok):
    enc = tok(SHORT[:1], return_tensors="pt")
    calls = []
    scores = related.router.scores
    related.router.scores = lambda *a: calls.append(1) or scores(*a)
    try:
        probe = related.generate(**enc, **GREEDY, threshold=float("inf"), return_dict_in_generate=True)
        assert calls and torch.isfinite(probe.router_scores[probe.generated_mask]).all(), "the probe's scores"
        calls.clear()
        plain = related.generate(**enc, **GREEDY, threshold=float("inf"))
        assert not calls and torch.equal(plain, probe.sequences), "no one reads them: the router does not run"
        related.generate(**enc, **GREEDY, threshold=0.5)
        assert calls, "where it decides, it runs"
    finally:
        del related.router.scores


@pytest.mark.parametrize("policy", [WaitPolicy((4,), 16, speculate=2), speculative_policy("cuda", 3, 4)],
                         ids=["s2", "server-default-s4"])
def test_served_rows_at_threshold_0_answer_as_the_llm_and_take_frontier_tokens(related, tok, policy):
    """Rows at threshold 0 (greedy, seeded) beside a row the router decides: each answers as alone (the threshold-0
    rows as the LLM alone), the frontier tokens are taken, and the router runs only in steps a routed row proposes."""
    rows = {"greedy": (0, dict(max_new_tokens=14, do_sample=False, threshold=0.0)),
            "seeded": (2, dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, seed=7, threshold=0.0)),
            "long": (1, dict(max_new_tokens=16, do_sample=False, threshold=0.0))}
    run = Driver(related, tok, slots=3, policy=policy)
    for name, (prompt, options) in rows.items():
        run.join(name, prompt, **options)
    run.run()
    for name, (prompt, options) in rows.items():
        assert run.out[name] == _alone(related, tok, prompt, **dict(options)), name
        assert all(by_llm for _, by_llm in run.out[name]), "every token is the LLM's"
    c = run.batch.counters
    assert c.router_steps == 0 and c.frontier_tokens > 0 and c.agreed > 0
    assert c.agreed + c.rejected > 1.5 * c.resolutions, "the tails fill before the LLM resolves them"
    mixed = Driver(related, tok, slots=2, policy=policy)
    mixed.join("greedy", 0, **rows["greedy"][1])
    mixed.join("routed", 4, max_new_tokens=6, do_sample=False, threshold=0.5)
    mixed.run()
    assert mixed.out["greedy"] == run.out["greedy"], "its neighbour does not change its answer"
    assert 0 < mixed.batch.counters.router_steps <= 6, "the router ran while the routed row proposed"


@pytest.mark.parametrize("threshold", [0.0, 0.45])
def test_captured_generates_resolving_reads_are_fused_and_keep_the_judged_positions_only(related, tok, monkeypatch,
                                                                                          threshold):
    """Generate's static rectangle resolves through a fused read (plain regions on emulated graphs) whose head keeps
    the positions the resolution judges (a bucket of them), with the eager answer."""
    from r2r_hf.testing.graphs import emulated_store

    monkeypatch.setattr(related, "capture_store", emulated_store(fuse="plain"))
    enc = tok(SHORT, return_tensors="pt", padding=True)
    eager = related.generate(**enc, **GREEDY, threshold=threshold, return_dict_in_generate=True)
    fast = related.generate(**enc, **GREEDY, threshold=threshold, speculate=4, llm_max_wait=16,
                            cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(fast.sequences, eager.sequences) and torch.equal(fast.routed, eager.routed)
    state = related.capture_store.state
    kept = [key for key in state.reads if key[0] == "llm" and key[4]]
    assert kept and state.fused["llm"] is not None, "the resolving reads were captured fused"
    assert all(key[4] <= key[1] for key in kept), "a piece keeps at most its own positions"


def test_a_fused_resolving_read_gives_the_eager_logits_at_the_kept_positions(related, tok):
    from r2r_hf.core.abilities import abilities
    from r2r_hf.core.fast.fused_reads import regions_for
    from r2r_hf.core.fast.static_reads import CapturedState
    from r2r_hf.core.layouts.model_calls import EagerCalls
    from r2r_hf.core.layouts.rectangle import Committed
    from r2r_hf.testing.graphs import EmulatedGraphStep

    enc = tok(SHORT, return_tensors="pt", padding=True)
    ids = torch.cat([enc["input_ids"], torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))], 1)
    mask = torch.cat([enc["attention_mask"], torch.ones(2, 12, dtype=torch.long)], 1)
    seq = Committed.from_prompt(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), 64)
    seq.length = ids.shape[1]
    start, keep = enc["input_ids"].shape[1] - 1, [seq.length - 9, seq.length - 6, seq.length - 5, seq.length - 1]
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    state = CapturedState(related.slm, related.llm, related.router, related.config.num_topk_logits,
                          lambda fn, example: EmulatedGraphStep(fn, example, pool), 2, 64, True,
                          fused=(None, regions_for(related.llm, "plain", abilities(related.llm).fuse)))
    eager = EagerCalls(related.slm, related.llm, related.router, related.config.num_topk_logits, "static", 64,
                       caches=(state.slm_cache, state.llm_cache))
    with torch.inference_mode():
        eager.llm_read(_upto(seq, start), 0)
        want = eager.llm_predict(seq, start, seq.length, keep)
        eager.crop(0, seq.length - start)
        got = state.predict(seq, start, seq.length, keep)
    assert got.shape == want.shape == (2, 4, want.shape[-1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert [key[4] for key in state.reads] == [4], "one read of the 13 columns' bucket keeping 4 positions"


def _upto(seq, end):
    """``seq`` as it stood with ``end`` columns committed."""
    import dataclasses

    return dataclasses.replace(seq, length=end)


@pytest.mark.parametrize("at", [5, 11, 17])
def test_a_tail_that_holds_the_answers_end_goes_no_further(identity, tok, at):
    """Once the host sees an EOS in a row's speculative tail, the row drafts no further: the LLM resolves it in the
    next step (before, the SLM drafted on to its depth, past the answer's end)."""
    enc = tok(SHORT[:1], return_tensors="pt")
    options = dict(GREEDY, max_new_tokens=40, eos_token_id=None)
    free = identity.generate(**enc, **options)[0, enc["input_ids"].shape[1]:].tolist()
    eos = free[at]
    end = free.index(eos)  # (the answer ends at its first occurrence)
    want = identity.llm.generate(**enc, **dict(options, eos_token_id=eos))
    out = _r2r(identity, enc, dict(options, eos_token_id=eos), speculate=16, llm_max_wait=64)
    assert torch.equal(out.sequences[:, : want.shape[1]], want) and out.counters["generated"] == end + 1
    assert out.counters["steps"] <= end + 3, "the step after the EOS resolves the tail (the next finds it ended)"
    assert out.counters["slm_forwards"] <= end + 3


def test_generate_returns_what_speculation_did_per_row(related, tok):
    enc = tok(SHORT, return_tensors="pt", padding=True)
    out = _r2r(related, enc, GREEDY, speculate=4, llm_max_wait=16)
    per_row, c = out.speculation, out.counters
    assert set(per_row) == {"pending_resolved", "agreed", "rejected", "thrown", "drafts"}
    assert all(values.shape == (2,) for values in per_row.values())
    assert int(per_row["agreed"].sum()) == c["speculative_agreed"] and int(per_row["thrown"].sum()) == c["thrown"]
    assert int(per_row["rejected"].sum()) == c["speculative_rejected"]
    assert (per_row["pending_resolved"] >= per_row["agreed"] + per_row["rejected"]).all()
    off = related.generate(**enc, **GREEDY, threshold=0.0, return_dict_in_generate=True)
    assert all(int(v.sum()) == 0 for v in off.speculation.values()), "no speculation: zeros"


def test_a_rows_own_depth_bounds_its_tail_and_changes_no_answer(related, tok):
    """A request may lower its depth or turn speculation off (``RowState.depth``): its answer and its neighbours'
    are what they are alone."""
    policy = WaitPolicy((4,), 16, speculate=4)
    rows = {"off": 0, "two": 2, "server's": None}
    run = Driver(related, tok, slots=3, policy=policy)
    for i, (name, depth) in enumerate(rows.items()):
        run.join(name, i, max_new_tokens=14, do_sample=False, threshold=0.0)
        run.batch.ledger.rows[i].depth = depth
    deepest = dict.fromkeys(rows, 0)
    while run.batch.ledger.occupied():
        run.run(1)
        for r, row in enumerate(run.batch.ledger.rows):
            if row is not None:
                deepest[row.owner] = max(deepest[row.owner], len(row.pending))
    for i, name in enumerate(rows):
        assert run.out[name] == _alone(related, tok, i, max_new_tokens=14, do_sample=False, threshold=0.0), name
    assert deepest == {"off": 0, "two": 2, "server's": 4}


def test_a_request_sets_its_own_depth_or_turns_speculation_off_and_sees_what_it_did(related, tok, caplog):
    """Over HTTP: ``speculate`` in the body (0: off, at most the server's depth; else one sentence, a 400); the
    answers are each prompt's answer alone (threshold 0: the LLM's); ``usage.speculation`` counts each request's
    own; ``/metrics`` has acceptance per resolution as a histogram."""
    import concurrent.futures

    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from serving import serving

    from test_batching import PROMPTS

    import logging

    depths = [0, 2, None, 4]
    with caplog.at_level(logging.INFO, logger="r2r_hf.serve.policy"), \
            serving(related, tok, max_batch_size=4, llm_min_rows=(5,), llm_max_wait=16, speculate=4) as (url, _):
        def ask(i):
            body = dict(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0, threshold=0.0)
            if depths[i] is not None:
                body["speculate"] = depths[i]
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()

        with concurrent.futures.ThreadPoolExecutor(len(depths)) as pool:
            answers = list(pool.map(ask, range(len(depths))))
        refused = [httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt="x", max_tokens=2, speculate=v),
                              timeout=30) for v in (5, -1, 1.5)]
        metrics = httpx.get(url + "/metrics", timeout=30).text
    for i, out in enumerate(answers):
        alone = related.llm.generate(**tok([PROMPTS[i]], return_tensors="pt"), max_new_tokens=12, do_sample=False)
        assert out["choices"][0]["text"] == tok.decode(alone[0, len(tok(PROMPTS[i])["input_ids"]):]), i
    spec = [out["usage"]["speculation"] for out in answers]
    assert spec[0] == {"pending_resolved": 0, "agreed": 0, "rejected": 0, "thrown": 0, "drafts": 0}, "off"
    assert all(s["pending_resolved"] > 0 and s["drafts"] > 0 for s in spec[1:])
    for response in refused[:2]:
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "speculate" and "from 0 (off) to 4" in error["message"]
    assert refused[2].status_code == 400 and "speculate" in refused[2].text
    assert any("speculate up to 4 pending positions" in r.getMessage() for r in caplog.records), "said at start-up"
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["r2r_speculation_depth"].samples[0].value == 4
    for name in ("r2r_speculative_accepted", "r2r_speculative_drafted"):
        count = next(s.value for s in families[name].samples if s.name.endswith("_count"))
        assert count == sum(s["drafts"] for s in spec), "one entry per answer and resolution"


def test_a_draft_ends_where_the_slm_is_unsure_and_the_answer_stays_the_llms(related, tok):
    """``draft_confidence``: a row at threshold 0 drafts on only where the SLM's probability of its token is at least
    this; where it is unsure its draft ends with that token (its frontier: as HF assisted generation's drafts end),
    which the LLM judges with the rest. At 1 every draft is one token: each LLM forward judges one position per row
    and writes the next, fewer forwards than without speculation, where the LLM writes one token per forward."""
    enc = tok(SHORT, return_tensors="pt", padding=True)
    want = _llm(related, enc, GREEDY)
    free = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64)
    unsure = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64, draft_confidence=0.6)
    single = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64, draft_confidence=1.0)
    off = _r2r(related, enc, GREEDY)
    for out in (free, unsure, single):
        assert torch.equal(out.sequences, want)
    c, f = unsure.counters, free.counters
    assert 0 < c["speculative_agreed"] + c["speculative_rejected"] < f["speculative_agreed"] + f["speculative_rejected"]
    assert c["speculative_rejected"] <= f["speculative_rejected"]
    n, o = single.counters, off.counters
    assert 0 < n["pending_resolved_per_llm_call"] <= len(SHORT) < f["pending_resolved_per_llm_call"], "one per row"
    assert n["frontier_tokens"] > 0 and n["llm_forwards"] < o["llm_forwards"]


def test_drafts_that_end_by_the_expected_gain_rule_give_the_llms_answer(related, tok):
    """``draft_cost``: a row at threshold 0 ends each draft where one more token no longer pays for itself by the
    SLM's probabilities of its tail (``moves.draft_ends``). Answers are the LLM's at every cost; a dear LLM (a huge
    cost) never ends a draft early, so its drafts are those of a free row; a cheap one (cost -> 0) ends every draft at
    its first token, as ``draft_confidence=1`` does; in between, fewer positions are drafted than without it."""
    enc = tok(SHORT, return_tensors="pt", padding=True)
    want = _llm(related, enc, GREEDY)
    runs = {cost: _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64, fixed_depth=cost is None,
                       **({} if cost is None else {"draft_cost": cost})) for cost in (None, 1e9, 2.5, 1e-9)}
    for out in runs.values():
        assert torch.equal(out.sequences, want)
    drafted = {cost: out.counters["speculative_agreed"] + out.counters["speculative_rejected"]
               for cost, out in runs.items()}
    assert runs[1e9].counters == runs[None].counters, "a dear LLM: drafts as deep as without the rule"
    assert 0 < drafted[2.5] < drafted[None]
    single = runs[1e-9].counters
    assert 0 < single["pending_resolved_per_llm_call"] <= len(SHORT) and single["frontier_tokens"] > 0, "one per row"


def test_draft_cost_auto_is_the_pairs_own_measured_ratio(related, tok):
    """``draft_cost="auto"``: the LLM's read of a draft over the SLM's step, timed once per model on its device
    (``core/costs.py``) and kept: the call drafts as with that number given, and answers as the LLM."""
    from r2r_hf.core.costs import VERIFY_TOKENS, forward_seconds, measured_draft_cost

    enc = tok(SHORT, return_tensors="pt", padding=True)
    auto = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64, draft_cost="auto")
    cost = measured_draft_cost(related.routed_pair())  # (kept from the call's measurement: the same float)
    assert cost == forward_seconds(related.llm, VERIFY_TOKENS) / forward_seconds(related.slm, 1) > 0
    given = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64, draft_cost=cost)
    assert torch.equal(auto.sequences, _llm(related, enc, GREEDY)) and torch.equal(auto.sequences, given.sequences)
    assert auto.counters == given.counters
    unpriced = _r2r(related, enc, GREEDY, speculate=8, llm_max_wait=64)  # (the depth by acceptance)
    assert unpriced.counters != auto.counters, "the setup: the rule drafts otherwise than the default"


def test_a_model_cast_after_its_timing_is_timed_again():
    """The timing is kept per dtype and device: a model cast after its first timing is timed again (else ``auto``
    would weigh an fp32 read's cost for a bf16 model), and each kept value is found again as it was."""
    from r2r_hf.core.costs import forward_seconds
    from r2r_hf.core.notes import notes

    model = make_tiny_slm(seed=5)
    fp32 = forward_seconds(model, 1, repeats=1)
    assert forward_seconds(model, 1) == fp32, "kept: not timed twice"
    model.to(torch.bfloat16)
    bf16 = forward_seconds(model, 1, repeats=1)
    timed = [key for key in notes(model) if key[0] == "forward_seconds"]
    assert sorted(str(key[3]) for key in timed) == ["torch.bfloat16", "torch.float32"] and bf16 > 0
    model.to(torch.float32)
    assert forward_seconds(model, 1) == fp32


def test_speculate_below_holds_back_routed_rows_not_those_that_route_everywhere(identity, tok):
    """Where a row routed by the router runs it, a row at threshold 0 beside it is not held back by the router's
    score (``speculate_below`` decides nothing where every position routes, as where the router does not run)."""
    run = Driver(identity, tok, slots=2, policy=WaitPolicy((2,), 4, speculate=4, speculate_below=0.0))
    jobs = {"lossless": (0, 0.0, 12), "routed": (1, 1.0, 40)}  # (the router runs while the routed row lives)
    for name, (prompt, threshold, new) in jobs.items():
        run.join(name, prompt, max_new_tokens=new, do_sample=False, threshold=threshold)
    run.run(steps=20)
    c = run.batch.counters
    assert c.router_steps == 20 and c.agreed > 0, "the router ran, and the threshold-0 row speculated beside it"
    run.run()
    for name, (prompt, threshold, new) in jobs.items():
        assert run.out[name] == _alone(identity, tok, prompt, max_new_tokens=new, do_sample=False, threshold=threshold)


def test_a_pair_that_cannot_speculate_keeps_no_depths_by_load(identity, monkeypatch):
    """``speculation_for`` turns speculation off for a pair that cannot be cut back: its depths by load go too (a
    depth of 0 is no depth: the server's draft blocks would refuse it)."""
    import dataclasses

    from r2r_hf.core import routing

    pair = identity.routed_pair()
    cannot = dataclasses.replace(pair.abilities.llm, rollback="a test's reason")
    pair = dataclasses.replace(pair, abilities=dataclasses.replace(pair.abilities, llm=cannot))
    policy = speculative_policy("cuda", 4, 8)
    off = routing.speculation_for(policy, pair)
    assert policy.depths and off.speculate == 0 and off.depths == ()
