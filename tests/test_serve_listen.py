"""How ``r2r-hf serve`` listens: the announcement names the port it got and the threshold requests get, a port in
use is one sentence before the models load, connections that never finish their request cannot shut others out,
and the connection cap stays under the open-file limit.

From issue 34's third hostile probe (items 3, 8 and 14); each test failed before its fix. Servers bind 127.0.0.1
on a free port, run in their own process group and are stopped with it; raw-socket load is bounded in connections
and seconds.
"""

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from serving import posix_only, short_completion

pytestmark = posix_only


# ------------------------------------------------------------------ 3. the announcement says what is served
def test_the_announcement_gives_the_port_it_got_and_the_threshold_it_routes_at(serve_process, router_dir):
    s = serve_process("--port", "0", "--threshold", "0")
    url = s.url()
    port = int(url.rsplit(":", 1)[1])
    assert port != 0, "the announcement names the port the server got"
    assert re.search(r"threshold 0\)", s.line("^serving").string), "the threshold requests get (0), not the router's"
    reply = short_completion(url, os.path.basename(str(router_dir)))
    assert reply.status_code == 200 and reply.json()["r2r"]["threshold"] == 0


# ------------------------------------------------------------------ 14. a port in use, before the models load
@pytest.mark.parametrize("router", ["real", "missing"])
def test_a_port_in_use_is_one_sentence_before_the_models_load(router, router_dir, pair_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        location = str(router_dir) if router == "real" else str(tmp_path / "no-such-router")
        done = subprocess.run([sys.executable, "-m", "r2r_hf.cli", "--quiet", "serve", location, "--slm", pair_dir[0],
                               "--llm", pair_dir[1], "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    # The port is checked first: even a router that does not exist is not looked at.
    assert errors == [f"error: Port {port} on 127.0.0.1 is already in use (another server?); choose another --port "
                      "or stop the server using it."], out
    assert "serving" not in out and "Traceback" not in out


# ------------------------------------------------------------------ 8. Slowloris
SLOW = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"  # never ends


def _open(port: int, count: int, data: bytes) -> list[socket.socket]:
    out = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(data)
        out.append(s)
    return out


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (after whatever it sent)."""
    s.settimeout(0.5)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass  # reset
    return True


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_connections_that_never_finish_their_headers_cannot_shut_others_out(serve_process, router_dir):
    files, cap = 256, 64
    s = serve_process("--port", "0", "--read-timeout", "3", "--max-connections", str(cap), files=files)
    url = s.url()
    port, name = int(url.rsplit(":", 1)[1]), os.path.basename(str(router_dir))
    slow = _open(port, 300, SLOW)  # more than the open-file limit allows
    try:
        started = time.monotonic()
        reply = short_completion(url, name, timeout=20)  # while they hold on: the oldest waiting one makes room
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started < 20
        assert _descriptors(s.process.pid) < files - 64, "connections stay within the cap"
        time.sleep(4)  # past --read-timeout: the server closes what never finished
        assert all(_closed_by_server(c) for c in slow)
        assert short_completion(url, name).status_code == 200
    finally:
        for c in slow:
            c.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_requests_whose_body_never_comes_are_bounded_and_others_get_503_not_a_reset(serve_process, router_dir):
    cap = 16
    s = serve_process("--port", "0", "--read-timeout", "3", "--max-connections", str(cap), files=256)
    url = s.url()
    port, name = int(url.rsplit(":", 1)[1]), os.path.basename(str(router_dir))
    held = _open(port, cap, SLOW + b"Content-Length: 1000\r\n\r\n{")  # headers in, body never: not evictable
    try:
        time.sleep(0.5)
        busy = short_completion(url, name, timeout=20)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "too_many_connections"
        assert busy.headers["retry-after"] == "1"
        time.sleep(4)  # past --read-timeout
        assert all(_closed_by_server(c) for c in held)
        assert short_completion(url, name).status_code == 200
    finally:
        for c in held:
            c.close()


def test_the_connection_cap_leaves_room_under_the_open_file_limit():
    from r2r_hf.serve.listen import RESERVED_DESCRIPTORS, connection_limit

    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
            "from r2r_hf.serve.listen import connection_limit; print(connection_limit(512), connection_limit(50))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == [str(256 - RESERVED_DESCRIPTORS), "50"], done.stderr
    assert "--max-connections 512 lowered to 128: the open-file limit is 256" in done.stderr
    assert connection_limit(1) == 1
