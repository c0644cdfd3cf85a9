"""Clients that leave take their work with them, and a client that never reads cannot hold the server (issue 41).

Item 3: a non-streaming client that went away kept its answer decoding to the end (the disconnect was looked for
only after 0.5 s without an event, and a running answer emits one every step). Item 5: a client that never read its
answer was held for ever, and once dropped it left the ``--max-connections`` count while its descriptor stayed open.
Servers bind 127.0.0.1 on a free port; every client is bounded in requests and seconds.
"""

import json
import socket
import time

import httpx
import pytest

from serving import serving, slow_decoding

psutil = pytest.importorskip("psutil")  # Ray's dependency, so there wherever the test extra is


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


# ------------------------------------------------------------------ 5. clients that never read their answer
def _small_buffers(**limits) -> type:
    """The server's protocol, with a small kernel send buffer and transport buffer per connection: on loopback the
    kernel alone takes ~1.6 MB of an unread answer (autotuning), so without this only huge answers would fill it."""
    from r2r_hf.serve.listen import guarded

    class SmallBuffers(guarded(**limits)):
        def connection_made(self, transport):
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            transport.set_write_buffer_limits(high=16384)
            super().connection_made(transport)

    return SmallBuffers


def _never_reading(port: int, body: dict) -> socket.socket:
    """A client that sends ``body`` as a streamed completion and never reads a byte of the answer."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    client.connect(("127.0.0.1", port))
    payload = json.dumps({**body, "stream": True}).encode()
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return client


def _server_side(port: int) -> int:
    """Connections the server (in this process) holds on ``port``: their descriptors are open."""
    me = psutil.Process()
    listing = getattr(me, "net_connections", None) or me.connections  # psutil < 6 names it connections
    return sum(1 for c in listing(kind="tcp") if c.laddr and c.laddr.port == port and c.status != psutil.CONN_LISTEN)


def test_an_answer_its_client_never_reads_is_aborted_and_stops(model, tok, monkeypatch):
    slow_decoding(monkeypatch, model, 0.01)  # 1000 tokens take 10 s or more; the buffers fill after ~100
    body = {"model": "tiny", "prompt": "the old man said", "max_tokens": 1000, "temperature": 0}
    limits = {"read_timeout": 30.0, "max_connections": 8, "write_timeout": 1.0}
    with serving(model, tok, protocol=_small_buffers(**limits), **limits) as (url, service):
        port, engine = int(url.rsplit(":", 1)[1]), service.engine
        client = _never_reading(port, body)
        try:
            _until(lambda: engine.rows, 10.0, "the answer never started")
            _until(lambda: not engine.rows and not _server_side(port), 8.0,
                   "an answer nobody read kept decoding and holding its connection")
            assert engine.counters.generated < 1000 and _outcomes(url)["cancelled"] == 1
        finally:
            client.close()


def test_a_dropped_connection_counts_until_its_descriptor_is_closed(model, tok):
    body = {"model": "tiny", "prompt": "the old man said", "max_tokens": 100, "temperature": 0}
    limits = {"read_timeout": 1.0, "max_connections": 2, "write_timeout": 30.0}
    with serving(model, tok, protocol=_small_buffers(**limits), **limits) as (url, service):
        port = int(url.rsplit(":", 1)[1])
        clients = [_never_reading(port, body) for _ in range(2)]  # each answer ends with unsent bytes (unpaused)
        try:
            _until(lambda: service.engine.counters.generated == 200 and not service.engine.rows, 30.0,
                   "the two answers did not end")
            # Past --read-timeout the idle connections are dropped; their unsent bytes must not keep them open.
            _until(lambda: not _server_side(port), 1.0 + 5.0, "dropped connections kept their descriptors open")
            assert httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30).status_code == 200
        finally:
            for client in clients:
                client.close()


@pytest.mark.parametrize("write_timeout, read_timeout", [(3.0, 30.0), (30.0, 1.0)], ids=["stalled", "dropped"])
def test_an_answer_decoded_to_its_end_and_never_read_is_not_counted_completed(model, tok, monkeypatch, write_timeout,
                                                                            read_timeout):
    """Issue 52, item 8: an answer counted ``completed`` when its last token was decoded, whether or not its client
    ever read it. Counted once it has left the server: a connection aborted with the answer unsent (its client left it
    unread past --write-timeout, or past --read-timeout once the answer was in the buffers) counts it cancelled."""
    slow_decoding(monkeypatch, model, 0.0)  # no EOS: every answer runs to max_tokens
    tokens = 300 if write_timeout < 30 else 60  # fills the buffers (they stall), or ends with unsent bytes
    body = {"model": "tiny", "prompt": "the old man said", "max_tokens": tokens, "temperature": 0}
    limits = {"read_timeout": read_timeout, "max_connections": 8, "write_timeout": write_timeout}
    with serving(model, tok, protocol=_small_buffers(**limits), **limits) as (url, service):
        port, engine = int(url.rsplit(":", 1)[1]), service.engine
        client = _never_reading(port, body)
        try:
            _until(lambda: engine.counters.generated == tokens and not engine.rows, 20.0, "decoded to its end")
            _until(lambda: not _server_side(port), 40.0, "the connection was not aborted")
            outcomes = _outcomes(url)
            assert (outcomes["completed"], outcomes["cancelled"]) == (0, 1), outcomes
            reply = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
            assert reply.status_code == 200 and _outcomes(url)["completed"] == 1, "a read answer is completed"
        finally:
            client.close()
