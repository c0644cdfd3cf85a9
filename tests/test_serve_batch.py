"""The server's running batch: answers that never depend on neighbours or the waiting policy, rows resolved as
``generate`` resolves a call, one bad row that fails its own request only, and ``/metrics``.

Tiny fp32 models over loopback. Several tests here failed on the server before the running batch was one
value (issue 30, issue 34 items 1, 2, 4 and 5): each says which.
"""

import concurrent.futures
import dataclasses
import threading

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LogitsProcessorList

from serving import gap_threshold, generated, serving

PROMPTS = ["the old man said that he was", "water", "write a new line", "the first time you see", "def print",
           "he was a good man and"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)



def _ask(client, prompt, max_tokens, **extra):
    sampling = {k: extra.pop(k) for k in ("temperature", "seed", "top_p") if k in extra}
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body=extra, **sampling)
    return out.choices[0].text, out.model_extra["r2r"]["llm_tokens"]


@pytest.mark.parametrize("min_rows, max_wait", [(1, 0), (2, 1), (3, 4), (8, 64)])
def test_answers_equal_generate_alone_under_every_waiting_policy(model, tok, min_rows, max_wait):
    tau = gap_threshold(model, tok, PROMPTS, 0.65, 0.95)
    jobs = [(PROMPTS[i], 8 + 3 * i, {"threshold": tau, "temperature": 0} if i % 2 else
             {"threshold": tau, "temperature": 1.0, "seed": 5 + i}) for i in range(len(PROMPTS))]
    with serving(model, tok, max_batch_size=4, llm_min_rows=(min_rows,), llm_max_wait=max_wait) as (url, service):
        client = _client(url)
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # 6 requests, 4 slots: rows join and leave
            got = list(pool.map(lambda job: _ask(client, job[0], job[1], **dict(job[2])), jobs))
        counters = service.engine.counters
    for (prompt, max_tokens, extra), answer in zip(jobs, got):
        sampled = extra.get("temperature", 0) > 0
        options = {"threshold": tau, "do_sample": sampled}
        if sampled:
            options |= {"temperature": 1.0, "seed": extra["seed"]}
        assert answer == generated(model, tok, prompt, max_tokens, **options), prompt
    assert sum(llm for _, llm in got) > 0 and counters.host_syncs == counters.steps
    if max_wait:
        assert counters.waits.max > 0 and counters.llm_rows > counters.llm_calls


def test_a_seeded_answer_does_not_change_beside_an_always_routed_stranger(model, tok):
    """Issue 34, item 1: the LLM's catch-up used to redraw every sampling row, routed or not."""
    mine = dict(temperature=1.0, seed=3, threshold=2.0)  # never routed
    with serving(model, tok, max_batch_size=4) as (url, service):
        client = _client(url)
        alone = _ask(client, PROMPTS[0], 12, **dict(mine))
        with httpx.Client(timeout=120) as http, http.stream(
                "POST", url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 200,
                                                        "temperature": 1.0, "seed": 1, "threshold": 0.0,
                                                        "stream": True}) as stranger:
            lines = stranger.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            beside = _ask(client, PROMPTS[0], 12, **dict(mine))
            assert service.engine.peak_rows == 2
    assert beside == alone == generated(model, tok, PROMPTS[0], 12, do_sample=True, temperature=1.0, seed=3,
                                        threshold=2.0)


def test_the_servers_rows_apply_the_generation_config_as_generate_does(model, tok, monkeypatch):
    """Issue 30 and issue 34, item 2: a threshold, a budget and a repetition penalty set on
    ``model.generation_config`` were ignored by the server (which built only temperature/top-k/top-p)."""
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.3, raising=False)
    monkeypatch.setattr(model.generation_config, "threshold", 2.0, raising=False)
    with serving(model, tok) as (url, _):
        client = _client(url)
        text, llm = _ask(client, PROMPTS[0], 12, temperature=0)
        assert (text, llm) == generated(model, tok, PROMPTS[0], 12, do_sample=False)
        assert llm == 0, "the generation config's threshold (2.0: never route) holds"
        penalised = text
        monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.0)
        assert _ask(client, PROMPTS[0], 12, temperature=0)[0] != penalised, "the penalty changes this answer"
        monkeypatch.setattr(model.generation_config, "threshold", 0.0)
        monkeypatch.setattr(model.generation_config, "llm_budget", 0.25, raising=False)
        budgeted = _ask(client, PROMPTS[0], 12, temperature=0)
        assert budgeted == generated(model, tok, PROMPTS[0], 12, do_sample=False) and 0 < budgeted[1] <= 3


def test_bad_rows_are_refused_before_the_batch_and_fail_only_their_request(model, tok):
    """Issue 34, items 4 and 5: a seed overflowing at choice 1, or a temperature of 1e-300, failed every
    request decoding at that moment."""
    with serving(model, tok, max_batch_size=4) as (url, _):
        client = _client(url)
        want = _ask(client, PROMPTS[2], 30, temperature=0, threshold=0.3)
        results = {}

        def stranger():
            results["stranger"] = _ask(client, PROMPTS[2], 30, temperature=0, threshold=0.3)

        thread = threading.Thread(target=stranger)
        thread.start()
        overflow = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3, "n": 2,
                                                              "temperature": 1, "seed": 2**63 - 1}, timeout=60)
        tiny = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 5,
                                                          "temperature": 1e-300}, timeout=60)
        thread.join(120)
    assert overflow.status_code == 400 and overflow.json()["error"]["param"] == "seed"
    assert tiny.status_code == 200, tiny.text  # below 1e-5 a temperature is greedy (as vLLM and the official R2R)
    assert tiny.json()["choices"][0]["text"] == generated(model, tok, PROMPTS[2], 5, do_sample=False)[0]
    assert results["stranger"] == want


def test_a_row_whose_scores_hold_no_probability_ends_its_request_only(model, tok):
    from r2r_hf.model.row_settings import resolve_row
    from r2r_hf.serve.engine import Engine, Request
    from r2r_hf.serve.rows import Choice
    from r2r_hf.serve.settings import ServeSettings

    def nan_scores(ids, scores):
        return torch.full_like(scores, float("nan"))

    engine = Engine(model, tok, ServeSettings(max_batch_size=4, batch_wait_ms=50))
    prompt = tok(PROMPTS[0])["input_ids"]
    good = resolve_row(model, prompt, max_new_tokens=6, do_sample=True, temperature=1.0, seed=4, threshold=0.3)
    bad = dataclasses.replace(good, processors=LogitsProcessorList([nan_scores]))
    events = {"good": [], "bad": []}
    done = threading.Event()

    def sink(name):
        def emit(event):
            events[name].append(event)
            if event[0] in ("end", "error") and all(any(e[0] in ("end", "error") for e in v) for v in events.values()):
                done.set()
        return emit

    engine.start()
    try:
        engine.submit(Request([prompt], [Choice(bad)], sink("bad")))
        engine.submit(Request([prompt], [Choice(good)], sink("good")))
        assert done.wait(60)
    finally:
        engine.stop(30)
    assert [e[0] for e in events["bad"]] == ["error"] and "Sampling failed" in events["bad"][0][1].message
    text = "".join(e[2] for e in events["good"] if e[0] == "text")
    assert events["good"][-1][0] == "end"
    assert text == generated(model, tok, PROMPTS[0], 6, do_sample=True, temperature=1.0, seed=4, threshold=0.3)[0]


def test_metrics_are_prometheus_text_that_adds_up(model, tok):
    tau = gap_threshold(model, tok, PROMPTS, 0.65, 0.95)
    with serving(model, tok, llm_min_rows=(2,), llm_max_wait=4) as (url, _):
        client = _client(url)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body={"threshold": tau}), PROMPTS[:3]))
        text = httpx.get(url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name: families[name].samples[0].value  # noqa: E731
    assert value("r2r_generated_tokens") == sum(a.usage.completion_tokens for a in answers)
    assert value("r2r_llm_tokens") == sum(a.model_extra["r2r"]["llm_tokens"] for a in answers)
    requests = {s.labels["outcome"]: s.value for s in families["r2r_requests"].samples if s.name.endswith("_total")}
    assert requests["completed"] == 3 and requests["error"] == 0
    assert value("r2r_queue_length") == 0 and value("r2r_running_rows") == 0
    ttft = {s.name: s.value for s in families["r2r_time_to_first_token_seconds"].samples}
    assert ttft["r2r_time_to_first_token_seconds_count"] == 3
    waits = {s.name: s.value for s in families["r2r_llm_wait_steps"].samples}
    assert waits["r2r_llm_wait_steps_count"] == value("r2r_llm_tokens")
    for name in ("r2r_llm_forwards", "r2r_slm_forwards", "r2r_host_syncs", "r2r_join_kv_bytes", "r2r_llm_call_rows"):
        assert name in families


def test_a_model_that_cannot_use_slots_is_served_one_answer_at_a_time_on_hfs_caches(model, tok, monkeypatch, caplog):
    import dataclasses

    from r2r_hf.core.abilities import abilities
    from r2r_hf.core.notes import notes

    cannot = dataclasses.replace(abilities(model.slm), slots="its attention is 'flash_attention_2' (for this test)")
    monkeypatch.setitem(notes(model.slm), "abilities", cannot)
    tau = gap_threshold(model, tok, PROMPTS, 0.65, 0.95)
    with caplog.at_level("WARNING"), serving(model, tok, max_batch_size=4) as (url, service):
        assert not service.engine.slotted
        client = _client(url)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: _ask(client, p, 7, temperature=0, threshold=tau), PROMPTS[:3]))
        several = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=5, temperature=1.0, seed=4,
                                            n=2, extra_body={"threshold": tau})
        assert service.engine.peak_rows == 1
    assert any("one at a time" in r.getMessage() for r in caplog.records)
    for prompt, answer in zip(PROMPTS[:3], got):
        assert answer == generated(model, tok, prompt, 7, do_sample=False, threshold=tau)
    for i, choice in enumerate(several.choices):
        want = generated(model, tok, PROMPTS[3], 5, do_sample=True, temperature=1.0, seed=4 + i, threshold=tau)[0]
        assert choice.text == want


def test_a_drain_that_runs_out_ends_each_open_answer_with_an_error_event(model, tok, monkeypatch):
    """Issue 34, item 15: when --drain-seconds ran out, streams were cut mid-body with no error and no [DONE]."""
    import time as clock

    from r2r_hf.model.row_settings import resolve_row
    from r2r_hf.serve import engine as engine_module
    from r2r_hf.serve.engine import Engine, Request
    from r2r_hf.serve.protocol import APIError
    from r2r_hf.serve.rows import Choice
    from r2r_hf.serve.settings import ServeSettings

    real = engine_module.turn
    monkeypatch.setattr(engine_module, "turn", lambda *a, **k: (clock.sleep(0.02), real(*a, **k))[1])
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    engine = Engine(model, tok, ServeSettings(max_batch_size=2, batch_wait_ms=0))
    prompt = tok(PROMPTS[0])["input_ids"]
    events = {"short": [], "long": []}
    engine.start()
    for name, tokens in (("short", 3), ("long", 400)):
        settings = resolve_row(model, prompt, max_new_tokens=tokens, do_sample=False)
        engine.submit(Request([prompt], [Choice(settings)], events[name].append))
    clock.sleep(0.5)
    engine.drain(0.3)
    with pytest.raises(APIError, match="shutting down"):
        engine.submit(Request([prompt], [Choice(settings)], lambda e: None))
    engine.thread.join(30)
    assert not engine.thread.is_alive()
    assert events["short"][-1][0] == "end", "an answer that finished in time ends normally"
    last = events["long"][-1]
    assert last[0] == "error" and last[1].status == 503 and "shutting down" in last[1].message
    assert any(e[0] == "text" for e in events["long"]), "it was streaming when the drain ran out"
