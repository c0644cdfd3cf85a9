"""Speculative routing (core/speculation.py, issue 43): a routed row goes on with the SLM's token and one shared LLM
forward later confirms or corrects it. Every answer and its routing record equal R2R's without speculation, token for
token: the server's slots with rows joining, waiting and leaving under several policies, and ``generate`` (batch 1
greedy and sampled, left-padded batches greedy), with budgets, processors that read the prefix, EOS, stop strings and
the length limit inside a speculative tail; threshold 0 with speculation equals ``llm.generate``.

Two pairs exercise both paths: the tiny random pair disagrees almost everywhere (rollbacks at nearly every routed
position), and a related pair (the LLM a perturbed copy of the SLM) mostly agrees (long tails confirmed, several
pending positions resolved in one LLM forward).
"""

import logging
import re

import pytest
import torch
from conftest import PROMPTS as SHORT
from conftest import SMALL_ROUTER

from r2r_hf import R2RForCausalLM
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing import make_related_llm, make_tiny_slm
from test_batching import PROMPTS, Driver, _alone, _threshold

POLICIES = [WaitPolicy((2,), 8, speculate=2), WaitPolicy((4,), 32, speculate=4), WaitPolicy((6,), 64, speculate=8)]


@pytest.fixture(scope="module")
def related():
    """A pair that mostly agrees, as a real small and large model of one family do."""
    slm = make_tiny_slm()
    return R2RForCausalLM.from_models(slm, make_related_llm(slm), **SMALL_ROUTER)


def _pair(request, which: str):
    return request.getfixturevalue("model" if which == "disagreeing" else "related")


def _eos_inside(model, tok, prompt: int, index: int, **options) -> int:
    """A token the answer writes at ``index``: as EOS the answer ends there (inside a tail where it speculates)."""
    return _alone(model, tok, prompt, **options)[index][0]


@pytest.mark.parametrize("which", ["disagreeing", "agreeing"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"m{p.min_rows[0]}-w{p.max_wait}-s{p.speculate}")
def test_served_rows_answer_as_generate_alone(request, tok, which, policy):
    model = _pair(request, which)
    tau = _threshold(model, tok, 0.3)
    eos = _eos_inside(model, tok, 1, 9, max_new_tokens=14, do_sample=False, threshold=tau)
    rows = {
        "greedy": (0, dict(max_new_tokens=9, do_sample=False, threshold=tau)),
        "eos": (1, dict(max_new_tokens=14, do_sample=False, threshold=tau, eos_token_id=eos)),
        "sampled": (2, dict(max_new_tokens=11, do_sample=True, temperature=0.9, top_k=20, seed=7, threshold=tau)),
        "budget": (4, dict(max_new_tokens=12, do_sample=False, threshold=0.0, llm_budget=0.3)),
        "penalty": (5, dict(max_new_tokens=10, do_sample=False, threshold=tau, repetition_penalty=1.4,
                            no_repeat_ngram_size=2)),
        "always": (3, dict(max_new_tokens=5, do_sample=True, temperature=1.1, seed=3, threshold=0.0)),
    }
    run = Driver(model, tok, slots=5, policy=policy)
    order = list(rows)
    for name in order[:4]:
        run.join(name, rows[name][0], **rows[name][1])
    run.run(4)  # the others join while the first speculate
    run.join(order[4], rows[order[4]][0], **rows[order[4]][1])
    while run.batch.ledger.free_slots() == 0:
        run.run(1)
    run.join(order[5], rows[order[5]][0], **rows[order[5]][1])  # into a slot a finished row left
    run.run()
    for name, (prompt, options) in rows.items():
        assert run.out[name] == _alone(model, tok, prompt, **dict(options)), name
    c = run.batch.counters
    assert c.llm_tokens == sum(by_llm for out in run.out.values() for _, by_llm in out)
    assert c.generated == sum(len(out) for out in run.out.values())
    assert c.agreed + c.rejected > 0, "pending positions were resolved"
    if which == "disagreeing":
        assert c.rejected > 0 and c.thrown > 0, "rollbacks"
    else:
        assert c.agreed > c.rejected and c.agreed + c.rejected > c.resolutions, "several positions per LLM forward"


def _gen(model, enc, sampling: bool, **options):
    gen = dict(max_new_tokens=18, do_sample=sampling, pad_token_id=0, eos_token_id=2, return_dict_in_generate=True)
    if sampling:
        gen.update(temperature=0.9, top_k=30)
    torch.manual_seed(11)
    out = model.generate(**enc, **{**gen, **options})
    return out, torch.get_rng_state()


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.routed, b.routed) and torch.equal(a.generated_mask, b.generated_mask)
    torch.testing.assert_close(a.router_scores, b.router_scores, equal_nan=True)
    assert torch.equal(a.llm_tokens, b.llm_tokens)


@pytest.mark.parametrize("which", ["disagreeing", "agreeing"])
@pytest.mark.parametrize("rows, sampling", [(1, False), (1, True), (2, False)], ids=["one-greedy", "one-seeded",
                                                                                    "batch-greedy"])
def test_generate_speculating_equals_generate(request, tok, which, rows, sampling):
    model = _pair(request, which)
    enc = tok(SHORT[:rows], return_tensors="pt", padding=True)
    probe, _ = _gen(model, enc, sampling, threshold=float("inf"))
    scores = probe.router_scores[probe.generated_mask].sort().values
    tau = float((scores[len(scores) // 3] + scores[len(scores) // 3 + 1]) / 2)
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    for threshold in (tau, 0.0):
        base, state = _gen(model, enc, sampling, threshold=threshold, **options)
        routed = (base.router_scores[base.routed] if threshold else scores).sort().values  # (0 scores nothing)
        below = float(routed[len(routed) // 2])  # half the routed positions speculate, the surer half waits
        for speculate, wait, bound in ((2, 4, None), (8, 64, None), (4, 16, below)):
            fast, fast_state = _gen(model, enc, sampling, threshold=threshold, speculate=speculate, llm_max_wait=wait,
                                    speculate_below=bound, **options)
            _same(fast, base)
            assert torch.equal(fast_state, state), "the global stream stands where R2R's draws left it"
            assert fast.counters["agreement_at_routed"] is not None, "it speculated"
    if not sampling or rows == 1:
        torch.manual_seed(11)
        want = model.llm.generate(**enc, max_new_tokens=18, do_sample=sampling, pad_token_id=0, eos_token_id=2,
                                  **options, **({"temperature": 0.9, "top_k": 30} if sampling else {}))
        fast, _ = _gen(model, enc, sampling, threshold=0.0, speculate=8, llm_max_wait=64, **options)
        assert torch.equal(fast.sequences, want), "threshold 0 with speculation: the LLM's own answer"


def test_stops_inside_a_tail_end_the_answer_where_r2r_ends_it(related, tok):
    """EOS, a stop string and the length limit are checked on confirmed tokens only: an answer that ends inside a
    speculative tail ends there, and the streamer sees exactly R2R's tokens."""
    from transformers.generation.streamers import BaseStreamer

    class Keep(BaseStreamer):
        def __init__(self):
            self.values = []

        def put(self, value):
            self.values.append(value.reshape(-1).tolist())

        def end(self):
            pass

    enc = tok(SHORT[:1], return_tensors="pt")
    base, _ = _gen(related, enc, False, threshold=0.0)
    text = tok.decode(base.sequences[0, enc["input_ids"].shape[1] + 8 :])
    for options in ({"eos_token_id": int(base.sequences[0, enc["input_ids"].shape[1] + 7])},
                    {"stop_strings": [text[:3]], "tokenizer": tok}, {"max_new_tokens": 7}):
        kept = {}
        for speculate in (0, 8):
            streamer = Keep()
            out, _ = _gen(related, enc, False, threshold=0.0, speculate=speculate, llm_max_wait=64, streamer=streamer,
                          **options)
            kept[speculate] = (out, streamer.values)
        _same(kept[8][0], kept[0][0])
        assert kept[8][1] == kept[0][1], options


def test_a_sampled_batch_does_not_speculate_and_says_so_once(model, tok, caplog, monkeypatch):
    """One random stream draws every row of a sampled batch: a row's rollback would move it for all, so such a call
    runs without speculation (and answers as it would), said once."""
    from r2r_hf.core import policy

    monkeypatch.setattr(policy, "_said", set())
    enc = tok(SHORT, return_tensors="pt", padding=True)
    base, _ = _gen(model, enc, True, threshold=0.5)
    with caplog.at_level(logging.WARNING, logger="r2r_hf.core.policy"):
        for _ in range(2):
            out, _ = _gen(model, enc, True, threshold=0.5, speculate=4)
            _same(out, base)
            assert out.counters["agreement_at_routed"] is None, "it did not speculate"
    said = [r.getMessage() for r in caplog.records if "speculation is off" in r.getMessage()]
    assert len(said) == 1 and "one random stream" in said[0]


def test_speculate_is_saved_with_the_router_like_the_threshold(model, tmp_path):
    model.generation_config.speculate = 4
    model.generation_config.llm_max_wait = 16
    try:
        model.save_pretrained(tmp_path)
    finally:
        del model.generation_config.speculate, model.generation_config.llm_max_wait
    again = R2RForCausalLM.from_pretrained(tmp_path, slm=model.slm, llm=model.llm)
    assert (again.generation_config.speculate, again.generation_config.llm_max_wait) == (4, 16)


def test_the_server_speculates_below_what_the_router_was_saved_with_unless_told(model, tok, tmp_path):
    """A router is saved with speculate_below (the shipped one with 0.7: at and above it the LLM agreed at 54-83 % of
    routed positions, below at 90-92 %); `generate` reads it from the router's generation config, and so does the
    server."""
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings

    model.generation_config.speculate_below = 0.95
    try:
        model.save_pretrained(tmp_path)
    finally:
        del model.generation_config.speculate_below
    again = R2RForCausalLM.from_pretrained(tmp_path, slm=model.slm, llm=model.llm)
    assert again.generation_config.speculate_below == 0.95
    saved, told = (Engine(again, tok, ServeSettings(speculate=4, capture="off", **flag))
                   for flag in ({}, {"speculate_below": 0.5}))
    try:
        assert saved.policy.speculate_below == 0.95
        assert told.policy.speculate_below == 0.5, "the flag wins"
    finally:
        saved.stop(0), told.stop(0)  # (never started: nothing to wait for)


def test_a_server_started_with_draft_cost_auto_times_its_pair(model, tok):
    """``--draft-cost auto``: the server's policy weighs the pair's own ratio, timed when it starts
    (``core/costs.py``), and the command line takes the word or a number only."""
    from r2r_hf.cli.main import build_parser
    from r2r_hf.core.costs import measured_draft_cost
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings

    engine = Engine(model, tok, ServeSettings(speculate=4, capture="off", draft_cost="auto"))
    try:
        assert engine.policy.draft_cost == measured_draft_cost(model.routed_pair()) > 0
    finally:
        engine.stop(0)  # (never started: nothing to wait for)
    parse = lambda *flag: build_parser().parse_args(["serve", "r", "--speculate", "4", *flag])  # noqa: E731
    assert parse("--draft-cost", "auto").draft_cost == "auto" and parse("--draft-cost", "2.5").draft_cost == 2.5
    with pytest.raises(SystemExit):
        parse("--draft-cost", "measure")


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_a_speculation_depth_that_is_not_a_count_is_refused(model, tok, value):
    with pytest.raises(ValueError, match="speculate must be a whole number"):
        model.generate(**tok(SHORT[:1], return_tensors="pt"), max_new_tokens=2, speculate=value)


@pytest.mark.parametrize("rows", [1, 2])
def test_captured_generate_speculating_equals_eager(related, tok, monkeypatch, rows):
    """On the fast path (static caches, emulated CUDA graphs) a rollback moves the static caches' lengths back; the
    LLM's resolving reads run eagerly over the same caches."""
    from r2r_hf.testing.graphs import emulated_store

    monkeypatch.setattr(related, "capture_store", emulated_store())
    enc = tok(SHORT[:rows], return_tensors="pt", padding=True)
    for threshold in (0.45, 0.0):
        eager, _ = _gen(related, enc, False, threshold=threshold)
        fast, _ = _gen(related, enc, False, threshold=threshold, speculate=4, llm_max_wait=16,
                       cache_implementation="static")
        _same(fast, eager)
        assert fast.counters["agreement_at_routed"] is not None
    assert any(key[4] for key in related.capture_store.state.reads), "the resolving reads were captured too"


def test_the_server_speculates_streams_confirmed_tokens_and_counts_what_it_did(related, tok):
    """Over HTTP: answers (streamed and not) equal generate alone, and /metrics counts confirmed tokens only, with
    what the LLM confirmed, replaced and threw away."""
    import concurrent.futures

    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from serving import generated, serving

    prompts = [PROMPTS[i] for i in (0, 1, 2, 4)]
    with serving(related, tok, max_batch_size=3, llm_min_rows=(3,), llm_max_wait=16, speculate=4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i):
            options = dict(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, extra_body={"threshold": 0.4})
            if i % 2:
                out = client.completions.create(**options)
                return out.choices[0].text, out.usage.completion_tokens
            chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, range(len(prompts))))
        text = httpx.get(url + "/metrics", timeout=30).text
    for prompt, (answer, _) in zip(prompts, answers):
        assert answer == generated(related, tok, prompt, 12, do_sample=False, threshold=0.4)[0], prompt
    value = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.samples}
    assert value["r2r_generated_tokens"] == sum(n for _, n in answers), "confirmed tokens only, none past an end"
    assert value["r2r_speculative_agreed"] > 0 and "r2r_speculative_thrown_tokens" in value


@pytest.mark.parametrize("option, value, words", [
    ("llm_max_wait", -1, "llm_max_wait must be a whole number"),
    ("speculate_below", float("nan"), "speculate_below must be a router"),
    ("draft_confidence", 1.5, "draft_confidence must be a probability"),
    ("fixed_depth", "yes", "fixed_depth must be True or False"),
    ("draft_cost", -1.0, "draft_cost must be an LLM forward's cost in SLM steps"),
    ("draft_cost", "measure", "e.g. 2.5; 0: off. or 'auto' .measured on the pair's device., got 'measure'"),
])
def test_speculations_options_are_checked_with_speculation_off(model, tok, option, value, words):
    """Issue 52, item 8: with speculation off they were accepted whatever they were."""
    with pytest.raises(ValueError, match=words):
        model.generate(**tok(SHORT[:1], return_tensors="pt"), max_new_tokens=2, **{option: value})


@pytest.mark.parametrize("settings, words", [
    (dict(speculate_below=0.9), "speculate_below=0.9 has no effect without speculate"),
    (dict(draft_confidence=0.4), "draft_confidence=0.4 has no effect without speculate"),
    (dict(fixed_depth=True), "fixed_depth=True has no effect without speculate"),
    (dict(draft_cost=2.5), "draft_cost=2.5 has no effect without speculate"),
    (dict(speculate=4, draft_cost=2.5, fixed_depth=True), "fixed_depth and draft_cost each choose where a draft ends"),
    (dict(speculate=4, llm_max_wait=0), "never speculates: with llm_max_wait=0"),
    (dict(speculate=4, llm_min_rows=(1,)), "never speculates: with llm_min_rows=(1,)"),
])
def test_server_settings_under_which_speculation_cannot_happen_are_refused(settings, words):
    """Issue 52, item 8: such a server started without a word (and never speculated)."""
    from r2r_hf.serve.settings import ServeSettings

    with pytest.raises(ValueError, match=re.escape(words)):
        ServeSettings(**settings)
    ServeSettings(speculate=4, llm_min_rows=(1, 2), llm_max_wait=1)  # a count that waits: it can speculate
    ServeSettings(speculate=4, draft_cost="auto")  # (timed when the server starts: ``serve.policy``)
