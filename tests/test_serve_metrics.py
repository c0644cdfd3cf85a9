"""``/metrics`` for as long as the server runs (issue 41): bounded counters, scrapes off the event loop, refusals counted.

Item 2: the waits of routed tokens were a list that grew by one int per LLM-written token for ever, and each scrape
scanned it on the event loop (at 3M entries a scrape held every stream for seconds). Item 7: requests refused with
429 (or 503 while draining) were never counted in ``r2r_requests_total{outcome="rejected"}``.
"""

import threading
import time
import tracemalloc
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from r2r_hf.core.counters import Counters
from r2r_hf.core.policy import IMMEDIATE
from r2r_hf.serve.errors import APIError
from r2r_hf.serve.metrics import ServeMetrics
from serving import gap_threshold, serving, slow_decoding


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _requests(text: str) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for s in _families(text)["r2r_requests"].samples if s.name.endswith("_total")}


def test_the_wait_histogram_takes_constant_memory_however_many_waits_it_counts():
    counters = Counters()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200_000):  # a day of a busy server is millions
            counters.waits.append(i % 40)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 10_000, f"counting 200,000 waits took {grown} bytes"
    assert len(counters.waits) == 200_000 and counters.waits.max == 39

    counters = Counters()
    for wait in (0, 0, 1, 3, 3, 5, 16, 200):
        counters.waits.append(wait)
    engine = SimpleNamespace(counters=counters, queue=[], rows=[], batch=None, policy=IMMEDIATE)
    samples = _families(ServeMetrics(engine).text().decode())["r2r_llm_wait_steps"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets == {"0": 2, "1": 3, "2": 3, "4": 5, "8": 6, "16": 7, "32": 7, "64": 7, "128": 7, "+Inf": 8}
    assert {s.name: s.value for s in samples if not s.name.endswith("_bucket")} == \
        {"r2r_llm_wait_steps_count": 8, "r2r_llm_wait_steps_sum": 228}
    summary = counters.summary()  # bucket bounds (documented), the mean exact
    assert (summary["wait_steps_p50"], summary["wait_steps_p95"], summary["wait_steps_mean"]) == (4.0, 200.0, 28.5)
    assert Counters().summary()["wait_steps_p50"] is None


def test_a_scrape_never_holds_the_event_loop(model, tok):
    with serving(model, tok) as (url, service):
        metrics = service.engine.metrics
        real = metrics.text

        inside = threading.Event()

        def slow() -> bytes:  # a scrape that takes long, however it came to
            inside.set()
            time.sleep(2.0)
            return real()

        metrics.text = slow
        scrape = threading.Thread(target=lambda: httpx.get(url + "/metrics", timeout=30))
        scrape.start()
        assert inside.wait(30), "the scrape reached the slow rendering"  # (a fixed sleep raced a loaded machine)
        started = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        waited = time.monotonic() - started
        scrape.join(30)
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a scrape"


def test_refused_requests_are_counted_as_rejected(model, tok, monkeypatch):
    slow_decoding(monkeypatch, model)
    body = {"model": "tiny", "prompt": "the old man said", "max_tokens": 300, "temperature": 0}
    with serving(model, tok, max_batch_size=1, max_queue=1) as (url, service):
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped line iterator closes the connection
            next(line for line in lines if line.startswith("data:"))  # it holds the one slot
            short = {**body, "max_tokens": 2}  # answered once the stream above leaves
            waiting = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=short, timeout=60))
            waiting.start()  # it fills the queue
            deadline = time.monotonic() + 30
            while len(service.engine.queue) < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.01)
            codes = [httpx.post(url + "/v1/completions", json=body, timeout=60).status_code for _ in range(3)]
            counted = _requests(httpx.get(url + "/metrics", timeout=30).text)
        waiting.join(60)
    assert codes == [429] * 3
    assert counted["rejected"] == 3 and counted["completed"] == 0


def test_a_request_refused_while_draining_is_counted_as_rejected(model, tok):
    from r2r_hf.serve.engine import Engine, Request
    from r2r_hf.serve.settings import ServeSettings

    engine = Engine(model, tok, ServeSettings())  # never started: submit alone is under test
    engine.drain(0)
    with pytest.raises(APIError) as refused:
        engine.submit(Request([[1, 2]], [None], lambda event: None))
    assert refused.value.status == 503
    assert _requests(engine.metrics.text().decode())["rejected"] == 1


def test_token_rows_and_speculation_are_counters_on_a_real_scrape(model, tok):
    """Issue 49, item 7: each model's token-rows read (padding included) and real, and the speculative counts, are
    Prometheus counters with help text, equal to the engine's counters (computed from the shapes the host chose)."""
    import concurrent.futures

    prompts = ["the old man said that he was", "water", "a man and a dog", "he said that"]
    tau = gap_threshold(model, tok, prompts, 0.5, 0.9)
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "threshold": tau}
    with serving(model, tok, max_batch_size=4, speculate=2, llm_min_rows=(2,), llm_max_wait=4) as (url, service):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answered = list(pool.map(lambda p: httpx.post(url + "/v1/completions", json={**body, "prompt": p},
                                                          timeout=60).status_code, prompts))
        text = httpx.get(url + "/metrics", timeout=30).text
        counters = service.engine.counters
    assert answered == [200] * 4
    families = _families(text)
    expected = {"r2r_llm_token_rows_read": counters.llm_rows_read, "r2r_llm_token_rows_real": counters.llm_rows_real,
                "r2r_slm_token_rows_read": counters.slm_rows_read, "r2r_slm_token_rows_real": counters.slm_rows_real,
                "r2r_speculative_resolutions": counters.resolutions, "r2r_speculative_agreed": counters.agreed,
                "r2r_speculative_rejected": counters.rejected, "r2r_speculative_thrown_tokens": counters.thrown}
    for name, value in expected.items():
        family = families[name]
        assert family.type == "counter" and len(family.documentation) > 20, name
        assert [(s.name, s.value) for s in family.samples if not s.name.endswith("_created")] == \
            [(name + "_total", value)], name
    assert 0 < counters.llm_rows_real <= counters.llm_rows_read and 0 < counters.slm_rows_real <= counters.slm_rows_read
    assert counters.slm_rows_real >= sum(len(tok(p)["input_ids"]) for p in prompts), "every prompt was read"
    assert counters.resolutions > 0 and counters.agreed + counters.rejected > 0, "the answers speculated"


# ------------------------------------------------------------------ 4. Ray: every replica on every scrape
class _Store(dict):
    """Ray's key-value store, as a dict."""

    def put(self, key, value):
        self[key] = value

    def keys(self, prefix):  # noqa: D102 - the Store protocol's
        return [k for k in list(self) if k.startswith(prefix)]

    def delete(self, key):
        self.pop(key, None)


def _completed_by_replica(text: str) -> dict:
    samples = _families(text)["r2r_requests"].samples
    return {s.labels.get("replica"): s.value for s in samples
            if s.name == "r2r_requests_total" and s.labels["outcome"] == "completed"}


def test_every_replica_is_on_every_scrape_labelled_whichever_answers():
    """The aggregation under a Ray deployment (the Ray test in test_serve_ray.py runs it on real replicas)."""
    import json

    from r2r_hf.serve.replica_metrics import PREFIX, ReplicaMetrics

    store = _Store()
    metrics = [ServeMetrics(SimpleNamespace(counters=Counters(), queue=[], rows=[], batch=None, policy=IMMEDIATE))
               for _ in range(2)]
    replicas = [ReplicaMetrics(m, "r2r", name, store) for m, name in zip(metrics, ("a", "b"))]
    for m, answered in zip(metrics, (3, 5)):
        for _ in range(answered):
            m.finished("completed")
    replicas[1].publish()  # b's periodic publication; a publishes as it answers the scrape
    assert _completed_by_replica(replicas[0].text().decode()) == {"a": 3, "b": 5}
    metrics[1].finished("completed")
    assert _completed_by_replica(replicas[1].text().decode()) == {"a": 3, "b": 6}
    assert _completed_by_replica(replicas[0].text().decode()) == {"a": 3, "b": 6}, "a series never goes back"
    store.put(f"{PREFIX}r2r/gone", json.dumps({"at": 0.0, "families": []}))  # a replica killed long ago
    assert set(_completed_by_replica(replicas[0].text().decode())) == {"a", "b"}
    assert f"{PREFIX}r2r/gone" not in store, "a stale entry is deleted"
