"""HTTP requests: nothing a client sends breaks, stalls or misleads the server (an infinite threshold, a body over
the limit, a long prompt, clients that give up, lone surrogates, refusing chat templates, too many rows, wrong
content types and NaN), and the core's range checks are the server's only ones.

From issue 34's hostile probe of the HTTP layer (items 6, 7, 9-13 and the small ones) and issue 30 (the range
checks). Tiny fp32 models over loopback, the official ``openai`` client and raw HTTP (``httpx``). Every test here
failed on the server before its fix (item 9's against the engine whose ``cancel`` only marked a queued request):
each says what it got then.
"""

import copy
import json
import os
import threading
import time

import httpx
import openai
import pytest

from serving import serving, slow_decoding

LONE_SURROGATE = b'"\\ud800"'  # valid JSON, no text


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _post(url: str, body, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    content = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    headers = kwargs.pop("headers", {"content-type": "application/json"})
    return httpx.post(url + path, content=content, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)


def _strict_json(text: str):
    """``text`` parsed as JSON proper: ``Infinity`` and ``NaN`` (Python's extensions) fail."""
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def _error(reply: httpx.Response, status: int, param: str | None) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error["message"]


def _wait_for(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served(model, tok):
    with serving(model, tok) as (url, service):
        yield url, service


@pytest.fixture
def slow_steps(monkeypatch, model):
    slow_decoding(monkeypatch, model)


# ----------------------------------------------------------------- item 6
def test_an_infinite_threshold_is_valid_json_in_answers_and_streams(served, model, tok):
    """Was: a text/plain 500 "Out of range float values are not JSON compliant"; streamed, ``"threshold": Infinity``."""
    url, _ = served
    body = b'{"model": "tiny", "prompt": "water", "max_tokens": 4, "temperature": 0, "threshold": %s%s}'
    whole = _post(url, body % (b"1e309", b""))
    assert whole.status_code == 200 and whole.headers["content-type"] == "application/json", whole.text
    r2r = _strict_json(whole.text)["r2r"]
    assert r2r["threshold"] == "inf" and r2r["llm_tokens"] == 0, "never routed"

    streamed = _post(url, body % (b"1e309", b', "stream": true'))
    assert streamed.status_code == 200
    lines = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [_strict_json(line) for line in lines[:-1]]
    assert chunks[-1]["r2r"]["threshold"] == "inf"

    everything = _strict_json(_post(url, body % (b"-1e309", b"")).text)["r2r"]
    assert everything["threshold"] == "-inf" and everything["llm_token_rate"] == 1.0


def test_a_server_default_threshold_of_infinity_answers(model, tok):
    """``r2r-hf serve --threshold inf``: was a 500 for every non-streamed answer."""
    with serving(model, tok, threshold=float("inf")) as (url, _):
        out = _client(url).completions.create(model="tiny", prompt="water", max_tokens=3, temperature=0)
        assert out.model_extra["r2r"]["threshold"] == "inf" and out.model_extra["r2r"]["llm_tokens"] == 0


# ----------------------------------------------------------------- item 7
def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    """Was: a 10 MB prompt was parsed and tokenised (14 s, +700 MB), then refused as longer than the context."""
    url, service = served
    limit = service.settings.max_body_bytes
    assert limit == 2 * 2**20, "the default"
    big = b'{"model": "tiny", "max_tokens": 2, "prompt": "' + b"water is wet " * (10 * 2**20 // 13) + b'"}'
    before, started = _rss_mb(), time.monotonic()
    message = _error(_post(url, big), 413, None)
    assert time.monotonic() - started < 5 and _rss_mb() - before < 100, "refused before it was parsed"
    assert f"limit of {limit} bytes" in message and "--max-body-bytes" in message

    def chunked():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(300):
            yield b"a" * 10_000
        yield b'"}'

    assert "longer than this server's limit" in _error(_post(url, chunked()), 413, None)
    within = b'{"model": "tiny", "max_tokens": 2, "prompt": "' + b"a" * (limit - 100) + b'"}'
    assert _error(_post(url, within), 400, "prompt"), "within the limit: read, and refused by the context only"
    assert _post(url, {"model": "tiny", "prompt": "water", "max_tokens": 2}).status_code == 200


def test_a_long_prompt_is_tokenised_off_the_event_loop(model, tok):
    """Was: tokenising a 4 MB prompt on the event loop held every other client for the whole 4-6 s it took."""
    with serving(model, tok, max_body_bytes=8 * 2**20) as (url, _):
        big = b'{"model": "tiny", "max_tokens": 2, "prompt": "' + b"water is wet " * (4 * 2**20 // 13) + b'"}'
        small = {"model": "tiny", "prompt": "water", "max_tokens": 1, "temperature": 0}
        latencies, stop = [], threading.Event()

        def others():
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    started = time.monotonic()
                    assert client.post(url + "/v1/completions", json=small).status_code == 200
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.02)

        ticker = threading.Thread(target=others)
        ticker.start()
        time.sleep(0.3)
        started = time.monotonic()
        _error(_post(url, big, timeout=300), 400, "prompt")  # longer than the context, once tokenised
        took = time.monotonic() - started
        stop.set()
        ticker.join(60)
    assert took > 1.0, "the prompt's tokenising takes a while"
    assert max(latencies) < took / 3, f"the other clients waited {max(latencies):.2f} s of the {took:.2f} s"


# ----------------------------------------------------------------- item 9
def _abandoned(url: str, body: dict, seconds: float) -> threading.Thread:
    """A client that sends ``body`` and gives up after ``seconds``."""
    def ask():
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json=body, timeout=seconds)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def _long_stream(url: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": "water", "max_tokens": 900, "temperature": 0, "stream": True}
    return httpx.Client(timeout=120).stream("POST", url + "/v1/completions", json=body)


def test_clients_that_gave_up_leave_the_queue(model, tok, slow_steps):
    """Was: the two abandoned requests (one streamed) kept their places, so live clients got 429 with nobody
    waiting."""
    with serving(model, tok, max_batch_size=1, max_queue=2, batch_wait_ms=0) as (url, service):
        with _long_stream(url) as busy:
            lines = busy.iter_lines()  # kept: dropping the iterator closes the response
            next(lines)
            _wait_for(lambda: len(service.engine.rows) == 1)
            gone = [_abandoned(url, {"model": "tiny", "prompt": "x", "max_tokens": 2}, 1.0)]
            stream = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
            with httpx.Client(timeout=120) as gives_up, gives_up.stream("POST", url + "/v1/completions", json=stream):
                _wait_for(lambda: len(service.engine.queue) == 2)  # a stream whose client then closes it
            _wait_for(lambda: not service.engine.queue, seconds=10)
            for thread in gone:
                thread.join(30)
            live = [None, None]

            def ask(i):
                live[i] = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                                     timeout=120)

            waiting = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for thread in waiting:
                thread.start()
            _wait_for(lambda: len(service.engine.queue) == 2 or any(live))
            assert not any(live), f"queued behind the running answer, not refused: {live}"
        for thread in waiting:  # the running stream closed: both answered
            thread.join(60)
        assert [reply.status_code for reply in live] == [200, 200]


def test_a_cancelled_request_at_the_head_no_longer_blocks_smaller_ones(model, tok, slow_steps):
    """Was: a queued n=2 request whose client left stayed at the head and the n=1 request behind it waited for the
    running answer to end (18 s)."""
    with serving(model, tok, max_batch_size=2, max_queue=4, batch_wait_ms=0) as (url, service), \
            _long_stream(url) as busy:
        lines = busy.iter_lines()
        next(lines)
        _wait_for(lambda: len(service.engine.rows) == 1)  # one slot of two left
        head = _abandoned(url, {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 2}, 1.5)
        _wait_for(lambda: len(service.engine.queue) == 1)
        started = time.monotonic()
        small = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                           timeout=15)
        assert small.status_code == 200 and time.monotonic() - started < 10
        assert service.engine.rows and not service.engine.rows[0].finish, "answered beside the running answer"
        head.join(30)


# ----------------------------------------------------------------- items 10-13
def test_a_lone_surrogate_is_a_400_naming_the_field(served):
    """Was: a 500 with the tokenizer's TypeError (clients retry a 5xx)."""
    url, _ = served
    prompt = b'{"model": "tiny", "max_tokens": 2, "prompt": %s}'
    assert "surrogate" in _error(_post(url, prompt % LONE_SURROGATE), 400, "prompt")
    assert "surrogate" in _error(_post(url, prompt % (b'["fine", ' + LONE_SURROGATE + b"]")), 400, "prompt")
    chat = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'
    _error(_post(url, chat % LONE_SURROGATE, "/v1/chat/completions"), 400, "messages.0.content")
    parts = b'[{"type": "text", "text": ' + LONE_SURROGATE + b"}]"
    _error(_post(url, chat % parts, "/v1/chat/completions"), 400, "messages.0.content")
    assert _post(url, prompt % b'"\\ud83d\\ude00"').status_code == 200, "a surrogate pair is text"


REFUSING = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}assistant:")


def test_a_chat_template_that_refuses_is_a_400_and_a_hub_id_is_retrieved(model, tok, caplog):
    """Items 11 and 13: was a 500 with a traceback in the log; and ``models.retrieve`` was a 404."""
    refusing = copy.deepcopy(tok)
    refusing.chat_template = REFUSING
    with serving(model, refusing, name="org/tiny-chat") as (url, _):
        client = _client(url)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "water"}]
        with caplog.at_level("INFO"):
            reply = _post(url, {"model": "org/tiny-chat", "messages": messages, "max_tokens": 2}, "/v1/chat/completions")
        assert "System role not supported" in _error(reply, 400, "messages")
        assert not [r for r in caplog.records if r.exc_info], "no traceback in the log"
        fine = client.chat.completions.create(model="org/tiny-chat", messages=messages[1:], max_tokens=2)
        assert fine.choices[0].finish_reason

        assert client.models.retrieve("org/tiny-chat").id == "org/tiny-chat"  # a Hub id holds a slash
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4")
        reply = httpx.get(url + "/v1/models/gpt-4")
        _error(reply, 404, "model")
        assert reply.json()["error"]["code"] == "model_not_found"


def test_retrieve_the_served_model(served):
    url, _ = served
    card = _client(url).models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "r2r_hf"


def test_too_many_rows_name_the_prompt_list_or_n(served):
    """Item 12: was "9 answers exceed this server's batch" with param n although the client sent n = 1."""
    url, service = served
    batch = service.settings.max_batch_size
    too_many = _error(_post(url, {"model": "tiny", "prompt": ["water"] * (batch + 1), "max_tokens": 2}), 400, "prompt")
    assert f"{batch + 1} prompts" in too_many and f"batch of {batch}" in too_many
    _error(_post(url, {"model": "tiny", "prompt": ["water"] * 3, "n": 3, "max_tokens": 2}), 400, "prompt")
    _error(_post(url, {"model": "tiny", "prompt": "water", "n": batch + 1, "max_tokens": 2}), 400, "n")
    _error(_post(url, {"model": "tiny", "prompt": ["water"] * 2, "n": batch + 1, "max_tokens": 2}), 400, "n")
    ids = [[5, 6]] * (batch + 1)  # token-id prompts count the same
    _error(_post(url, {"model": "tiny", "prompt": ids, "max_tokens": 2}), 400, "prompt")


# ----------------------------------------------------------------- small ones
def test_openapi_version_content_type_and_nan_say_what_is_wrong(served):
    """Was: version 0.1.0; "Input should be a valid dictionary"; NaN "less than or equal to 2"."""
    from r2r_hf.version import __version__

    url, _ = served
    assert httpx.get(url + "/openapi.json").json()["info"]["version"] == __version__
    body = b'{"model": "tiny", "prompt": "water", "max_tokens": 2}'
    for headers in ({"content-type": "text/plain"}, {}, {"content-type": "application/x-www-form-urlencoded"}):
        assert "Content-Type: application/json" in _error(_post(url, body, headers=headers), 415, None)
    assert _post(url, body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200
    nan = b'{"model": "tiny", "prompt": "water", "max_tokens": 2, "%s": NaN}'
    assert "NaN is not a number" in _error(_post(url, nan % b"temperature"), 400, "temperature")
    assert "NaN is not a number" in _error(_post(url, nan % b"top_p"), 400, "top_p")
    assert "must be a number" in _error(_post(url, nan % b"threshold"), 400, "threshold")


# ----------------------------------------------------------------- issue 30
def test_the_cores_range_checks_are_the_servers_only_ones(served, model, tok):
    """A negative threshold routes everything, as in generate (pydantic refused it); the core's refusals are 400s
    naming the field, in the core's words."""
    from r2r_hf.serve import ServeSettings

    url, _ = served
    out = _client(url).completions.create(model="tiny", prompt="water", max_tokens=4, temperature=0,
                                          extra_body={"threshold": -0.5})
    enc = tok(["water"], return_tensors="pt")
    alone = model.generate(**enc, max_new_tokens=4, do_sample=False, threshold=-0.5, return_dict_in_generate=True)
    assert out.model_extra["r2r"]["llm_token_rate"] == 1.0 and out.model_extra["r2r"]["threshold"] == -0.5
    assert out.choices[0].text == tok.decode(alone.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    for name, value, words in (("threshold", "low", "valid number"), ("llm_budget", 1.5, "share of the answer"),
                               ("llm_budget", -0.1, "share of the answer"), ("seed", -1, "whole number")):
        reply = _post(url, {"model": "tiny", "prompt": "water", "max_tokens": 2, name: value})
        assert words in _error(reply, 400, name)
    assert ServeSettings(threshold=-0.5).threshold == -0.5
    with pytest.raises(ValueError, match="threshold must be a number"):
        ServeSettings(threshold=float("nan"))
