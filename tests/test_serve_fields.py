"""Request fields: vLLM's sampling fields honoured exactly as ``generate`` honours their HF options, every other field
the server does not know refused by name (issue 52, item 2: each was answered 200 and ignored).

``repetition_penalty``, ``min_p``, ``min_tokens`` (HF's ``min_new_tokens``), ``ignore_eos`` (no EOS: HF's
``eos_token_id=None``) and ``stop_token_ids`` (more EOS ids) sent through the official ``openai`` client's
``extra_body`` give the answer ``generate`` gives alone with those options: the same text, finish reason, token
count and LLM tokens. Tiny fp32 models over loopback; the routing threshold sits in a gap of the router's scores, so
answers are mixed-routed.
"""

import json

import httpx
import openai
import pytest

from serving import gap_threshold, serving

PROMPT = "the old man said that he was"
MAX = 12


@pytest.fixture(scope="module")
def served(model, tok):
    with serving(model, tok) as (url, service):
        yield url, service


@pytest.fixture(scope="module")
def tau(model, tok):
    return gap_threshold(model, tok, [PROMPT, "water"], 0.4, 0.9)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _eos_list(eos) -> list[int]:
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _alone(model, tok, ids: list[int], max_tokens: int, stop: str | None = None, min_tokens: int = 0,
           **options) -> tuple:
    """``generate`` alone: (text, finish reason, completion tokens, LLM tokens) as an OpenAI server reports them:
    an EOS ends the answer without its text; a stop string ends it before the string, at the token that completed
    it, counting only one that ends in text written once ``min_tokens`` were (vLLM's rule)."""
    import torch

    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_tokens, return_dict_in_generate=True,
                         **({"min_new_tokens": min_tokens} if min_tokens else {}), **options)
    new, routed = out.sequences[0, len(ids):].tolist(), out.routed[0].tolist()
    eos = _eos_list(options["eos_token_id"] if "eos_token_id" in options else model.generation_config.eos_token_id)
    finish = "stop" if new and new[-1] in eos else "length"
    kept = new[:-1] if finish == "stop" else new
    text = tok.decode(kept, skip_special_tokens=True)
    if stop is not None:
        floor = len(tok.decode(kept[: max(min_tokens - 1, 0)], skip_special_tokens=True))
        for t in range(max(min_tokens, 1), len(kept) + 1):
            at = tok.decode(kept[:t], skip_special_tokens=True).find(stop, max(floor - len(stop) + 1, 0))
            if at >= 0:
                return text[:at], "stop", t, sum(routed[:t])
    return text, finish, len(new), int(out.llm_tokens[0])


def _served(url: str, prompt: str, max_tokens: int, stop=None, **extra) -> tuple:
    sampling = {k: extra.pop(k) for k in ("temperature", "seed") if k in extra}
    out = _client(url).completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stop=stop,
                                          extra_body=extra, **sampling)
    choice = out.choices[0]
    return choice.text, choice.finish_reason, out.usage.completion_tokens, out.model_extra["r2r"]["llm_tokens"]


def _greedy_tokens(model, ids, tau):
    import torch

    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX, do_sample=False, threshold=tau,
                         eos_token_id=None)
    return out[0, len(ids):].tolist()


def test_vllms_penalty_and_min_p_are_generates(served, model, tok, tau):
    url, _ = served
    ids = tok(PROMPT)["input_ids"]
    greedy = dict(temperature=0, threshold=tau)
    plain = _served(url, PROMPT, MAX, **greedy)
    got = _served(url, PROMPT, MAX, repetition_penalty=0.5, **greedy)
    assert got == _alone(model, tok, ids, MAX, do_sample=False, threshold=tau, repetition_penalty=0.5)
    assert got[0] != plain[0], "the penalty changes this answer"
    llm = got[3] + plain[3]
    sampled = dict(temperature=2.0, seed=11, threshold=tau)  # the tiny models' distributions are peaked: flatten
    plain = _served(url, PROMPT, MAX, **sampled)
    got = _served(url, PROMPT, MAX, min_p=0.2, **sampled)
    assert got == _alone(model, tok, ids, MAX, do_sample=True, temperature=2.0, seed=11, threshold=tau, min_p=0.2)
    assert got[0] != plain[0], "min_p changes this answer"
    assert 0 < llm + got[3] + plain[3] < 4 * MAX, "mixed routing: the LLM wrote some tokens, not all"


def test_eos_fields_end_answers_as_generate_does(served, model, tok, tau, monkeypatch):
    """The model's EOS made the answer's 4th token: ``min_tokens`` holds it back, ``ignore_eos`` writes past it,
    ``stop_token_ids`` end the answer at other tokens (with or without the EOS)."""
    url, _ = served
    ids = tok(PROMPT)["input_ids"]
    tokens = _greedy_tokens(model, ids, tau)
    first = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    eos, stop_id = next((t, s) for t, i in first.items() if i >= 3 for s, j in first.items() if 0 < j < i)
    monkeypatch.setattr(model.generation_config, "eos_token_id", eos)
    greedy = dict(do_sample=False, threshold=tau)
    ask = dict(temperature=0, threshold=tau)
    ended = _served(url, PROMPT, MAX, **ask)
    assert ended == _alone(model, tok, ids, MAX, **greedy) and ended[1] == "stop" and ended[2] == first[eos] + 1
    cases = [  # (request fields, generate's options)
        ({"min_tokens": first[eos] + 3}, {"min_tokens": first[eos] + 3}),
        ({"ignore_eos": True}, {"eos_token_id": None}),
        ({"stop_token_ids": [stop_id]}, {"eos_token_id": [eos, stop_id]}),
        ({"stop_token_ids": [stop_id], "ignore_eos": True}, {"eos_token_id": [stop_id]}),
        ({"stop_token_ids": [stop_id], "min_tokens": first[stop_id] + 2},
         {"eos_token_id": [eos, stop_id], "min_tokens": first[stop_id] + 2}),
    ]
    for fields, options in cases:
        got = _served(url, PROMPT, MAX, **ask, **fields)
        assert got == _alone(model, tok, ids, MAX, **greedy, **options), fields
        assert got != ended, f"{fields} change the answer"
    assert _served(url, PROMPT, MAX, **ask, ignore_eos=True)[1:3] == ("length", MAX)


def test_min_tokens_holds_stop_strings_back_as_vllm_does(served, model, tok, tau):
    """vLLM looks for a stop string only in text written once ``min_tokens`` were: an earlier one does not end the
    answer."""
    url, _ = served
    ids = tok(PROMPT)["input_ids"]
    ask, greedy = dict(temperature=0, threshold=tau), dict(do_sample=False, threshold=tau)
    tokens = _greedy_tokens(model, ids, tau)
    text = tok.decode(tokens, skip_special_tokens=True)
    heads = ((k, tok.decode(tokens[:k], skip_special_tokens=True)) for k in range(2, MAX - 2))
    k, stop = next((k, c) for k, head in heads for c in head if c in text[len(head):])  # early, and again later
    early = _served(url, PROMPT, MAX, stop=[stop], **ask)
    assert early == _alone(model, tok, ids, MAX, stop=stop, **greedy)
    late = _served(url, PROMPT, MAX, stop=[stop], min_tokens=k + 1, **ask)
    assert late == _alone(model, tok, ids, MAX, stop=stop, min_tokens=k + 1, **greedy)
    assert len(late[0]) > len(early[0])


def test_the_chat_endpoint_takes_them_too(served, model, tok, tau):
    url, _ = served
    messages = [{"role": "user", "content": "water is"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    out = _client(url).chat.completions.create(model="tiny", messages=messages, max_completion_tokens=MAX,
                                               temperature=0, extra_body={"threshold": tau, "repetition_penalty": 0.5})
    want = _alone(model, tok, ids, MAX, do_sample=False, threshold=tau, repetition_penalty=0.5)
    assert (out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens) == want[:3]


@pytest.mark.parametrize("path, field, value, words", [
    ("/v1/completions", "thresold", 0.5, "did you mean 'threshold'"),
    ("/v1/completions", "max_completion_tokens", 5, "/v1/completions takes max_tokens"),
    ("/v1/completions", "guided_json", {"type": "object"}, "not a field this server takes"),
    ("/v1/chat/completions", "top_kk", 3, "did you mean 'top_k'"),
    ("/v1/completions", "repetition_penalty", 0, "greater than 0"),
    ("/v1/completions", "repetition_penalty", float("nan"), "NaN is not a number"),
    ("/v1/completions", "min_p", 1.5, "less than or equal to 1"),
    ("/v1/completions", "min_tokens", -1, "greater than or equal to 0"),
    ("/v1/completions", "min_tokens", 10**30, "is more than max_tokens=2; send min_tokens of at most 2"),  # issue 59
    ("/v1/chat/completions", "min_tokens", 3, "is more than max_tokens=2; send min_tokens of at most 2"),
    ("/v1/completions", "speculate", 1, "this server does not speculate (it was started without --speculate); send 0 "
                                        "or leave speculate out, or start it with --speculate 1 or more"),  # issue 59
    ("/v1/completions", "ignore_eos", "yes", "valid boolean"),
    ("/v1/completions", "stop_token_ids", [5, 10**9], "outside the vocabulary"),
    ("/v1/completions", "tool_choice", "required", "not supported"),
])
def test_unknown_fields_and_bad_values_are_refused_by_name(served, path, field, value, words):
    url, _ = served
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "water"}]} if "chat" in path else {"prompt": "water"})
    content = json.dumps(body).encode()  # NaN as Python writes it
    reply = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"] and words in error["message"], error
    assert error["message"].count(". ") == 0, "one sentence"


def test_min_tokens_past_the_default_max_tokens_is_refused_by_both_names(served):
    """Issue 59, item 4: min_tokens above what the answer may write was accepted; without max_tokens, the limit is
    the default (16 on /v1/completions, as OpenAI's)."""
    url, _ = served
    reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "water", "min_tokens": 17}, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "min_tokens", error
    assert error["message"] == ("min_tokens=17 is more than the 16 tokens this answer may write (no max_tokens sent); "
                                "send min_tokens of at most 16 or a larger max_tokens.")
    body = {"model": "tiny", "prompt": "water", "min_tokens": 16, "max_tokens": 16, "ignore_eos": True}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_speculate_on_a_server_that_does_not_speculate_says_why_and_what_to_do():
    """Issue 59, item 4: it said "send a whole number from 0 (off) to 0"; where --speculate was given but the pair
    cannot speculate, starting with --speculate is no remedy."""
    from r2r_hf.core.policy import WaitPolicy
    from r2r_hf.serve.errors import APIError
    from r2r_hf.serve.policy import request_depth

    def refusal(asked: int, depth: int, flag: int) -> str:
        with pytest.raises(APIError) as err:
            request_depth(asked, WaitPolicy((2,), 4, speculate=depth), flag)
        assert err.value.param == "speculate"
        return err.value.message

    assert refusal(2, 0, 4) == ("speculate=2 cannot be honoured: this server does not speculate (its models cannot be "
                                "cut back after a rejected position); send 0 or leave speculate out.")
    assert refusal(3, 0, 0).endswith("(it was started without --speculate); send 0 or leave speculate out, or start it "
                                     "with --speculate 3 or more.")
    assert refusal(-1, 0, 0).endswith("send 0 or leave speculate out.") and "from 0 (off) to 4" in refusal(5, 4, 4)
    assert request_depth(0, WaitPolicy(), 0) == 0


def test_fields_that_change_nothing_here_are_taken(served):
    """What OpenAI's clients send that no answer depends on (an end user's id, metadata, storage) is taken."""
    url, _ = served
    for extra in ({"user": "me"}, {"metadata": {"run": "1"}}, {"store": False}, {"tool_choice": "none"}):
        body = {"model": "tiny", "prompt": "water", "max_tokens": 2, **extra}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200, extra
