"""Scale-out on a real local Ray instance: two replicas answer, a killed one is replaced, nothing is left behind.

The server runs as ``r2r-hf serve --ray`` in its own process group with its own Ray temp folder, so the
test can tell every process it started (their command lines name that folder) and check that none
outlives it.
"""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import httpx
import openai
import pytest

from test_serve_process import start_server, stop

pytestmark = pytest.mark.ray


def _replica_pids(url: str, tries: int = 40) -> set[int]:
    """The replica processes the proxy spreads ``/health`` over (each answers with its pid)."""
    return {httpx.get(url + "/health", timeout=10).json()["pid"] for _ in range(tries)}


def _processes_naming(text: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if "pgrep" not in line]


def test_two_replicas_answer_and_a_killed_one_comes_back(router_dir, pair_dir):
    # Ray's socket paths must stay under 107 bytes: a short folder of our own, removed at the end.
    ray_tmp = tempfile.mkdtemp(prefix="r2r-ray-", dir="/tmp")
    process, url = start_server(router_dir, pair_dir, "--ray", "--replicas", "2", "--cpus-per-replica", "0.5",
                                env={"RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        deadline = time.monotonic() + 120
        while len(pids := _replica_pids(url)) < 2:  # the second replica may still be loading
            assert time.monotonic() < deadline, "two replicas never answered"
            time.sleep(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=8)
        name = os.path.basename(str(router_dir))
        ask = dict(model=name, prompt="the old man said", max_tokens=6, temperature=0)
        expected = client.completions.create(**ask).choices[0].text

        victim = min(pids)
        os.kill(victim, signal.SIGKILL)
        for _ in range(6):  # answered throughout: the proxy sends to the live replica, clients retry the rest
            assert client.completions.create(**ask).choices[0].text == expected
        deadline = time.monotonic() + 120
        while True:  # Ray replaces the dead replica
            now = _replica_pids(url)
            if len(now) == 2 and victim not in now:
                break
            assert time.monotonic() < deadline, f"the killed replica was not replaced (replicas seen: {now})"
            time.sleep(1)
        assert client.completions.create(**ask).choices[0].text == expected
    finally:
        code = stop(process)
    assert code in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 60
    while left := _processes_naming(ray_tmp):
        assert time.monotonic() < deadline, f"processes outlived the server: {left}"
        time.sleep(1)
    shutil.rmtree(ray_tmp, ignore_errors=True)
