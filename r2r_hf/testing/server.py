"""``r2r-hf serve`` as a process of its own, for tests and load benchmarks.

``start`` runs it on a free loopback port and returns once ``/health`` answers 200; ``stop`` sends SIGTERM (the
server drains its answers in flight) and kills what outstays. The process runs in a session of its own (so a kill
reaches everything it started), offline (``HF_HUB_OFFLINE=1``), its output (stdout and stderr together) in a pipe the
caller may read. Standard library only: it imports where the serving extras are not installed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(router: str | os.PathLike, *flags: str, env: dict[str, str] | None = None,
           preexec: Callable[[], None] | None = None) -> subprocess.Popen:
    """``python -m r2r_hf.cli --quiet serve ROUTER FLAGS`` started, not waited for (``preexec`` runs in the child
    before the command: only where needed, as it can deadlock beside the parent's threads)."""
    command = [sys.executable, "-m", "r2r_hf.cli", "--quiet", "serve", str(router), *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, start_new_session=True,
                            preexec_fn=preexec)


def healthy(url: str) -> bool:
    """Whether the server at ``url`` answers ``/health`` with 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status == 200
    except (OSError, urllib.error.URLError):  # refused, reset, timed out, or an error status
        return False


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 180.0) -> None:
    """Return once ``url`` answers ``/health``; if the process ends or ``timeout`` seconds pass first, kill it and
    raise with what it printed."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            ended = process.poll() is not None
            _kill_group(process)
            said = process.stdout.read()[-4000:] if process.stdout else ""
            why = f"exited with {process.returncode}" if ended else f"did not answer /health within {timeout:.0f} s"
            raise RuntimeError(f"The server {why}:\n{said}")
        time.sleep(0.2)


def start(router: str | os.PathLike, *flags: str, env: dict[str, str] | None = None,
          timeout: float = 180.0) -> tuple[subprocess.Popen, str]:
    """(process, base url) of ``r2r-hf serve ROUTER FLAGS --port P`` on a free port, once ``/health`` answers."""
    port = free_port()
    process = launch(router, *flags, "--port", str(port), env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(process, url, timeout)
    return process, url


def stop(process: subprocess.Popen, timeout: float = 90.0) -> int:
    """SIGTERM, then wait up to ``timeout`` seconds for the drain; returns the exit status. A server that outstays
    it is killed with all it started, and this raises: not stopping on SIGTERM is a fault."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        raise RuntimeError(f"The server did not stop within {timeout:.0f} s of SIGTERM; it was killed.") from None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the session has ended already
        pass
    process.wait()
