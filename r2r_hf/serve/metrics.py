"""``GET /metrics``: the server's state and counters in the Prometheus text format (what vLLM and TGI export).

Requests by outcome, time to first token and inter-token latency are observed as they happen; the queue, the
running rows and the decoding counters (``core/counters.py``: tokens, model forwards, rows per LLM forward,
each model's token-rows read and how many of them were real, speculative resolutions and their outcomes, steps routed
rows waited, host synchronisations, KV bytes copied by joins) are read from the engine when scraped. Every engine has
its own registry, so several servers in one process never mix their numbers.
Needs ``prometheus_client`` (in the ``serve`` extra); without it the counters still count and ``/metrics``
says what to install.
"""

from __future__ import annotations

import math
import threading

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
except ImportError:  # pragma: no cover - the serve extra installs it
    CollectorRegistry = None

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("completed", "error", "cancelled", "rejected")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServeMetrics:
    """The metrics of one engine.

    Args:
        engine: the ``Engine`` whose queue, batch and ``counters`` are read at scrape time.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # (the decoding thread and the event loop both end requests)
        self.registry = None
        if CollectorRegistry is None:
            return
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("r2r_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.ttft = Histogram("r2r_time_to_first_token_seconds", "From submission to an answer's first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("r2r_inter_token_latency_seconds", "Between two tokens of one answer",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def finished(self, outcome: str) -> None:
        if self.registry is not None:
            self.requests.labels(outcome).inc()

    def request_ended(self, request, outcome: str) -> None:
        """Count how ``request`` (a ``work.Request``) ended, once: the first outcome told stands."""
        with self._lock:
            if request.outcome is not None:
                return
            request.outcome = outcome
        self.finished(outcome)

    def rejected(self, error: Exception) -> Exception:
        """Count a request refused at submission (429 queue full, 503 draining); returns ``error`` to raise."""
        self.finished("rejected")
        return error

    def token(self, row, now: float) -> None:
        """Row ``row`` received a token at ``now`` (monotonic seconds)."""
        last = getattr(row, "last_token_at", None)
        row.last_token_at = now
        if self.registry is None:
            return
        if last is None:
            self.ttft.observe(now - row.owner.submitted)
        else:
            self.itl.observe(now - last)

    def text(self) -> bytes:
        if self.registry is None:
            return b"# /metrics needs prometheus_client: pip install 'r2r_hf[serve]'\n"
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's live state and decoding counters, read when Prometheus scrapes."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        engine, counters = self.engine, self.engine.counters
        queue = GaugeMetricFamily("r2r_queue_length", "Requests waiting for a place in the batch")
        queue.add_metric([], len(engine.queue))
        running = GaugeMetricFamily("r2r_running_rows", "Answers in the running batch")
        running.add_metric([], len(engine.rows))
        waiting = GaugeMetricFamily("r2r_waiting_rows", "Answers of the batch waiting for the LLM")
        waiting.add_metric([], 0 if engine.batch is None else len(engine.batch.ledger.waiting()))
        depth = GaugeMetricFamily("r2r_speculation_depth", "Pending positions an answer at threshold 0 may hold now "
                                  "(by the running rows, before its own acceptance; 0: the server does not "
                                  "speculate)")
        depth.add_metric([], engine.policy.depth(len(engine.rows), everywhere=True))
        yield from (queue, running, waiting, depth)
        totals = {
            "r2r_generated_tokens": ("Tokens generated", counters.generated),
            "r2r_llm_tokens": ("Tokens the LLM wrote", counters.llm_tokens),
            "r2r_steps": ("Decoding steps", counters.steps),
            "r2r_slm_forwards": ("SLM forwards", counters.slm_forwards),
            "r2r_llm_forwards": ("LLM forwards", counters.llm_forwards),
            "r2r_llm_calls": ("LLM catch-ups (steps in which the LLM ran)", counters.llm_calls),
            "r2r_llm_call_rows": ("Rows the LLM served (wrote a token for, or resolved speculative tokens of), summed "
                                  "over its catch-ups", counters.llm_rows),
            "r2r_llm_token_rows_read": ("Token-rows the LLM's forwards computed, padding included (a padded read counts "
                                        "rows x width, a packed one its tokens bucket), from the shapes the host chose",
                                        counters.llm_rows_read),
            "r2r_llm_token_rows_real": ("Of the LLM's token-rows read, real tokens (the rest is padding)",
                                        counters.llm_rows_real),
            "r2r_slm_token_rows_read": ("Token-rows the SLM's forwards computed, padding included", counters.slm_rows_read),
            "r2r_slm_token_rows_real": ("Of the SLM's token-rows read, real tokens (the rest is padding)",
                                        counters.slm_rows_real),
            "r2r_speculative_resolutions": ("LLM forwards that resolved speculative (pending) tokens",
                                            counters.resolutions),
            "r2r_speculative_agreed": ("Speculative (pending) tokens the LLM confirmed", counters.agreed),
            "r2r_speculative_rejected": ("Speculative tokens the LLM replaced (its row cut back there)",
                                         counters.rejected),
            "r2r_speculative_thrown_tokens": ("Committed tokens thrown away by speculative rollbacks", counters.thrown),
            "r2r_speculative_frontier_tokens": ("Tokens the LLM wrote from a resolving read past a confirmed tail (no "
                                                "SLM step spent on them)", counters.frontier_tokens),
            "r2r_router_steps": ("Steps in which the router scored the proposals", counters.router_steps),
            "r2r_host_syncs": ("Host synchronisations", counters.host_syncs),
            "r2r_joins": ("Answers that joined the batch", counters.joins),
            "r2r_join_kv_bytes": ("KV bytes copied to make room for joining answers", counters.join_bytes),
        }
        for name, (doc, value) in totals.items():
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        # Fixed buckets, counted as the waits happen: a scrape reads a dozen numbers however long the server ran.
        for name, doc, histogram in (
                ("r2r_llm_wait_steps", "Steps a routed answer waited for the LLM", counters.waits),
                ("r2r_speculative_accepted", "Pending positions of one answer one resolution confirmed",
                 counters.accepted),
                ("r2r_speculative_drafted", "Pending positions of one answer one resolution judged (the depth its "
                 "draft reached)", counters.drafted)):
            buckets = [("+Inf" if b == math.inf else str(b), n) for b, n in histogram.cumulative()]
            yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=histogram.total)
