"""The second device run's served phases: each server started once in the untimed warm-up, its loads timed later.

The engine (``r2r_hf/serve/engine.py``) captures every step at start-up, and a fused region meets new shapes there
(a slot cache whose span is its whole capacity specialises). The first run paid those compiles inside its serving
phase; here every server is started in ``warm_slots`` (its start-up time, capture and compiles written there) and
kept until the served phases have run:

* ``R2R``: today's server (fused reads, the LLM's packed), slots for the largest concurrency. It is started with
  speculation's captures (the resolutions' reads) so that one start serves both policies: each load sets the
  engine's policy (the GPU's waiting default, or speculation's server default at depth ``plan.speculate``);
* ``LLM alone``: the fair denominator on the same engine (``serve.llm_alone``: the LLM in the SLM's place, never
  routing, each prompt read once: ``serve.ALONE_OPTIONS``);
* ``R2R, long``: today's server with room for ``plan.long_tokens``-token answers, ``plan.long_users`` slots.

A served phase starts what ``warm_servers`` did not (its start then counts in that phase, and says so).

Routing is forced per row at the headline share (``synthetic.HashRouter``, ``serving_shape``). Every load keeps a
per-read histogram (``reads.py``); a speculative load runs with the agreement oracle in front of the server's
chooser (``oracle.py``) and says so.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

import torch

from benchmarks.gpu import oracle
from benchmarks.gpu.grid import server_columns
from benchmarks.gpu.reads import ReadLog
from benchmarks.gpu.serve import ALONE_OPTIONS, llm_alone, load, timed_replays
from benchmarks.synthetic import Letters, serving_shape
from r2r_hf.core.policy import default_policy, speculative_policy


@dataclass
class Server:
    """A started engine and what its loads need."""

    name: str
    engine: object
    model: object
    replays: type  # its graph step class, whose replays are timed (``serve.timed_replays``)
    slots: int
    started: dict = field(default_factory=dict)


class Served:
    """The servers of the served phases, each started on first need (``get``), and the model's serving shape
    (``serving_shape``: the forced router, answers that run to their length) held until ``close``.

    Args:
        model: the pair (its router and its generation configs are the serving shape's until ``close``).
        plan: the check's plan (the servers' slots and columns).
        compiles: the graphs dynamo compiled so far (each server's start says how many it compiled).
        put: ``put(name, start)`` records each server's start as it starts.
    """

    def __init__(self, model, plan, compiles, put) -> None:
        self.model, self.plan, self.compiles, self.put = model, plan, compiles, put
        self.servers: dict[str, Server] = {}
        self.stack = contextlib.ExitStack()
        self.generator = torch.Generator().manual_seed(0)

    def specs(self) -> dict[str, tuple]:
        """Each server: how its model is made, its slots, its columns, its settings beyond those."""
        plan, model = self.plan, self.model
        short, long = (columns - 1 for columns in server_columns(plan))  # (the grid's batches have their shapes)
        return {"R2R": (lambda: model, max(plan.serve), short, {"speculate": plan.speculate}),
                "LLM alone": (lambda: llm_alone(model), max(plan.serve), short, ALONE_OPTIONS),
                "R2R, long": (lambda: model, plan.long_users, long, {})}

    def get(self, name: str) -> Server:
        """Server ``name``, started now if it is not running."""
        if name not in self.servers:
            if not self.servers:
                self.stack.enter_context(serving_shape(self.model))
            which, slots, context, options = self.specs()[name]
            before = self.compiles()
            self.servers[name] = server = _start(name, which(), slots, context, options)
            server.started["compiles"] = self.compiles() - before
            self.put(name, server.started)
        return self.servers[name]

    def close(self) -> None:
        """Stop every engine and restore the model (idempotent: the first phase that needs the model back calls it)."""
        for server in self.servers.values():
            server.engine.stop(0)
        self.servers.clear()
        self.stack.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _start(name: str, model, slots: int, context: int, options: dict) -> Server:
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings

    store, base = model.capture_store, model.capture_store.graph_step
    store.graph_step = replays = timed_replays(base)  # the engine's capturer takes the class at its start
    settings = ServeSettings(max_batch_size=slots, max_queue=1024, batch_wait_ms=0, capture="auto", max_context=context,
                             **options)
    started = time.perf_counter()
    try:
        with torch.inference_mode():  # (as the engine's thread runs, and as its start-up captures)
            engine = Engine(model, Letters(), settings)
    finally:
        store.graph_step = base
    engine.start()
    return Server(name, engine, model, replays, slots,
                  {"start_s": time.perf_counter() - started, "capture": engine.capture_report, "columns": context})


def run_load(served: Served, name: str, concurrency: int, requests: int, tokens: int, threshold: float,
             deadline: float, policy: str = "waiting", agreement: float | None = None, prompt: int = 64) -> dict:
    """One closed-loop load on server ``name`` under ``policy`` ("waiting": the GPU's default; "speculative": the
    server's default at the depth it was started with; "own": what its settings say), with the agreement oracle where
    ``agreement`` is given: tokens/s and the rest of ``serve.load``, the per-read histogram and, speculating, the
    resolutions' host time."""
    server = served.get(name)
    engine, model = server.engine, server.model
    depth = engine.settings.speculate
    if policy != "own":
        engine.policy = (speculative_policy("cuda", server.slots, depth) if policy == "speculative"
                         else default_policy("cuda", server.slots))
    prompts = [torch.randint(100, model.shared_vocab_size - 100, (prompt,), generator=served.generator).tolist()
               for _ in range(requests)]
    if agreement is not None:
        oracle.install(engine.batch, agreement)
    log = ReadLog()
    try:
        with log.attached():
            out = load(engine, model, prompts, concurrency, tokens, threshold,
                       timeout=max(deadline - time.monotonic(), 5), replays=server.replays)
    finally:
        oracle.remove(engine.batch)
    out.update(policy=policy, reads=log.histogram(), resolution=log.resolution_summary())
    if policy == "speculative":
        out["speculate"] = depth
    return oracle.stamp(out, agreement) if agreement is not None else out
