"""`r2r-hf serve` as its own process: it starts from the command line, drains on SIGTERM, then exits."""

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from serving import start_tiny as start_server
from r2r_hf.testing.server import free_port, launch, stop, wait_healthy


def test_sigterm_lets_the_answer_in_flight_finish_then_exits(router_dir, pair_dir):
    process, url = start_server(router_dir, pair_dir, "--drain-seconds", "60")
    try:
        body = {"model": os.path.basename(str(router_dir)), "prompt": "the old man said", "max_tokens": 600,
                "temperature": 0, "threshold": 2.0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            process.send_signal(signal.SIGTERM)  # mid-answer
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]", "the stream was finished, not cut"
        last = json.loads(rest[-2][len("data:"):])
        assert last["choices"][0]["finish_reason"] == "length" and last["r2r"]["generated_tokens"] == 600
        # uvicorn re-raises the signal once it has drained, so the exit status says "ended by SIGTERM".
        assert first and stop(process) in (0, -signal.SIGTERM)
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.HTTPError:
            pass
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


BLOCK_EXTRAS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('fastapi', 'uvicorn', 'ray', 'starlette'):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
"""


def test_the_base_install_runs_without_the_serve_extras_and_serve_says_what_to_install(router_dir):
    code = BLOCK_EXTRAS + f"""
import r2r_hf, r2r_hf.serve
from r2r_hf.cli import main
assert main(["serve", {str(router_dir)!r}]) == 2
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'r2r_hf[serve]'" in done.stderr and "Traceback" not in done.stderr


def test_the_readmes_curl_lines_work_against_the_server(router_dir, pair_dir):
    # The README's own curl commands (its Serve section), pointed at this server's port and model id.
    import re
    import shlex
    import shutil
    from pathlib import Path

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed on this machine")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Serve: an OpenAI-compatible endpoint"):]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[1]
    commands = [" ".join(part.strip() for part in command.split("\\\n"))
                for command in re.split(r"\n(?=curl )", block.strip())]
    assert len(commands) == 2 and all(c.startswith("curl ") for c in commands)
    process, url = start_server(router_dir, pair_dir)
    try:
        name = os.path.basename(str(router_dir))
        outputs = []
        for command in commands:
            command = command.replace("http://127.0.0.1:8000", url).replace("r2r-qwen2.5-coder-0.5b-1.5b", name)
            done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout)
        chat = json.loads(outputs[0])
        assert chat["object"] == "chat.completion" and chat["r2r"]["threshold"] == 0.5
        assert chat["usage"]["completion_tokens"] == chat["r2r"]["generated_tokens"] > 0
        events = [line[len("data: "):] for line in outputs[1].splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "r2r" in json.loads(events[-2])
    finally:
        stop(process)


def test_when_the_drain_runs_out_a_stream_ends_with_an_error_event_and_done(router_dir, pair_dir):
    """Issue 34, item 15: streams used to be cut mid-body (no error, no finish_reason, no [DONE]) and the log got
    a CancelledError traceback."""
    process, url = start_server(router_dir, pair_dir, "--drain-seconds", "0")
    try:
        body = {"model": os.path.basename(str(router_dir)), "prompt": "the old man said", "max_tokens": 1000,
                "temperature": 0, "threshold": 2.0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as answer:
            lines = answer.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            process.send_signal(signal.SIGTERM)  # mid-answer, with no time to finish
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data:"):])["error"]
        assert "shutting down" in error["message"] and error["type"] == "server_error"
        assert stop(process) in (0, -signal.SIGTERM)
        assert "CancelledError" not in process.stdout.read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_a_server_that_ends_before_it_answers_is_reported_with_what_it_said(router_dir):
    process = launch(router_dir, "--no-such-flag")
    with pytest.raises(RuntimeError, match="exited with 2") as raised:
        wait_healthy(process, f"http://127.0.0.1:{free_port()}", timeout=120)
    assert "--no-such-flag" in str(raised.value), "the server's own words are in the error"


def test_stop_kills_a_server_that_outstays_sigterm_and_says_so():
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
           "time.sleep(120)"
    process = subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout.readline() == "ready\n"  # SIGTERM is ignored from here on
    with pytest.raises(RuntimeError, match="did not stop within 1 s of SIGTERM"):
        stop(process, timeout=1)
    assert process.returncode == -signal.SIGKILL
