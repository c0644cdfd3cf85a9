"""Clients that leave take their work with them, and a client that never reads cannot hold the server (issue 41).

Item 3: a non-streaming client that went away kept its answer decoding to the end (the disconnect was looked for
only after 0.5 s without an event, and a running answer emits one every step). Item 5: a client that never read its
answer was held for ever, and once dropped it left the ``--max-connections`` count while its descriptor stayed open.
Servers bind 127.0.0.1 on a free port; every client is bounded in requests and seconds.
"""

import time

import httpx
import pytest

from serving import serving, slow_decoding


def _outcomes(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    return {s.labels["outcome"]: s.value for s in families["r2r_requests"].samples if s.name.endswith("_total")}


def _until(condition, within: float, what: str) -> float:
    """Seconds until ``condition()`` holds; fails after ``within``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within, what
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_client_that_leaves_a_whole_answer_stops_it_at_once(model, tok, monkeypatch):
    slow_decoding(monkeypatch, model)  # 1000 tokens take 20 s or more
    body = {"model": "tiny", "prompt": "the old man said", "max_tokens": 1000, "temperature": 0}
    with serving(model, tok) as (url, service):
        engine = service.engine
        with pytest.raises(httpx.ReadTimeout):  # the client gives up (and closes) while its answer decodes
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        assert engine.counters.generated > 0, "the answer was decoding when the client left"
        _until(lambda: not engine.rows, 3.0, "the answer went on decoding after its client left")
        assert _outcomes(url)["cancelled"] == 1
