"""A live server on loopback for tests: the real app under uvicorn in a thread, on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from r2r_hf.serve import ServeSettings, build_app
from r2r_hf.serve.listen import guarded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model, tokenizer, name: str = "tiny", protocol: type | None = None,
            **settings) -> Iterator[tuple[str, object]]:
    """(base url ``http://127.0.0.1:PORT``, the app's service) while the server runs; stopped on exit.

    Connections are served by ``r2r-hf serve``'s own protocol (``listen.guarded``: its deadlines and cap), or by
    ``protocol``."""
    port = free_port()
    config = ServeSettings(port=port, **settings)
    app = build_app(model, tokenizer, config, name)
    http = protocol or guarded(config.read_timeout, config.max_connections, config.write_timeout)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app.state.service
    finally:
        server.should_exit = True
        thread.join(60)
        assert not thread.is_alive(), "the test server did not stop"
        assert not app.state.service.engine.thread.is_alive(), "the decoding thread did not stop"


def gap_threshold(model, tok, prompts: list[str], lo: float, hi: float) -> float:
    """A threshold in the widest gap between neighbouring router scores of ``prompts``' greedy answers, between
    their ``lo`` and ``hi`` quantiles: routing is score >= threshold, so no score sits on it (no rounding flips)."""
    enc = tok(prompts, return_tensors="pt", padding=True)
    probe = model.generate(**enc, max_new_tokens=12, do_sample=False, threshold=float("inf"), return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask].sort().values
    gaps = scores[1:] - scores[:-1]
    start, end = int(len(gaps) * lo), int(len(gaps) * hi)
    i = start + int(gaps[start:end].argmax())
    return float((scores[i] + scores[i + 1]) / 2)


def generated(model, tok, prompt: str, max_tokens: int, **options) -> tuple[str, int]:
    """``generate`` alone on one prompt: its answer's text and how many of its tokens the LLM wrote."""
    enc = tok(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_tokens, return_dict_in_generate=True, **options)
    return tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True), int(out.llm_tokens[0])


def slow_decoding(monkeypatch, model, seconds: float = 0.02) -> None:
    """Every decoding step of the engine takes at least ``seconds`` and no answer ends before its max_tokens, so a
    long answer is still decoding when a test acts."""
    from r2r_hf.serve import engine

    real = engine.turn

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "turn", slow)
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
