"""The listening socket and its connections: bound before the models load, guarded against slow clients.

``bind_listener`` takes the port first, so a port in use is one sentence before minutes of loading;
``GuardedH11Protocol`` is uvicorn's HTTP/1.1 protocol with what uvicorn lacks against Slowloris: a deadline
for a request to arrive (uvicorn arms its keep-alive timer only after a response, so a connection that never
finishes its headers is held for ever), a deadline for the client to read its answer (uvicorn waits for a full
buffer to drain for ever, and so does a closing transport), and a cap on open connections checked when a
connection opens and counting each until its descriptor is closed (uvicorn's ``limit_concurrency`` counts a
connection only once its headers are complete, and answers 503 to requests the engine's queue would take: the
queue's own 429 is the right answer there). It also tells the app whether each answer left the server
(``Sent``, in the request's scope), so one its client never read is not counted completed.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
from collections.abc import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

# Descriptors the process keeps for itself beside its connections (the idle CPU server holds ~16; CUDA, its
# libraries and Ray's pipes add tens more).
RESERVED_DESCRIPTORS = 128
SENT = "r2r.sent"  # the scope key of a request's ``Sent``


class Sent:
    """Whether a response left the server, told once to whoever watches: True once its last byte left the server's
    buffers (or its client, reading, drained them, or sent its next request), False where the connection closed
    with some of it unsent (aborted unread, reset, or cut before the response was complete)."""

    def __init__(self) -> None:
        self.result: bool | None = None
        self._watchers: list[Callable[[bool], None]] = []

    def then(self, watcher: Callable[[bool], None]) -> None:
        """Call ``watcher(result)`` once it is known (now, if it is)."""
        if self.result is None:
            self._watchers.append(watcher)
        else:
            watcher(self.result)

    def tell(self, delivered: bool) -> None:
        if self.result is None:
            self.result, watchers, self._watchers = delivered, self._watchers, []
            for watcher in watchers:
                watcher(delivered)


def url_of(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), not yet listening: connections during start-up are
    refused at once rather than left waiting. Raises OSError in one sentence when the address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    sock = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn: a restart is not refused for the previous server's connections in TIME_WAIT. Linux still
    # refuses a port another socket listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise OSError(f"Port {port} on {host} is already in use (another server?); choose another --port or "
                          "stop the server using it.") from None
        if isinstance(err, socket.gaierror):
            raise OSError(f"Cannot listen on {host!r}: not an address of this machine ({err.strerror}).") from None
        raise OSError(f"Cannot listen on {host}:{port}: {err.strerror}.") from None
    sock.set_inheritable(False)
    return sock


def connection_limit(asked: int) -> int:
    """``asked``, lowered (with a warning) to what the open-file limit leaves after the process's own needs."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here (Windows)
        return asked
    if soft == resource.RLIM_INFINITY:
        return asked
    room = max(1, soft - RESERVED_DESCRIPTORS)
    if asked > room:
        logger.warning("--max-connections %d lowered to %d: the open-file limit is %d and the server keeps %d "
                       "descriptors for itself (raise it with ulimit -n).", asked, room, soft, RESERVED_DESCRIPTORS)
        return room
    return asked


_BUSY_BODY = json.dumps({"error": {"message": "Too many open connections; retry shortly.", "type": "server_error",
                                   "param": None, "code": "too_many_connections"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        b"connection: close\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read and write deadlines and a connection cap (values set by ``guarded``).

    A connection waiting for a request has ``read_timeout`` seconds (from its opening, or from the end of its
    previous answer) to send all of it, headers and body; a slower one is closed. Until its headers are in it is
    also the first to go when the cap is reached: a client that sends its request at once is served while slow
    ones fill the server. An answer its client does not read (the transport's buffer stays full, or a closing
    connection keeps unsent bytes) for ``write_timeout`` seconds is aborted: the answer's rows leave the batch as
    for any client that went away. A connection counts towards the cap until its descriptor is closed, so nothing
    can hold more descriptors than the cap.
    """

    read_timeout: float = 30.0
    write_timeout: float = 30.0
    max_connections: int = 512

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.refused, self.waiting_since, self.deadline, self.stall = False, None, None, None
        self.sent: Sent | None = None  # the current request's
        if len(self.connections) >= self.max_connections and not self._evict_one():
            self.refused, self.transport = True, transport
            transport.write(BUSY)
            transport.close()  # once the answer is flushed
            return
        super().connection_made(transport)
        self._await_request()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for its headers; False when every one is in a request."""
        waiting = [c for c in self.connections if getattr(c, "waiting_since", None) is not None]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.waiting_since).drop()
        return True

    def _await_request(self) -> None:
        self._stop_deadline()
        self.waiting_since = self.loop.time()
        self.deadline = self.loop.call_later(self.read_timeout, self.drop)

    def _stop_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.waiting_since = self.deadline = None

    def drop(self) -> None:
        """Close a connection whose request did not arrive in time, or that is evicted; nothing is answered.

        It stays counted until ``connection_lost`` (the descriptor closed, on the loop's next turn). Unsent bytes
        of an earlier answer are thrown away: a transport closing with them waits for its client to read, for ever
        if it never does."""
        self._stop_deadline()
        if self.transport.get_write_buffer_size():
            self._delivered(False)
            self.transport.abort()
        elif not self.transport.is_closing():
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_stall()  # the client reads slower than its answer comes: it has write_timeout to take some

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_stall()
        if self.cycle is not None and self.cycle.response_complete:
            self._delivered(True)  # its client reads the rest

    def _arm_stall(self) -> None:
        if self.stall is None:
            self.stall = self.loop.call_later(self.write_timeout, self._stalled)

    def _disarm_stall(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _stalled(self) -> None:
        """The client left its answer unread for ``write_timeout`` s: abort (its stream sees the disconnect)."""
        self.stall = None
        logger.warning("a client left its answer unread for %g s (--write-timeout): its connection is aborted",
                       self.write_timeout)
        self._delivered(False)
        self.transport.abort()

    def _delivered(self, delivered: bool) -> None:
        if self.sent is not None:
            self.sent.tell(delivered)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and SENT not in self.cycle.scope:  # a new request (before its app runs)
            self._delivered(True)  # its client read the previous answer
            self.sent = self.cycle.scope[SENT] = Sent()
        state = self.conn.their_state
        if state is not h11.IDLE:
            self.waiting_since = None  # its headers are in: no longer the first to go
        if self.deadline is not None and state is not h11.IDLE and state is not h11.SEND_BODY:
            self._stop_deadline()  # the whole request is in

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.get_write_buffer_size():
            self._delivered(True)
        if self.transport.is_closing():
            if self.transport.get_write_buffer_size():
                self._arm_stall()  # the close waits until the client has read the rest: write_timeout to do it
        elif self.conn.their_state is h11.IDLE:
            self._await_request()  # kept alive: the next request has the same time to arrive

    def connection_lost(self, exc: Exception | None) -> None:
        if self.refused:
            return
        self._stop_deadline()
        self._disarm_stall()
        # (a close that waited for the client to read the rest ends here with exc None: the answer left)
        self._delivered(exc is None and self.cycle is not None and self.cycle.response_complete)
        super().connection_lost(exc)  # counted out here: the descriptor is closed


def guarded(read_timeout: float, max_connections: int, write_timeout: float = 30.0) -> type[GuardedH11Protocol]:
    """The protocol class for one server's limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"read_timeout": read_timeout, "max_connections": max_connections, "write_timeout": write_timeout})


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that calls ``announce(port)`` once it accepts connections (after its start-up), and
    ``on_exit()`` when a signal asks it to stop, before uvicorn's own shutdown begins."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[int], None],
                 on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.announce, self.on_exit = announce, on_exit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self.announce(self.servers[0].sockets[0].getsockname()[1])

    def handle_exit(self, sig, frame) -> None:
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)


def serve_on(app, sock: socket.socket, settings, announce: Callable[[int], None],
             on_exit: Callable[[], None] | None = None, grace: float = 0.0) -> None:
    """Run ``app`` on the bound ``sock`` until SIGINT/SIGTERM; uvicorn gives in-flight answers ``drain_seconds`` +
    ``grace`` seconds to finish."""
    protocol = guarded(settings.read_timeout, connection_limit(settings.max_connections), settings.write_timeout)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", http=protocol,
                            timeout_graceful_shutdown=settings.drain_seconds + grace)
    try:
        AnnouncingServer(config, announce, on_exit).run(sockets=[sock])
    except OSError as err:  # listen() lost a race for the port to a server that started meanwhile
        if err.errno == errno.EADDRINUSE:
            raise OSError(f"Port {settings.port} on {settings.host} was taken while the models loaded; choose "
                          "another --port.") from None
        raise
    finally:
        sock.close()
