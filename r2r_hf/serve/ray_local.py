"""A Ray instance that ``r2r-hf serve --ray`` starts itself: loopback only, and gone when the command is.

**Loopback.** Left to itself, a local Ray takes the machine's network address as its node address, and its GCS,
raylet, object manager, dashboard agent, runtime-env agent and metrics exporters listen on it or on every
interface; whoever reaches the GCS can run code on the machine. A Ray that only this command uses needs none of
them outside the machine: clients reach the one HTTP port of Serve's proxy, which binds ``--host`` by itself.
So before Ray is imported (it reads the variable once, into its constants) the node address becomes
127.0.0.1, and every one of those servers then binds loopback; each Serve replica's own gRPC server, bound to
every interface whatever the node's address, is moved to loopback too (``loopback_replica_server``).
``tests/test_serve_ray.py`` lists every listening socket of the Ray's processes.

**Fate.** On Linux ``ray.init`` starts the GCS, raylet, dashboard and monitors with ``PR_SET_PDEATHSIG``, so the
kernel kills them when this process dies, even by SIGKILL (Ray's reaper process serves systems without it), and
the workers (Serve's controller, proxy, replicas) exit when their raylet does. The raylet's dashboard agent and
runtime-env agent are left: they notice their parent's death, then spend a minute or more reporting it to the
dead GCS (measured: 60-80 s). ``start_watchdog`` sweeps them: a small process of its own session notes this
process's descendants each second and, once this process is gone, kills those still alive (and any process
carrying this run's mark in its environment).

A cluster (``--ray-address``, or ``serve run``) is left as its operator configured it (docs/serving.md: the ports to
firewall).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

# Ray >= 2.9 reads it in ``ray._private.ray_constants``: off, ``services.get_node_ip_address`` answers
# 127.0.0.1 (its Windows/macOS default), and the node passes that address to every server it starts.
NODE_ON_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's own SIGTERM handler, active while ``ray.init`` runs, would wait this long for the node to drain before it
# exits; the command drains its replicas itself (``ray_serve._drain``), so a signal at start-up ends at once.
NO_NODE_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
OWNER_VARIABLE = "R2R_HF_RAY_OWNER"  # inherited by every process of the Ray this command starts
SWEEP_GRACE_S = 2.0  # SIGTERM, then this long before SIGKILL
WATCH_PERIOD_S = 1.0  # how often the watchdog notes the command's descendants
_watchdog: subprocess.Popen | None = None  # held for the process's life: its pipe's end is what the watchdog watches


def loopback_ray_environment(host: str | None = None) -> bool:
    """Make the Ray this process starts listen on loopback only; returns whether it will.

    Call before ``ray`` is imported. ``host`` is the address the server binds: a non-loopback one leaves Ray's
    own node address. Without ``host`` (``r2r-hf serve`` calls it before its settings exist) the Ray started here
    is loopback whatever ``--host`` is: no other machine needs its ports, only Serve's proxy, which binds
    ``--host`` itself.
    """
    from .settings import is_loopback  # here: the watchdog runs this file as a script, outside the package

    for name, value in NO_NODE_DRAIN.items():
        os.environ.setdefault(name, value)
    if host is not None and not is_loopback(host):
        return False
    os.environ.update(NODE_ON_LOOPBACK)
    return True


def loopback_replica_server() -> bool:
    """In a Serve replica on a loopback node: keep the replica's inter-deployment gRPC server on loopback too;
    returns whether it did.

    Ray Serve (2.5x) binds that server to ``[::]:0``, every interface, whatever the node's address, with no setting
    to change it (``ray.serve._private.replica``); on a loopback node every caller is on this machine, so the
    address it binds becomes 127.0.0.1 (wrapping Ray's helper, looked up by name: a Ray without it is left as is).
    Call before the replica finishes initialising (``ray_serve.R2RReplica.__init__``).
    """
    import ray

    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback", False) or ray.util.get_node_ip_address() != "127.0.0.1":
        return False

    def on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address[len("[::]:"):]
        return bind(server, address)

    on_loopback.loopback = True
    replica.add_port_to_grpc_server = on_loopback
    return True


def start_watchdog() -> str | None:
    """Start the process that ends the Ray about to be started here once this process has ended, however it ended;
    returns the run's mark (None where there is no ``/proc`` to find the processes by: not Linux).

    Call before ``ray.init``: the mark goes into the environment every Ray process inherits. The watchdog runs in
    a session of its own, so a signal to this process group (Ctrl-C) does not end it first.
    """
    global _watchdog
    if not os.path.isdir("/proc/self"):
        return None
    mark = f"{os.getpid()}-{uuid.uuid4().hex}"
    _watchdog = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), mark],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
    os.environ[OWNER_VARIABLE] = mark
    return mark


Process = tuple[int, str]  # a pid and its start time (a pid reused by another process has another start time)


def _table() -> dict[int, tuple[int, str, bytes]]:
    """Every live process: pid -> (parent pid, start time, environment)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (command)": the command may hold spaces
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        if fields[0] != b"Z":  # a zombie is dead already
            table[int(name)] = (int(fields[1]), fields[19].decode(), environ)
    return table


def ray_processes(root: int, mark: str, known: set[Process] = frozenset()) -> set[Process]:
    """The live processes of the Ray ``root`` started: its descendants, those carrying ``mark`` in their
    environment, and those of ``known`` still alive. Each way misses some: an orphan is no longer a descendant,
    and Ray's process titles (setproctitle) may blank a process's environment as /proc shows it."""
    table = _table()
    needle = f"{OWNER_VARIABLE}={mark}".encode()
    found = {(pid, start) for pid, (_, start, environ) in table.items() if needle in environ.split(b"\0")}
    found |= {(pid, start) for pid, start in known if pid in table and table[pid][1] == start}
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.add((pid, table[pid][1]))
        todo.extend(children.get(pid, []))
    return {p for p in found if p[0] != os.getpid()}


def sweep(processes: set[Process], grace: float = SWEEP_GRACE_S) -> None:
    """SIGTERM ``processes``, then SIGKILL those still alive after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        for pid, _ in processes:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            table = _table()
            processes = {(pid, start) for pid, start in processes if pid in table and table[pid][1] == start}
            if not processes:
                return
            time.sleep(0.1)


def _watch(root: int, mark: str) -> None:
    """The watchdog: stdin is a pipe whose other end only the command holds, so EOF means it has ended. Meanwhile
    it notes the command's descendants each second: once the command is gone, Ray's orphans are no longer its."""
    import select

    known: set[Process] = set()
    while True:
        if select.select([sys.stdin], [], [], WATCH_PERIOD_S)[0] and not os.read(sys.stdin.fileno(), 1 << 16):
            break
        known = ray_processes(root, mark, known)
    sweep(ray_processes(root, mark, known))


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
