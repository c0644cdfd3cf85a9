"""Running untrusted model-written code: one subprocess per program, a timeout, no network.

Each program runs in a fresh interpreter (``python -I``) in an empty temporary folder, in its own
session (so a timeout kills everything it started), with a memory cap and with Python's socket
functions replaced by ones that raise. Where ``unshare -n`` works (Linux, root), the process also
runs in an empty network namespace. A hang, a crash or a failing test is a failed task; nothing a
program does can stop the harness.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PREAMBLE = """\
import resource as _resource, socket as _socket
_resource.setrlimit(_resource.RLIMIT_AS, ({memory}, {memory}))
if {cpu} is not None:
    _resource.setrlimit(_resource.RLIMIT_CPU, ({cpu}, {cpu} + 1))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_socket.socket = _socket.create_connection = _socket.getaddrinfo = _socket.socketpair = _no_network
del _resource, _socket
"""


@dataclass
class Outcome:
    """How a program ended: ``passed``, ``failed``, ``timeout`` or ``crashed``, with the error's last line."""

    status: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _isolation_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and hasattr(os, "geteuid") and os.geteuid() == 0:
        probe = subprocess.run([unshare, "-n", "true"], capture_output=True)
        if probe.returncode == 0:
            return [unshare, "-n"]
    return []


_PREFIX: list[str] | None = None


def run_program(code: str, timeout: float = 10.0, memory_bytes: int = 2 << 30, cpu_seconds: int | None = None) -> Outcome:
    """Run ``code`` in a sandboxed subprocess; exit status 0 within ``timeout`` seconds passes.

    Args:
        code: a Python program (solution followed by its tests).
        timeout: wall-clock seconds before the process group is killed.
        memory_bytes: address-space cap.
        cpu_seconds: CPU-time cap (None: none). On a loaded machine wall time depends on the neighbours; a CPU
            cap does not, so an answer is graded the same whatever else runs (give ``timeout`` room above it).
    """
    global _PREFIX
    if _PREFIX is None:
        _PREFIX = _isolation_prefix()
    with tempfile.TemporaryDirectory(prefix="r2r-sandbox-") as folder:
        program = Path(folder, "program.py")
        program.write_text(PREAMBLE.format(memory=memory_bytes, cpu=cpu_seconds) + code, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder, "PYTHONHASHSEED": "0"}
        proc = subprocess.Popen(
            [*_PREFIX, sys.executable, "-I", "-B", str(program)], cwd=folder, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome("timeout", f"no result after {timeout:g} s")
    text = err.decode("utf-8", "replace").strip().splitlines()
    last = text[-1] if text else ""
    if proc.returncode == 0:
        return Outcome("passed")
    if proc.returncode == -signal.SIGXCPU or (cpu_seconds is not None and proc.returncode == -signal.SIGKILL):
        return Outcome("timeout", f"more than {cpu_seconds} s of CPU time")
    if proc.returncode < 0:
        return Outcome("crashed", f"killed by signal {-proc.returncode}")
    return Outcome("failed", last[:300])
