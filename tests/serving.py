"""Live servers on loopback for tests: the real app under uvicorn in a thread, on a free port (``serving``), or
``r2r-hf serve`` over the tiny pair as a process of its own (``start_tiny``, waited for on ``/health``, and ``Server``,
read line by line; conftest's ``serve_process`` fixture starts and stops them), both through
``r2r_hf.testing.server``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from r2r_hf.serve import ServeSettings, build_app
from r2r_hf.serve.listen import guarded
from r2r_hf.testing.server import free_port, launch, start, stop


posix_only = pytest.mark.skipif(sys.platform == "win32", reason="process groups and rlimits are POSIX")


def tiny_flags(pair_dir) -> tuple[str, ...]:
    """The serve flags of the tests' tiny pair: its two folders, one torch thread."""
    return ("--slm", pair_dir[0], "--llm", pair_dir[1], "--threads", "1")


def start_tiny(router_dir, pair_dir, *flags, env=None):
    """``r2r-hf serve`` over the tiny pair on a free loopback port; (process, base url) once it answers."""
    return start(router_dir, *tiny_flags(pair_dir), *flags, env=env)


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


class Server:
    """``python -m r2r_hf.cli serve`` in its own process group, its output read into ``lines`` as it comes."""

    def __init__(self, router_dir, pair_dir, *flags, files: int | None = None, env=None) -> None:
        def limit():  # a lowered open-file limit, as on machines where it is 256
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

        # (the limit only where it is asked for: earlier servers' reader threads run beside the fork)
        self.process = launch(router_dir, *tiny_flags(pair_dir), *flags, env=env, preexec=limit if files else None)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    def line(self, pattern: str, timeout: float = 180) -> re.Match:
        """The first output line matching ``pattern``, waiting for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.process.poll() is None, "the server ended:\n" + "".join(self.lines)
            time.sleep(0.1)
        raise AssertionError(f"no line matched {pattern!r}:\n" + "".join(self.lines))

    def url(self) -> str:
        return self.line(r"^serving \S+ on (http://\S+)/v1").group(1)

    def stop(self) -> None:
        """Its whole process group ends: SIGTERM, then SIGKILL (of one that outstays it, and of anything left)."""
        with contextlib.suppress(RuntimeError):  # it outstayed SIGTERM: killed already
            stop(self.process, timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.reader.join(10)


def short_completion(url: str, name: str, timeout: float = 60) -> httpx.Response:
    """A greedy two-token completion from the model ``name`` at ``url``."""
    body = {"model": name, "prompt": "the old man said", "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)
