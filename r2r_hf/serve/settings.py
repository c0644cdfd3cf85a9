"""``ServeSettings``: every server default in one place (the CLI's ``serve`` flags are built from it)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, fields

from ..fields import setting


def is_loopback(host: str) -> bool:
    """Whether ``host`` answers this machine only: a loopback address, or a name that resolves to loopback only.

    A name that does not resolve counts as not loopback (binding it fails later, in one sentence of its own).
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host == "localhost":
            return True
        try:
            found = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return bool(found) and all(is_loopback(a.split("%")[0]) for a in found)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback; Python < 3.13 says no
    return (mapped or address).is_loopback


def key_problem(key: str) -> str | None:
    """What makes ``key`` impossible for a client to send as ``Authorization: Bearer <key>`` (the end of a sentence
    that names where the key came from), or None. Such a key would start the server, then answer every client 401."""
    if key.startswith("\ufeff"):
        return "starts with a UTF-8 byte-order mark (an editor wrote it), which no client sends; save it without one"
    lines = len(key.splitlines())
    if lines > 1:
        return f"holds {lines} lines; put the key alone on one line"
    # A header carries printable ASCII: clients refuse or re-encode the rest, and a NUL or line break ends it.
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        return (f"holds a character no HTTP header can carry ({key[bad]!a} at position {bad}); use printable ASCII "
                "only")
    return None


@dataclass
class ServeSettings:
    """How ``r2r-hf serve`` listens, batches and answers.

    Args:
        host: address to bind. 127.0.0.1 answers this machine only; 0.0.0.0 every network it is on, which needs
            an ``api_key`` or ``allow_unauthenticated``.
        port: TCP port (0: a free one, announced once bound).
        api_key: clients must send ``Authorization: Bearer <api_key>``; None lets anyone who reaches the
            address call. An empty or blank key is refused (an unset variable in a script would otherwise turn
            authentication off), and so is one with surrounding whitespace (HTTP strips it from the header, so no
            client could send it).
        allow_unauthenticated: serve on an address other than loopback without an ``api_key``. Off by default: an
            open server on a network is refused at start-up rather than announced in a log line nobody reads.
        model_name: the id ``/v1/models`` lists and requests must name (default: the router's name).
        max_batch_size: rows (answers) decoded together at most; new rows join a running batch between steps.
        batch_wait_ms: when the server is idle, how long the first request waits for others to arrive and
            start in the same batch.
        max_queue: requests waiting for a place in the batch at most; more are answered 429 with Retry-After.
        threshold: the routing threshold of requests that name none (default: the router's).
        llm_budget: the LLM budget of requests that name none (share of each answer's tokens; None: no budget).
        default_max_tokens: ``max_tokens`` of chat requests that name none (None: the rest of the context);
            completion requests default to 16, as OpenAI's do.
        drain_seconds: on SIGTERM, how long in-flight requests may take to finish before the server exits.
        capture: how the decoding steps run: ``auto`` captures every step (slot reads per rows and tokens bucket,
            the router) as CUDA graphs where the model's capture store captures (CUDA) and the guards allow, and runs
            eagerly otherwise, saying why once; ``graphs`` the same but refuses to start eagerly; ``compile``
            through ``torch.compile``; ``off`` eager.
        unfused_graphs: the graphs replay HF's own eager forward; by default (and where a model can be fused:
            ``core/fast/fused.py``) they replay fused reads, one inductor-compiled region per decoder layer (compiled at
            start-up: tens of seconds cold, cached on disk afterwards).
        max_context: with captured steps the slots are static (allocated at start, never moved): each holds this
            many tokens (prompt + answer); longer requests get a 400.
        prefill_chunk: a joining answer's prompt is read (by both models) at most this many tokens per turn of the
            decoding loop, so a long prompt adds one chunk's time to the running answers' next token, not its whole
            read (each turn reads one chunk of every joining prompt, then decodes one step of the others).
        llm_min_rows: the LLM runs once this many routed answers wait for it (``core/policy.py``): one number, or
            one per count of running answers (the last covers larger counts); 1 runs it in the step an answer routes.
            None: ``policy.default_policy`` for the models' device (a GPU waits, a CPU does not).
        llm_max_wait: or once the oldest waiting answer has waited this many steps (0: never wait; None: by device).
        draft_block: steps drafted on the device per host synchronisation (``core/fast/drafts.py``).
        speculate: routed positions an answer may go past with the SLM's token before it waits (0: off;
            ``core/speculation.py``); with it, ``llm_min_rows`` counts the answers holding pending positions.
        fixed_depth: with ``speculate``, answers at threshold 0 draft to their full depth every time; by default each
            one's depth follows its own acceptance (``core.policy.WaitPolicy.adapts``) where the device has no depth
            by load (a CPU: ``core.policy.speculative_policy``).
        draft_cost: with ``speculate``, answers at threshold 0 end each draft by the expected-gain rule
            (``core.moves.draft_ends``), an LLM forward costing this many SLM steps (``WaitPolicy.draft_cost``), or
            ``"auto"``: the pair's own ratio, timed when the server starts (``core/costs.py``).
        read_timeout: seconds a client may take to send a request, headers and body (slower ones are closed).
        write_timeout: seconds a client may leave its answer unread while the server's buffer for it is full (or
            its connection closes with bytes unsent); then the connection is aborted and the answer stops.
        max_connections: open connections at most, each counted until its descriptor is closed.
        max_body_bytes: a request body larger than this is answered 413 before it is read or parsed. The default
            (2 MiB, as TGI's 2 MB) holds a whole batch of long prompts (8 prompts of 32k tokens are about 1.2 MB as
            text); a larger body can only be refused as longer than the context, after its parse and tokenising
            have cost the server seconds and hundreds of MB (measured with the tests' tiny tokenizer: a 10 MB
            prompt took 14 s to tokenise and left the server 700 MB larger).
    """

    # Parsed on the command line by their annotation's type; __post_init__ says what is wrong with a value.
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0: every network)")
    port: int = setting(8000, "TCP port")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'; visible to every local user (ps): "
                                        "prefer --api-key-file or R2R_API_KEY")
    allow_unauthenticated: bool = setting(False, "serve on a non-loopback --host without an API key")
    model_name: str | None = setting(None, "model id to serve (default: the router's name)")
    max_batch_size: int = setting(8, "answers decoded together at most")
    batch_wait_ms: float = setting(5.0, "idle server: wait this long for more requests")
    max_queue: int = setting(64, "waiting requests at most (more get 429)")
    threshold: float | None = setting(None, "default routing threshold")
    llm_budget: float | None = setting(None, "default LLM budget: the LLM writes at most this share of an answer's "
                                             "tokens", parse="fraction")
    default_max_tokens: int | None = setting(None, "chat max_tokens when none is given")
    drain_seconds: float = setting(30.0, "SIGTERM: seconds to finish in-flight requests")
    capture: str = setting("auto", "auto: CUDA graphs of every step where the models can be captured (a GPU), else "
                                    "eager; graphs, compile (torch.compile) or off", parse="capture_mode")
    unfused_graphs: bool = setting(False, "capture HF's own forward, not the fused reads (one compiled region per "
                                          "decoder layer)")
    max_context: int | None = setting(None, "tokens per answer (prompt + answer) the static slots of the captured path "
                                            "hold (default: the pair's context, at most 4096)", parse="positive_int")
    prefill_chunk: int = setting(256, "a joining prompt is read this many tokens per step, between the running answers' "
                                      "steps", parse="positive_int")
    llm_min_rows: tuple[int, ...] | None = setting(None, "routed answers wait until this many wait for one LLM forward: "
                                                         "one number, or a comma-separated list by running answers "
                                                         "(1: never wait; default: by device, see the README)",
                                                   parse="min_rows")
    llm_max_wait: int | None = setting(None, "a routed answer waits at most this many steps for the LLM (default: by "
                                             "device)", parse="non_negative_int")
    speculate: int = setting(0, "a routed answer goes on with the SLM's token, up to this many routed positions "
                                "pending, until one LLM forward confirms or corrects them; answers do not change (0: "
                                "off; see the README)", parse="non_negative_int")
    speculate_below: float | None = setting(None, "with --speculate: an answer goes on past a routed position only "
                                                  "where the router's score is below this (default: everywhere)",
                                            parse="fraction")
    draft_confidence: float | None = setting(None, "with --speculate: an answer goes on past a routed position only "
                                                   "where the SLM's probability of its token is at least this (HF "
                                                   "assisted generation's 0.4; default: everywhere)", parse="fraction")
    fixed_depth: bool = setting(False, "with --speculate: answers at threshold 0 draft up to their depth every time "
                                       "(default: each answer's depth follows its own acceptance on a CPU; on a GPU "
                                       "the depth by load)")
    draft_cost: float | str | None = setting(None, "with --speculate: answers at threshold 0 end each draft where one "
                                                   "more token no longer pays for itself (the expected-gain rule), an "
                                                   "LLM forward costing this many SLM steps, or 'auto': timed on the "
                                                   "pair's device at start-up (2.5 for Qwen2.5-Coder 0.5B + 1.5B on a "
                                                   "CPU; default: off)", parse="draft_cost")
    draft_block: int | None = setting(None, "with captured steps: steps drafted on the device per host "
                                            "synchronisation while every running answer is greedy (1: a "
                                            "synchronisation per step; default: 4 on a GPU, 1 elsewhere)",
                                      parse="draft_block")
    read_timeout: float = setting(30.0, "seconds a client may take to send a request, headers and body (slower ones "
                                        "are closed)", parse="positive_seconds")
    write_timeout: float = setting(30.0, "seconds a client may leave its answer unread (the server's buffer for it "
                                         "full) before its connection is aborted and the answer stopped",
                                   parse="positive_seconds")
    max_connections: int = setting(512, "open connections at most, each counted until its descriptor is closed "
                                        "(lowered to what the open-file limit allows)", parse="positive_int")
    max_body_bytes: int = setting(2 * 2**20, "request bodies larger than this many bytes get 413 before they are read "
                                             "(2 MiB holds 8 prompts of 32k tokens; larger ones only cost parse and "
                                             "tokenise time and memory before the context refuses them)",
                                  parse="positive_int")

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        for name in ("read_timeout", "write_timeout"):
            if not 0 < getattr(self, name) < float("inf"):  # NaN fails too
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}.")
        self._check_access()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, got {self.port}.")
        if self.batch_wait_ms < 0 or self.drain_seconds < 0:
            raise ValueError("batch_wait_ms and drain_seconds must be >= 0.")
        if self.threshold is not None:
            from ..core.routing import check_threshold  # here: the CLI builds its flags from this class before torch

            self.threshold = check_threshold(self.threshold)
        if self.llm_budget is not None:
            from ..core.budget import check_budget  # here: the CLI builds its flags from this class before torch

            check_budget(self.llm_budget)
        from ..core.policy import (  # stdlib only, like this module
            check_block, check_confidence, check_cost_setting, check_max_wait, check_min_rows, check_one_depth_rule,
            check_speculate, check_speculate_below)

        if self.llm_min_rows is not None:
            self.llm_min_rows = check_min_rows(self.llm_min_rows)
        if self.llm_max_wait is not None:
            check_max_wait(self.llm_max_wait)
        check_speculate(self.speculate)
        check_speculate_below(self.speculate_below)
        check_confidence(self.draft_confidence)
        check_one_depth_rule(self.fixed_depth, check_cost_setting(self.draft_cost))
        if self.draft_block is not None:
            check_block(self.draft_block, "draft_block")
        self._check_speculation()
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}.")

    def _check_speculation(self) -> None:
        """Refuse settings under which speculation cannot happen: it needs routed answers that wait for the LLM."""
        for name in ("speculate_below", "draft_confidence", "fixed_depth", "draft_cost"):
            if getattr(self, name) not in (None, False) and not self.speculate:
                raise ValueError(f"{name}={getattr(self, name)} has no effect without speculate; set speculate "
                                 "(--speculate N) or remove it.")
        never = ("llm_max_wait=0" if self.llm_max_wait == 0 else
                 f"llm_min_rows={self.llm_min_rows}" if self.llm_min_rows and max(self.llm_min_rows) == 1 else None)
        if self.speculate and never:
            raise ValueError(f"speculate={self.speculate} never speculates: with {never} the LLM runs in the step an "
                             "answer routes; let routed answers wait (llm_max_wait > 0, llm_min_rows > 1) or remove "
                             "speculate.")

    def _check_access(self) -> None:
        """Refuse a key no client can send, and an open server on a network unless asked for."""
        if self.api_key is not None:
            if not self.api_key.strip():
                raise ValueError("api_key is empty; give a key, or None to serve without one.")
            if self.api_key != self.api_key.strip():
                raise ValueError("api_key starts or ends with whitespace, which HTTP strips from the header, so no "
                                 "client could send it; remove it.")
            if problem := key_problem(self.api_key):
                raise ValueError(f"api_key {problem}.")
        elif not self.allow_unauthenticated and not is_loopback(self.host):
            raise ValueError(f"{self.host!r} is not a loopback address and no API key is set, so anyone who can reach "
                             "it could use the server; set a key (R2R_API_KEY or --api-key-file on the command line) "
                             "or allow_unauthenticated=True to serve openly.")


SETTINGS_FIELDS = {f.name: f for f in fields(ServeSettings)}
