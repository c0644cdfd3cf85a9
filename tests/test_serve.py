"""The OpenAI-compatible server, over loopback, with the official ``openai`` client and raw HTTP.

Tiny fp32 models: greedy answers must be the same token for token whether a request ran alone, in
a batch, or joined a batch mid-way, and the same as ``model.generate``.
"""

import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest

from serving import serving, slow_decoding

PROMPTS = ["the old man said that he was", "water", "write a new line", "the first time you see", "def print",
           "he was a good man and"]


def _client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


def _threshold(model, tok) -> float:
    """A threshold inside the router's score range, away from every score (mixed routing, no float near-ties)."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    probe = model.generate(**enc, max_new_tokens=12, do_sample=False, threshold=float("inf"), return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask].sort().values
    gaps = scores[1:] - scores[:-1]
    middle = slice(len(gaps) // 4, 3 * len(gaps) // 4)
    i = middle.start + int(gaps[middle].argmax())
    return float((scores[i] + scores[i + 1]) / 2)


@pytest.fixture(scope="module")
def served(model, tok):
    with serving(model, tok, max_batch_size=8) as (url, service):
        yield url, service


def test_models_completions_chat_and_streams_with_the_openai_client(served, model, tok):
    url, _ = served
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens >= 1
    r2r = done.model_extra["r2r"]
    assert r2r["generated_tokens"] == done.usage.completion_tokens and r2r["threshold"] == model.config.threshold
    assert 0 <= r2r["llm_tokens"] <= r2r["generated_tokens"]

    messages = [{"role": "user", "content": "water is"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].model_extra["r2r"] == whole.model_extra["r2r"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason

    everything = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                           extra_body={"threshold": 0.0})
    nothing = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                        extra_body={"threshold": 2.0})
    assert everything.model_extra["r2r"]["llm_token_rate"] == 1.0 and everything.model_extra["r2r"]["threshold"] == 0
    assert nothing.model_extra["r2r"]["llm_token_rate"] == 0.0


def _alone_and_together(url, jobs):
    client = _client(url, timeout=120)

    def ask(job):
        prompt, max_tokens, threshold = job
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body={"threshold": threshold})
        return out.choices[0].text, out.model_extra["r2r"]["llm_tokens"]

    alone = [ask(job) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(ask, jobs))
    return alone, together


def _peak_rows_while(service, work):
    """The most rows one step decoded while ``work()`` ran, and its result."""
    service.engine.peak_rows = 0
    result = work()
    return service.engine.peak_rows, result


def test_greedy_answers_are_the_same_alone_in_a_batch_and_from_generate(served, model, tok):
    url, service = served
    threshold = _threshold(model, tok)
    jobs = [(p, 6 + 3 * i, threshold if i % 3 else threshold + 0.01 * (i - 3)) for i, p in enumerate(PROMPTS)]
    alone, together = _alone_and_together(url, jobs)
    assert together == alone
    peak, again = _peak_rows_while(service, lambda: _alone_and_together(url, jobs)[1])
    assert again == alone and peak > 1, "the concurrent requests were decoded in one batch"
    assert any(0 < llm < 6 for _, llm in alone), "mixed routing"
    for (prompt, max_tokens, t), (text, _) in zip(jobs, alone):
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, threshold=t)
        assert text == tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_a_request_joins_a_running_batch_at_the_next_step(served, model, tok):
    url, service = served
    threshold = _threshold(model, tok)
    short = (PROMPTS[3], 5, threshold)
    expected_short = _alone_and_together(url, [short])[0][0]
    joins = service.engine.joins_running
    events = []
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400,
                                                    "temperature": 0, "threshold": threshold, "stream": True}) as long:
        lines = long.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        answer = _client(url).completions.create(model="tiny", prompt=short[0], max_tokens=5, temperature=0,
                                                 extra_body={"threshold": threshold})
        events.append("short done")
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "length"
    assert (answer.choices[0].text, answer.model_extra["r2r"]["llm_tokens"]) == expected_short
    assert service.engine.joins_running > joins, "the short request joined the long one's batch"



def test_rows_with_their_own_budgets_join_and_leave_a_batch_and_answer_as_generate_alone(served, model, tok):
    url, service = served
    joins = service.engine.joins_running

    def alone(prompt: str, max_tokens: int, budget: float) -> tuple[str, int]:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, threshold=0.0, llm_budget=budget,
                             return_dict_in_generate=True)
        return tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True), int(out.llm_tokens[0])

    with httpx.Client(timeout=120) as http, http.stream(
            "POST", url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 120,
                                                    "temperature": 0, "threshold": 0.0, "llm_budget": 0.1,
                                                    "stream": True, "stream_options": {"include_usage": True}}) as long:
        lines = long.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        short = _client(url).completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=9, temperature=0,
                                                extra_body={"threshold": 0.0, "llm_budget": 0.25})
        rest = [first] + [line for line in lines if line.startswith("data:")]
    assert service.engine.joins_running > joins, "the short request joined the long one's batch, then left it"
    chunks = [json.loads(line[5:]) for line in rest[:-1]]
    long_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    long_r2r = chunks[-1]["r2r"]
    assert (short.choices[0].text, short.model_extra["r2r"]["llm_tokens"]) == alone(PROMPTS[3], 9, 0.25)
    assert (long_text, long_r2r["llm_tokens"]) == alone(PROMPTS[0], 120, 0.1)
    assert long_r2r["llm_tokens"] >= 2 and short.model_extra["r2r"]["llm_tokens"] >= 1, "both budgets were spent"

BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    # A negative threshold routes everything, as in generate (core/routing.check_threshold): no longer refused.
    ("/v1/completions", {"model": "tiny", "prompt": "x", "threshold": float("nan")}, 400, "threshold"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "threshold": "low"}, 400, "threshold"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 12}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "llm_budget": 1.5}, 400, "llm_budget"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "llm_budget": "0.1"}, 400, "llm_budget"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "water " * 1200}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", [1, 2, 3], 400, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD)
def test_bad_requests_get_an_openai_error_body(served, path, body, status, param):
    url, _ = served
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param or (param and error["param"].startswith(param))
    ok = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, "the server keeps serving"


def test_wrong_methods_and_paths_are_openai_errors(served):
    url, _ = served
    assert httpx.get(url + "/v1/completions").json()["error"]["message"]
    assert httpx.get(url + "/v2/nothing").status_code == 404


def _long_stream(url, service, **extra):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True, **extra}
    return httpx.Client(timeout=120).stream("POST", url + "/v1/completions", json=body)


def _wait_for(condition, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def slow_steps(monkeypatch, model):
    slow_decoding(monkeypatch, model)


def test_a_full_queue_is_refused_with_retry_after(model, tok, slow_steps):
    with serving(model, tok, max_batch_size=1, max_queue=1, batch_wait_ms=0) as (url, service):
        with _long_stream(url, service) as busy:
            lines = busy.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            _wait_for(lambda: len(service.engine.rows) == 1)
            waiting = threading.Thread(target=httpx.post, args=(url + "/v1/completions",),
                                       kwargs={"json": {"model": "tiny", "prompt": "x", "max_tokens": 2}, "timeout": 60})
            waiting.start()
            _wait_for(lambda: len(service.engine.queue) == 1)
            refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
        waiting.join(60)


def test_a_client_that_goes_away_stops_costing_compute(model, tok, slow_steps):
    with serving(model, tok) as (url, service):
        with _long_stream(url, service) as gone:
            lines = gone.iter_lines()
            next(lines)
            _wait_for(lambda: len(service.engine.rows) == 1)
            time.sleep(0.2)
            assert service.engine.rows and not service.engine.rows[0].finish, "still decoding while the client reads"
        _wait_for(lambda: not service.engine.rows)  # closed mid-stream: the row left the batch
        steps = service.engine.steps_run
        time.sleep(0.3)
        assert service.engine.steps_run == steps, "nothing decodes for nobody"
        ok = _client(url).completions.create(model="tiny", prompt="water", max_tokens=3, temperature=0)
        assert ok.usage.completion_tokens == 3


def test_a_batch_that_fails_is_answered_500_and_the_server_goes_on(model, tok, monkeypatch):
    from r2r_hf.serve import engine

    real, failures = engine.turn, []

    def failing_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "turn", failing_once)
    with serving(model, tok) as (url, _):
        body = {"model": "tiny", "prompt": "water", "max_tokens": 4, "temperature": 0, "threshold": 0.0}
        failed = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        assert failed.json()["error"]["type"] == "server_error"
        again = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["r2r"]["llm_token_rate"] == 1.0


def test_an_api_key_is_required_when_set(model, tok):
    with serving(model, tok, api_key="sekrit") as (url, _):
        assert httpx.get(url + "/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
            reply = httpx.get(url + "/v1/models", headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            _client(url, api_key="wrong").models.list()
        assert _client(url, api_key="sekrit").completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_seeded_sampling_repeats_and_n_gives_several_answers(served):
    url, _ = served
    client = _client(url)
    ask = dict(model="tiny", prompt=PROMPTS[2], max_tokens=8, temperature=1.0, top_p=0.9, seed=11, n=3)
    first, second = client.completions.create(**ask), client.completions.create(**ask)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1, "each choice draws from its own stream"
    assert first.usage.completion_tokens == first.model_extra["r2r"]["generated_tokens"] <= 3 * 8


def test_stop_strings_end_an_answer_before_them(served, tok):
    url, _ = served
    client = _client(url)
    free = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    stop = free[3:6]
    assert stop.strip(), free
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_each_request_keeps_its_own_llm_budget_in_one_batch(served, model, tok):
    from fractions import Fraction
    from math import ceil

    url, service = served
    client = _client(url)
    budgets = [0.0, 0.1, 0.25, None]

    def ask(budget):
        extra = {"threshold": 0.0, **({} if budget is None else {"llm_budget": budget})}
        return client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         extra_body=extra).model_extra["r2r"]

    with concurrent.futures.ThreadPoolExecutor(len(budgets)) as pool:
        answers = list(pool.map(ask, budgets))
    for budget, r2r in zip(budgets, answers):
        if budget is None:
            assert "llm_budget" not in r2r and r2r["llm_tokens"] == r2r["generated_tokens"], "threshold 0: all LLM"
            continue
        assert r2r["llm_budget"] == budget
        assert r2r["llm_tokens"] <= ceil(Fraction(budget).limit_denominator(1000) * r2r["generated_tokens"])
    assert answers[0]["llm_tokens"] == 0 and answers[2]["llm_tokens"] >= 1
    enc = tok(PROMPTS[:1], return_tensors="pt")
    alone = model.generate(**enc, max_new_tokens=12, do_sample=False, threshold=0.0, llm_budget=0.25,
                           return_dict_in_generate=True)
    assert answers[2]["llm_tokens"] == int(alone.llm_tokens[0]), "the same routing as generate with that budget"
