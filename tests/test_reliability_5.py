"""Issue #34, third hostile probe: how ``r2r-hf serve`` listens, announces itself and guards its door
(items 3, 8, 14, 19-21; the Ray items 16-18 are in ``test_serve_ray.py``).

Each test failed before its fix. Servers bind 127.0.0.1 on a free port, run in their own process group and are
stopped with it; raw-socket load is bounded in connections and seconds.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from r2r_hf.cli import main as cli_main
from r2r_hf.serve import ServeSettings

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups and rlimits are POSIX")


class Server:
    """``python -m r2r_hf.cli serve`` in its own process group, its output read into ``lines`` as it comes."""

    def __init__(self, router_dir, pair_dir, *flags, files: int | None = None, env=None) -> None:
        command = [sys.executable, "-m", "r2r_hf.cli", "--quiet", "serve", str(router_dir), "--slm", pair_dir[0],
                   "--llm", pair_dir[1], "--threads", "1", *flags]

        def limit():  # a lowered open-file limit, as on machines where it is 256
            if files:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                                        start_new_session=True, preexec_fn=limit)
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
        """Its whole process group ends: SIGTERM, then SIGKILL."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self.reader.join(10)


@pytest.fixture
def server(router_dir, pair_dir):
    started = []

    def start(*flags, **kwargs) -> Server:
        started.append(Server(router_dir, pair_dir, *flags, **kwargs))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _complete(url: str, name: str, timeout: float = 60) -> httpx.Response:
    body = {"model": name, "prompt": "the old man said", "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


# ------------------------------------------------------------------ 3. the announcement says what is served
def test_the_announcement_gives_the_port_it_got_and_the_threshold_it_routes_at(server, router_dir):
    s = server("--port", "0", "--threshold", "0")
    url = s.url()
    port = int(url.rsplit(":", 1)[1])
    assert port != 0, "the announcement names the port the server got"
    assert re.search(r"threshold 0\)", s.line("^serving").string), "the threshold requests get (0), not the router's"
    reply = _complete(url, os.path.basename(str(router_dir)))
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
def test_connections_that_never_finish_their_headers_cannot_shut_others_out(server, router_dir):
    files, cap = 256, 64
    s = server("--port", "0", "--read-timeout", "3", "--max-connections", str(cap), files=files)
    url = s.url()
    port, name = int(url.rsplit(":", 1)[1]), os.path.basename(str(router_dir))
    slow = _open(port, 300, SLOW)  # more than the open-file limit allows
    try:
        started = time.monotonic()
        reply = _complete(url, name, timeout=20)  # while they hold on: the oldest waiting one makes room
        assert reply.status_code == 200, reply.text
        assert time.monotonic() - started < 20
        assert _descriptors(s.process.pid) < files - 64, "connections stay within the cap"
        time.sleep(4)  # past --read-timeout: the server closes what never finished
        assert all(_closed_by_server(c) for c in slow)
        assert _complete(url, name).status_code == 200
    finally:
        for c in slow:
            c.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_requests_whose_body_never_comes_are_bounded_and_others_get_503_not_a_reset(server, router_dir):
    cap = 16
    s = server("--port", "0", "--read-timeout", "3", "--max-connections", str(cap), files=256)
    url = s.url()
    port, name = int(url.rsplit(":", 1)[1]), os.path.basename(str(router_dir))
    held = _open(port, cap, SLOW + b"Content-Length: 1000\r\n\r\n{")  # headers in, body never: not evictable
    try:
        time.sleep(0.5)
        busy = _complete(url, name, timeout=20)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "too_many_connections"
        assert busy.headers["retry-after"] == "1"
        time.sleep(4)  # past --read-timeout
        assert all(_closed_by_server(c) for c in held)
        assert _complete(url, name).status_code == 200
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


# ------------------------------------------------------------------ 19-21. the API key
def test_an_empty_api_key_is_refused_not_read_as_none(router_dir, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    for key, message in (("", "--api-key is empty (an unset variable?)"), ("  ", "--api-key is empty"),
                         (" sekrit", "starts or ends with whitespace")):
        assert cli_main(["serve", str(router_dir), "--api-key", key]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("R2R_API_KEY", "")
    assert cli_main(["serve", str(router_dir)]) == 2
    assert "$R2R_API_KEY is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="api_key is empty"):
        ServeSettings(api_key="")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
def test_a_network_address_without_a_key_is_refused_unless_asked_for(host, router_dir, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    assert cli_main(["serve", str(router_dir), "--host", host]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {host!r} is not a loopback address and no API key is set, so anyone who can reach it "
                   "could use the server; set a key (R2R_API_KEY or --api-key-file on the command line) or "
                   "--allow-unauthenticated to serve openly.\n")
    assert ServeSettings(host=host, api_key="k").api_key == "k"
    assert ServeSettings(host=host, allow_unauthenticated=True).host == host
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "::ffff:127.0.0.1"):
        assert ServeSettings(host=loopback).api_key is None


def test_the_key_comes_from_a_file_or_the_environment(server, router_dir, tmp_path, monkeypatch):
    name = os.path.basename(str(router_dir))
    keyfile = tmp_path / "key"
    keyfile.write_text("from-the-file\n")  # echo's newline is no part of the key
    keyfile.chmod(0o600)
    s = server("--port", "0", "--api-key-file", str(keyfile), env={"R2R_API_KEY": "from-the-environment"})
    url = s.url()
    assert "from-the-file" not in " ".join(open(f"/proc/{s.process.pid}/cmdline").read().split("\0"))
    assert _complete(url, name).status_code == 401
    auth = {"Authorization": "Bearer from-the-file"}
    reply = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": name, "prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200
    e = server("--port", "0", env={"R2R_API_KEY": "from-the-environment"})
    assert httpx.get(e.url() + "/v1/models", timeout=10, headers={"Authorization": "Bearer from-the-environment"}) \
        .status_code == 200


def test_key_sources_are_checked_in_one_sentence(router_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("R2R_API_KEY", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for flags, message in (
        (["--api-key", "a", "--api-key-file", str(empty)], "Give the API key once: --api-key or --api-key-file"),
        (["--api-key-file", str(empty)], f"The key file {empty} is empty"),
        (["--api-key-file", str(tmp_path / "none")], f"Cannot read the key file {tmp_path / 'none'}: No such file"),
    ):
        assert cli_main(["serve", str(router_dir), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err


def test_help_says_which_key_source_to_prefer(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "prefer --api-key-file or R2R_API_KEY" in out and "--allow-unauthenticated" in out
