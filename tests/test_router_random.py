"""The ``random`` baseline router in a decoding loop (issue 52, items 3 and 4): each row's scores come from its own
stream, keyed by the row's seed and the answer position, so a row routes as it routes alone whatever its neighbours,
a speculative rollback that re-proposes a position draws what was drawn there, and a server answers a request as
``generate`` alone does, the same every time it is sent.

The row's seed is the request's (choice i: seed + i) or ``generate``'s ``seed``, else the router's own. Tiny models;
the disagreeing pair rolls back at nearly every routed position.
"""

import concurrent.futures

import openai
import pytest
import torch
from conftest import PROMPTS

from r2r_hf import R2RForCausalLM
from r2r_hf import router as routers
from r2r_hf.router import RandomRouter
from serving import serving

GREEDY = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=2, return_dict_in_generate=True)
SAMPLING = dict(GREEDY, do_sample=True, temperature=0.9, top_k=30)


@pytest.fixture(scope="module")
def coin(slm, llm):
    """The tiny (disagreeing) pair with the random router at 0.5: about half the tokens route."""
    return R2RForCausalLM.from_models(slm, llm, router_type="random", threshold=0.5)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.routed, b.routed)
    assert torch.equal(a.router_scores, b.router_scores)


def test_a_rows_scores_are_its_own_stream_at_each_answer_position(coin, tok):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    batch = coin.generate(**enc, **GREEDY)
    for r, prompt in enumerate(PROMPTS):
        alone = coin.generate(**tok([prompt], return_tensors="pt"), **GREEDY)
        n = int(alone.generated_mask.sum())
        assert torch.equal(batch.router_scores[r, :n], alone.router_scores[0, :n]), "alone as in a batch"
    want = torch.tensor([routers.uniform(coin.router.seed, i) for i in range(GREEDY["max_new_tokens"])])
    assert torch.equal(batch.router_scores[0], want), "score i is the stream's value at position i"
    seeded = coin.generate(**enc, **GREEDY, seed=5)
    want = torch.tensor([routers.uniform(5, i) for i in range(14)])
    assert torch.equal(seeded.router_scores[0], want), "a call's seed keys its rows"
    assert 0.2 < batch.routed[batch.generated_mask].float().mean() < 0.8


@pytest.mark.parametrize("rows, options", [(1, GREEDY), (1, SAMPLING), (2, GREEDY)],
                         ids=["one-greedy", "one-seeded", "batch-greedy"])
def test_speculating_with_the_random_router_changes_nothing(coin, tok, rows, options):
    enc = tok(PROMPTS[:rows], return_tensors="pt", padding=True)
    extra = {"seed": 3} if options["do_sample"] else {}
    base = coin.generate(**enc, **options, **extra)
    for speculate, wait in ((2, 4), (8, 64)):
        fast = coin.generate(**enc, **options, **extra, speculate=speculate, llm_max_wait=wait)
        _same(fast, base)
        assert fast.counters["speculative_rejected"] > 0, "rollbacks re-proposed positions"


def _text(model, tok, prompt, **options):
    enc = tok([prompt], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=10, return_dict_in_generate=True, **options)
    return tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True), int(out.llm_tokens[0])


@pytest.mark.parametrize("speculate", [0, 4])
def test_a_served_answer_is_generate_alone_every_time_it_is_sent(coin, tok, speculate):
    def ask(client, prompt, **extra):
        sampling = {k: extra.pop(k) for k in ("temperature", "seed", "n") if k in extra}
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body=extra, **sampling)
        return [(c.text, c.model_extra) for c in out.choices], out.model_extra["r2r"]["llm_tokens"]

    jobs = [(PROMPTS[0], {"temperature": 0}), (PROMPTS[1], {"temperature": 0, "seed": 9}),
            (PROMPTS[0], {"temperature": 1.0, "seed": 4, "n": 2})]
    with serving(coin, tok, max_batch_size=4, speculate=speculate, llm_min_rows=(2,),
                 llm_max_wait=4 if speculate else 0) as (url, service):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        first = [ask(client, p, **dict(e)) for p, e in jobs]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # sent again, side by side
            again = list(pool.map(lambda job: ask(client, job[0], **dict(job[1])), jobs))
        counters = service.engine.counters
    assert again == first, "the same request, the same answer"
    assert first[0][0][0][0], "an answer"
    assert [t for t, _ in first[0][0]] == [_text(coin, tok, PROMPTS[0], do_sample=False)[0]]
    assert first[0][1] == _text(coin, tok, PROMPTS[0], do_sample=False)[1]
    assert first[1][0][0][0] == _text(coin, tok, PROMPTS[1], do_sample=False, seed=9)[0], "keyed by its seed"
    for i in range(2):  # choice i draws from seed + i, its routing too
        want = _text(coin, tok, PROMPTS[0], do_sample=True, temperature=1.0, seed=4 + i)[0]
        assert first[2][0][i][0] == want
    if speculate:
        assert counters.rejected > 0, "it speculated and rolled back"


def test_outside_a_loop_it_draws_from_its_private_generator():
    router = RandomRouter(seed=3)
    first = router.scores(torch.zeros(4, 2), None, None)
    router.reset()
    assert torch.equal(first, router.scores(torch.zeros(4, 2), None, None))
    values = [routers.uniform(7, i) for i in range(1000)]
    assert all(0 <= v < 1 for v in values) and 0.45 < sum(values) / len(values) < 0.55
    assert routers.uniform(7, 0) != routers.uniform(8, 0) != routers.uniform(7, 1)
