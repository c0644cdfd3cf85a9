"""The Ray command's rules without starting Ray: what fits on a Ray started here, the loopback environment, and
the watchdog that ends a Ray started here with the command (a plain process tree stands in for Ray's).

From issue 34's third hostile probe (items 16-18); the tests that start Ray are in ``test_serve_ray.py`` (marked
``ray``, run alone)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("ray.serve")

from r2r_hf.serve import ray_local
from r2r_hf.serve.ray_serve import _starting_replicas, unfit


def test_replicas_that_cannot_fit_are_refused_in_one_sentence():
    here = {"CPU": 2.0, "memory": 1e10}
    why = unfit(here, 1000, 1.0, 0.0)
    assert why == ("1000 replica(s) reserving 1 CPU each need 1000 CPU in all, but the Ray started here has 2; "
                   "lower --replicas or --cpus-per-replica, or join a cluster with --ray-address.")
    assert "has 0; lower --replicas or --gpus-per-replica" in unfit(here, 1, 1.0, 1.0)  # no GPU at all
    assert unfit(here, 4, 0.5, 0.0) is None and unfit({**here, "GPU": 1.0}, 2, 0.5, 0.5) is None


def test_autoscaling_counts_the_replicas_it_starts_with():
    assert _starting_replicas(3, None) == 3
    assert _starting_replicas(3, {"min_replicas": 2, "max_replicas": 8}) == 2
    assert _starting_replicas(3, {"min_replicas": 0, "initial_replicas": 4}) == 4
    assert _starting_replicas(3, {"min_replicas": 0}) == 1  # one replica must fit for it ever to serve


def test_the_loopback_environment_follows_the_host(monkeypatch):
    for name in (*ray_local.NODE_ON_LOOPBACK, *ray_local.NO_NODE_DRAIN):
        monkeypatch.delenv(name, raising=False)
    assert not ray_local.loopback_ray_environment("0.0.0.0")
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ
    assert os.environ["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"  # a signal at start-up ends at once anyway
    assert ray_local.loopback_ray_environment("127.0.0.1") and ray_local.loopback_ray_environment()
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


# A command that starts the watchdog, then leaves two orphans behind, as Ray's raylet leaves its agents: one
# without the run's mark (its environment blanked, as Ray's process titles may show it) orphaned after the
# watchdog has seen it as a descendant, and one with the mark orphaned at once.
COMMAND = textwrap.dedent("""
    import os, subprocess, sys
    from r2r_hf.serve import ray_local
    ray_local.start_watchdog()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    def orphan(after, **kw):
        code = f"import subprocess, time; print(subprocess.Popen({sleeper!r}, **{kw!r}).pid, flush=True); time.sleep({after})"
        parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        return parent, int(parent.stdout.readline())
    unmarked = {k: v for k, v in os.environ.items() if k != ray_local.OWNER_VARIABLE}
    seen, first = orphan(2 * ray_local.WATCH_PERIOD_S, env=unmarked)
    at_once, second = orphan(0)
    seen.wait(), at_once.wait()
    print(first, second, flush=True)
    import time; time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the watchdog finds processes through /proc (Linux)")
def test_the_watchdog_ends_what_the_command_started_when_it_is_killed():
    command = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(p) for p in command.stdout.readline().split()]
        assert len(pids) == 2 and all(map(_alive, pids))
        command.kill()
        command.wait(10)
        deadline = time.monotonic() + ray_local.SWEEP_GRACE_S + 10
        while any(map(_alive, pids)):
            assert time.monotonic() < deadline, "the command's processes outlived it"
            time.sleep(0.1)
    finally:
        command.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
