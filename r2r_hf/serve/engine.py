"""The server's decoding thread: a queue of requests and one running batch, advanced one step at a time.

Each turn of the loop: **decide** (``_schedule``: which queued requests join the free slots, which rows leave
because their client went away; a plain ``Admission``), **do** (leave, join, one ``core.turn.turn`` of the batch:
a piece of each prompt being read, one step — the step ``generate`` runs — and the ended rows leave), **update**
the requests (text, end and error events, from what the turn's ``rows.Delivery`` recorded of the tokens the step's
one host synchronisation read). A request arriving while long answers decode joins at the next
step ("continuous" batching); a client that goes away stops costing compute at the next step.

The batch gives every row a slot of its own (``core/layouts/slot_layout.py``): joining prefills the newcomers' prompts into
free slots, leaving frees the slot, and no running row's cache is copied. Routed rows wait for the LLM until
``ServeSettings.llm_min_rows`` rows wait or the oldest has waited ``llm_max_wait`` steps (``core/policy.py``),
so one LLM forward serves several rows; a row's answer never depends on the policy or its neighbours. A model
whose forward cannot read slots (attention other than sdpa/eager, an architecture that ignores a prepared
mask) is served one answer at a time on HF's own caches, with the reason logged once.

The thread owns the model: HTTP handlers only ``submit`` and ``cancel`` requests and receive events through
the request's ``emit`` (from this thread): ``("text", choice, piece)``, ``("end", choice, finish_reason,
generated_tokens, llm_tokens, speculated)`` (``core.ledger.Speculated``) and ``("error", APIError)``. A row
whose draw fails ends that request only; an exception inside a step answers the batch's requests with a 500 and
the thread keeps serving.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from ..core.batch import Joiner, RunningBatch
from ..core.counters import Counters
from ..core.features import input_device
from ..core.routing import Routing
from ..core.sampling import Sampler
from ..core.turn import turn
from .capture import capture_batch, capture_plan
from .errors import APIError
from .metrics import ServeMetrics
from .policy import served_policy
from .rows import Delivery, Row
from .settings import ServeSettings
from .trace import Trace
from .work import Admission, Request, fresh_seed

logger = logging.getLogger(__name__)
START_COLUMNS = 256  # slot columns allocated at first (they grow, doubling, when an answer needs more)


class Engine:
    """The decoding thread of one model (see the module docstring).

    Args:
        model: an ``R2RForCausalLM`` with its pair attached.
        tokenizer: the SLM's tokenizer (decodes the answers).
        settings: batch size, queue length, batching wait, the LLM's waiting policy.
    """

    def __init__(self, model, tokenizer, settings: ServeSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.pair = model.routed_pair().for_call()  # one router state for the server's one running batch
        self.device = input_device(model.slm)
        self.policy = served_policy(settings, model, self.pair, self.device.type)  # (``policy.py``)
        self.counters = Counters()
        self.metrics = ServeMetrics(self)
        self.trace = Trace.from_env(self.counters)  # benchmarks only (R2R_SERVE_TRACE)
        self._said: set[str] = set()
        problem = self.pair.abilities.slots
        self.slotted = problem is None
        if problem:
            logger.warning("answers are decoded one at a time on HF's caches: %s", problem)
        self.queue: collections.deque[Request] = collections.deque()
        self.capture_report: dict = {"path": "eager", "why": problem or None}
        self.batch: RunningBatch | None = self._new_batch() if self.slotted else None
        self.later: collections.deque[tuple[Request, int]] = collections.deque()  # without slots: rows to come
        self.cond = threading.Condition()
        self.stopping = False
        self.abort_at: float | None = None  # when a drain ends the answers still open
        self.peak_rows = self.joins_running = 0  # the most rows one step decoded; joins into a decoding batch
        self.thread = threading.Thread(target=self._run, name="r2r-engine", daemon=True)

    def _new_batch(self) -> RunningBatch:
        """An empty batch of slots: static and captured where ``capture.capture_plan`` allows, else growing and eager."""
        capturer, why, columns = capture_plan(self.model, self.pair.abilities, self.settings, self.device)
        batch = RunningBatch.for_slots(self.pair, self.settings.max_batch_size, columns or START_COLUMNS,
                                       self.device, self.counters)
        if capturer is None:
            if why and why not in self._said:
                self._said.add(why)
                logger.warning("the server's steps run eagerly: %s", why)
            self.capture_report = {"path": "eager", "why": why}
        else:  # every step now, before the server listens (inference mode: as the decoding thread replays them)
            self.capture_report = capture_batch(batch, self.model, self.settings, capturer, self.device, self.policy)
        return batch

    @property
    def max_context(self) -> int | None:
        """Tokens per answer the slots hold when they are static (captured), else None (they grow)."""
        layout = None if self.batch is None else self.batch.layout
        return layout.capacity - 1 if layout is not None and layout.static else None

    # ------------------------------------------------------------ the HTTP side
    @property
    def rows(self) -> list[Row]:
        """The answers in the running batch."""
        return [] if self.batch is None else [self.batch.ledger.rows[r].owner for r in self.batch.ledger.occupied()]

    @property
    def steps_run(self) -> int:
        return self.counters.steps

    def start(self) -> None:
        self.thread.start()

    def drain(self, seconds: float) -> None:
        """Stop taking requests; the answers in flight (and queued) get ``seconds`` to finish, then each still
        open ends with an error event ("the server is shutting down") rather than being cut mid-stream."""
        with self.cond:
            self.stopping = True
            if self.abort_at is None:
                self.abort_at = time.monotonic() + seconds
            self.cond.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """``drain(timeout)`` (unless a drain already began), then wait for the thread to end."""
        self.drain(timeout if timeout is not None else float("inf"))
        if self.thread.ident is not None:  # (an engine never started has no thread to wait for)
            self.thread.join(None if timeout is None else timeout + 30)

    def submit(self, request: Request) -> None:
        """Queue a request; a full queue is refused with 429 and Retry-After."""
        if request.rows > self.settings.max_batch_size:
            raise APIError(400, f"{request.rows} answers exceed this server's batch of {self.settings.max_batch_size} "
                                "rows; ask for fewer.", param="n")
        with self.cond:
            if self.stopping:
                raise self.metrics.rejected(APIError(503, "The server is shutting down; retry on another replica.",
                                                     kind="server_error", headers={"Retry-After": "1"}))
            if len(self.queue) >= self.settings.max_queue:
                raise self.metrics.rejected(APIError(429, f"The server's queue is full ({self.settings.max_queue} "
                                                          "requests wait); retry shortly.", kind="rate_limit_error",
                                                     code="queue_full", headers={"Retry-After": "1"}))
            self.queue.append(request)
            self.cond.notify_all()

    def cancel(self, request: Request) -> None:
        """The client went away: a queued request leaves the queue now, its running rows at the next step."""
        with self.cond:
            if request.cancelled or not request.open:  # already answered (or failed): nothing to do
                return
            request.cancelled = True
            self.metrics.request_ended(request, "cancelled")
            if request in self.queue:
                self.queue.remove(request)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                plan = self._schedule()
                if plan is None:
                    return
                if self.abort_at is not None and time.monotonic() >= self.abort_at:
                    self._shut(plan.joining)
                    return
                started = time.monotonic()
                try:
                    self._turn(plan)
                except Exception as err:  # noqa: BLE001 - one batch fails, the server goes on
                    logger.exception("a decoding step failed")
                    self._fail_all(plan.joining, err)
                if self.trace is not None:
                    self.trace.turn(started, time.monotonic(), len(self.rows))

    def _schedule(self) -> Admission | None:
        """Decide the turn: who joins (waiting while idle), who leaves; None when the engine stops."""
        s = self.settings
        batch = self.batch
        with self.cond:
            while not self.queue and not (batch is not None and batch.ledger.occupied()):
                if self.stopping:
                    return None
                self.cond.wait()
                batch = self.batch
            running = (batch is not None and bool(batch.ledger.occupied())) or bool(self.later)
            if not running and s.batch_wait_ms > 0:  # idle: let requests arriving together start together
                deadline = time.monotonic() + s.batch_wait_ms / 1e3
                while sum(r.rows for r in self.queue) < s.max_batch_size and time.monotonic() < deadline:
                    self.cond.wait(deadline - time.monotonic())
            ledger = None if batch is None else batch.ledger
            leaving = [] if ledger is None else [r for r in ledger.occupied() if ledger.rows[r].owner.owner.cancelled]
            # Without slots an idle engine takes one request, whatever its rows (they run one after another).
            room = ((ledger.free_slots() + len(leaving)) if self.slotted
                    else (0 if running else self.settings.max_batch_size))
            joining = []
            while self.queue and self.queue[0].rows <= room:
                request = self.queue.popleft()
                joining.append(request)
                room = room - request.rows if self.slotted else 0
            return Admission(joining, leaving)

    def _join(self, requests: list[Request]) -> None:
        if not self.slotted:  # one answer at a time on HF's caches
            self.later.extend((request, i) for request in requests for i in range(request.rows))
            if self.batch is None:
                self._next_answer()
            return
        joiners = []
        for request in requests:
            for i, (prompt, choice) in enumerate(zip(request.prompts, request.choices)):
                s = choice.settings
                joiners.append(Joiner(prompt, s.max_new_tokens, s.threshold, s.rule(self.device, fresh_seed()),
                                      s.llm_budget, owner=Row(request, i, choice, self.tokenizer), ends=s.eos_ids,
                                      depth=s.speculate))
        if self.batch.ledger.occupied():
            self.joins_running += 1
        for slot in self.batch.join(joiners, prefill=self.settings.prefill_chunk):
            state = self.batch.ledger.rows[slot]
            state.owner.speculated = state.speculated  # (its usage reads them once it ended and left)

    def _next_answer(self) -> None:
        """Models that cannot use slots: the next queued answer alone, on HF's caches, built as ``generate`` builds
        its batch (``RunningBatch.for_call``); None when no answer waits."""
        while self.later and self.later[0][0].cancelled:
            self.later.popleft()
        if self.batch is not None:
            self.batch.close()
        self.batch = None
        if not self.later:
            return
        request, index = self.later.popleft()
        prompt, choice = request.prompts[index], request.choices[index]
        s = choice.settings
        sampler = Sampler(s.do_sample, self.device, s.rule(self.device, fresh_seed()).generator)
        routing = Routing.eager(self.pair, s.threshold, s.processors, sampler, len(prompt) + s.max_new_tokens + 1,
                                s.llm_budget, rollback=self.policy.horizon)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        self.batch = RunningBatch.for_call(routing, ids, s.max_new_tokens, counters=self.counters, ends=s.eos_ids)
        state = self.batch.ledger.rows[0]
        state.owner, state.depth = Row(request, index, choice, self.tokenizer), s.speculate
        state.owner.speculated = state.speculated
        self.counters.joins += 1

    def _turn(self, admission: Admission) -> None:
        """Do what ``_schedule`` decided (leave, join), then one turn of the batch (``core.turn.turn``) and what the
        clients are to be told (``benchmarks/speed/host_ops.py`` drives it too)."""
        self._leave(admission.leaving)
        if admission.joining:
            self._join(admission.joining)
        if self.batch is None:
            return
        batch, delivery = self.batch, Delivery(self.batch)
        result = turn(batch, self.policy, delivery, self.settings.prefill_chunk)
        if result is not None:
            self.peak_rows = max(self.peak_rows, len(batch.ledger.occupied()) + len(result.plan.ended))
        self._deliver(delivery)
        self._leave([])

    def _deliver(self, delivery: Delivery) -> None:
        """Each token's text, each ended answer's end event (the request counts as completed once its answer has left
        the server: ``work.py``), and an error for a row whose draw failed (its request ends, no other)."""
        for row, now, finished in delivery.texts:
            self.metrics.token(row, now)
            if piece := row.piece():  # decoded here, once the step's device work is queued (``rows.py``)
                row.owner.tell(("text", row.index, piece))
            if finished:
                if self.trace is not None:
                    self.trace.answer(row)
                row.owner.open -= 1
                row.owner.tell(("end", row.index, row.finish, row.generated, row.llm_tokens, row.speculated))
        for row in delivery.failed:
            self._fail(row.owner, APIError(
                500, "Sampling failed for this answer: its scores held no finite probability (a temperature or "
                     "processor setting leaves nothing to draw); retry with other settings.", kind="server_error"))

    def _leave(self, rows: list[int]) -> None:
        if rows:
            self.batch.leave(rows)
        if not self.slotted and self.batch is not None and not self.batch.ledger.occupied():
            self._next_answer()

    def _fail(self, request: Request, error: APIError) -> None:
        if not request.cancelled:
            request.tell(("error", error))
            self.metrics.request_ended(request, "error")
        request.cancelled = True  # its other rows leave at the next step

    def _shut(self, newcomers: list[Request]) -> None:
        """The drain ran out: every open answer ends with an error event (a stream then ends with [DONE])."""
        with self.cond:
            queued, self.queue = list(self.queue), collections.deque()
        owners = {id(r.owner): r.owner for r in self.rows}
        owners.update({id(r): r for r in [*newcomers, *queued, *(r for r, _ in self.later)]})
        error = APIError(503, "The server is shutting down; retry the request on another replica.", kind="server_error",
                         headers={"Retry-After": "1"})
        for request in owners.values():
            self._fail(request, error)

    def _fail_all(self, newcomers: list[Request], err: Exception) -> None:
        owners = {id(r.owner): r.owner for r in self.rows}
        owners.update({id(r): r for r in newcomers})
        owners.update({id(r): r for r, _ in self.later})
        self.later.clear()
        error = APIError(500, f"Decoding this batch failed ({type(err).__name__}: {err}); the server keeps serving, "
                              "retry the request.", kind="server_error")
        for request in owners.values():
            self._fail(request, error)
        if self.slotted:  # every slot freed (a captured batch keeps its static slots and graphs)
            self.batch.leave(self.batch.ledger.occupied())
        elif self.batch is not None:
            self.batch.close()
            self.batch = None

