"""The server's decoding thread: one running batch that requests join and leave between steps.

Every step runs the R2R loop's steps (``core.decoding``: propose, route, catch up, commit, SLM step)
for every row of the batch. Between steps, waiting requests join (``core.batching.merge``: their
prompts are prefilled and left-aligned to the batch), and finished or abandoned rows leave
(``core.batching.select``). So a request arriving while long answers decode starts at the next step
instead of waiting for them ("continuous" batching), and a client that goes away stops costing
compute at the next step.

The thread owns the model: HTTP handlers only ``submit`` and ``cancel`` requests and receive events
through the request's ``emit`` (from this thread): ``("text", choice, piece)``, ``("end", choice,
finish_reason, generated_tokens, llm_tokens)`` and ``("error", APIError)``. An exception inside a
step answers the batch's requests with a 500 and the thread keeps serving.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable

import torch

from ..core.batching import grown, merge, select, splice_problem
from ..core.decoding import Batch, catch_up, commit, propose_and_route, start
from ..core.engines import EagerSteps
from ..core.features import input_device, positions_from_mask
from ..core.routing import Routing
from ..core.sampling import RowSampler, seeded_generator
from ..core.steps import Committed
from .protocol import APIError
from .rows import Row, RowProcessors, Sampling
from .settings import ServeSettings

logger = logging.getLogger(__name__)


class Request:
    """One HTTP request's work: a prompt and settings per row (choice), and where its events go.

    Args:
        prompts: token ids per row.
        samplings: settings per row.
        emit: called from the engine thread with each event (see the module docstring).
    """

    def __init__(self, prompts: list[list[int]], samplings: list[Sampling], emit: Callable[[tuple], None]) -> None:
        self.prompts, self.samplings, self.emit = prompts, samplings, emit
        self.cancelled = False

    @property
    def rows(self) -> int:
        return len(self.prompts)


class Engine:
    """The decoding thread of one model (see the module docstring).

    Args:
        model: an ``R2RForCausalLM`` with its pair attached.
        tokenizer: the SLM's tokenizer (decodes the answers).
        settings: batch size, queue length, batching wait.
    """

    def __init__(self, model, tokenizer, settings: ServeSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        problems = [p for p in (splice_problem(model.slm), splice_problem(model.llm)) if p]
        # Without splicing, new rows start only when the batch is empty (requests still batch when they arrive together).
        self.continuous = not problems
        if problems:
            logger.warning("requests join only an idle batch: %s", problems[0])
        eos = model.generation_config.eos_token_id
        self.eos_ids = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.device = input_device(model.slm)
        self.pair = model.routed_pair().for_call()  # one router state for the server's one running batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.cond = threading.Condition()
        self.rows: list[Row] = []
        self.batch: Batch | None = None
        self.steps: EagerSteps | None = None
        self.routing: Routing | None = None
        self.stopping = False
        # Counters (read by tests and /health-style checks): steps decoded, the most rows one step
        # decoded, and how often rows joined a batch that was already decoding.
        self.steps_run = self.peak_rows = self.joins_running = 0
        self.thread = threading.Thread(target=self._run, name="r2r-engine", daemon=True)

    # ------------------------------------------------------------ the HTTP side
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the rows in flight, then end the thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout)

    def submit(self, request: Request) -> None:
        """Queue a request; a full queue is refused with 429 and Retry-After."""
        if request.rows > self.settings.max_batch_size:
            raise APIError(400, f"n={request.rows} answers exceed this server's batch of {self.settings.max_batch_size} "
                                "rows; ask for fewer.", param="n")
        with self.cond:
            if self.stopping:
                raise APIError(503, "The server is shutting down; retry on another replica.", kind="server_error",
                               headers={"Retry-After": "1"})
            if len(self.waiting) >= self.settings.max_queue:
                raise APIError(429, f"The server's queue is full ({self.settings.max_queue} requests wait); retry "
                                    "shortly.", kind="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
            self.waiting.append(request)
            self.cond.notify_all()

    def cancel(self, request: Request) -> None:
        """The client went away: its rows leave the batch at the next step."""
        request.cancelled = True

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                newcomers = self._admit()
                if newcomers is None:
                    return
                try:
                    if newcomers:
                        self._join(newcomers)
                    self._drop_cancelled()
                    if self.rows:
                        self._step()
                except Exception as err:  # noqa: BLE001 - one batch fails, the server goes on
                    logger.exception("a decoding step failed")
                    self._fail_all(newcomers, err)

    def _admit(self) -> list[Request] | None:
        """Requests that join now (waiting while idle); None when the engine stops."""
        s = self.settings
        with self.cond:
            while not self.waiting and not self.rows:
                if self.stopping:
                    return None
                self.cond.wait()
            if not self.rows and s.batch_wait_ms > 0:  # idle: let requests arriving together start together
                deadline = time.monotonic() + s.batch_wait_ms / 1e3
                while sum(r.rows for r in self.waiting) < s.max_batch_size and time.monotonic() < deadline:
                    self.cond.wait(deadline - time.monotonic())
            room = s.max_batch_size - len(self.rows) if (self.continuous or not self.rows) else 0
            taken = []
            while self.waiting and self.waiting[0].rows <= room:
                request = self.waiting.popleft()
                if not request.cancelled:
                    taken.append(request)
                    room -= request.rows
            return taken

    def _join(self, requests: list[Request]) -> None:
        rows = [Row(r, i, s, self.tokenizer, self.eos_ids, self._generator(s)) for r in requests
                for i, s in enumerate(r.samplings)]
        prompts = [p for r in requests for p in r.prompts]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends in the last column
            ids[i, width - len(p):] = torch.tensor(p, device=self.device)
            mask[i, width - len(p):] = 1
        seq = Committed.from_prompt(ids, mask, positions_from_mask(mask), 2 * width + 16)
        p = self.pair
        steps = EagerSteps(p.slm, p.llm, p.router, p.num_topk, None, 0)
        newcomers = start(self._routing(rows, steps), seq, max(r.sampling.max_tokens for r in rows))
        if self.batch is None:
            self.batch, self.steps = newcomers, steps
        else:
            self.batch = merge(self.batch, self.steps, newcomers, steps)
            self.joins_running += 1
        self.rows += rows
        self.routing = self._routing(self.rows, self.steps)

    def _generator(self, sampling: Sampling) -> torch.Generator | None:
        """A sampling row's own random stream: its seed's, or a fresh one."""
        if not sampling.do_sample:
            return None
        return seeded_generator(sampling.seed if sampling.seed is not None else _fresh_seed(), self.device)

    def _routing(self, rows: list[Row], steps: EagerSteps) -> Routing:
        threshold = torch.tensor([r.sampling.threshold for r in rows], device=self.device)
        # Every row keeps a budget state (inf: none), so rows with and without one share a batch.
        budget = torch.tensor([math.inf if r.sampling.llm_budget is None else r.sampling.llm_budget for r in rows],
                              dtype=torch.float64, device=self.device)
        return Routing(self.pair.router, self.pair.vocab_size, threshold, RowProcessors([r.sampling for r in rows]),
                       RowSampler([r.generator for r in rows]), steps, budget)

    def _step(self) -> None:
        batch, routing = self.batch, self.routing
        batch.seq = grown(batch.seq, 2 * batch.seq.length + 16) if batch.seq.length + 1 >= batch.seq.ids.shape[1] \
            else batch.seq
        running = torch.ones(len(self.rows), dtype=torch.bool, device=self.device)
        proposal = propose_and_route(routing, batch, running)
        token = proposal.token
        if bool(proposal.routed.any()):
            token, _, _ = catch_up(routing, batch, proposal)
        commit(routing, batch, token)
        self.steps_run, self.peak_rows = self.steps_run + 1, max(self.peak_rows, len(self.rows))
        finished = []
        for i, (row, tok, routed) in enumerate(zip(self.rows, token.tolist(), proposal.routed.tolist())):
            piece = row.add(tok, routed)
            if piece:
                self._emit(row.owner, ("text", row.choice, piece))
            if row.finish is not None:
                self._emit(row.owner, ("end", row.choice, row.finish, row.generated, row.llm_tokens))
                finished.append(i)
        if finished:
            self._leave(set(finished))

    def _drop_cancelled(self) -> None:
        gone = {i for i, row in enumerate(self.rows) if row.owner.cancelled}
        if gone:
            self._leave(gone)

    def _leave(self, rows: set[int]) -> None:
        keep = [i for i in range(len(self.rows)) if i not in rows]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.batch = self.steps = self.routing = None
            return
        self.batch = select(self.batch, self.steps, keep)
        self.routing = self._routing(self.rows, self.steps)

    def _emit(self, request: Request, event: tuple) -> None:
        try:
            request.emit(event)
        except RuntimeError:  # the request's event loop is gone: nobody listens any more
            request.cancelled = True

    def _fail_all(self, newcomers: list[Request], err: Exception) -> None:
        owners = {id(r.owner): r.owner for r in self.rows}
        owners.update({id(r): r for r in newcomers})
        error = APIError(500, f"Decoding this batch failed ({type(err).__name__}: {err}); the server keeps serving, "
                              "retry the request.", kind="server_error")
        for request in owners.values():
            self._emit(request, ("error", error))
        self.rows, self.batch, self.steps, self.routing = [], None, None, None


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1
