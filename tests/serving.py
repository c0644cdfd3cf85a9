"""A live server on loopback for tests: the real app under uvicorn in a thread, on a free port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from r2r_hf.serve import ServeSettings, build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model, tokenizer, name: str = "tiny", **settings) -> Iterator[tuple[str, object]]:
    """(base url ``http://127.0.0.1:PORT``, the app's service) while the server runs; stopped on exit."""
    port = free_port()
    app = build_app(model, tokenizer, ServeSettings(port=port, **settings), name)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
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
