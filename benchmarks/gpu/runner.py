"""The device check's phase runner: each phase under its own guard and deadline, every outcome written down.

A lent GPU comes once, for minutes, and the first CUDA run of a new path raises with a fair chance
(a capture refusal the CPU emulation cannot rehearse, an OOM, a shape error). So one phase's
exception must cost that phase only: ``run_phases`` records it as ``errors[phase]`` (type,
message, the traceback's tail), frees what the phase left behind and runs the next one. A phase
that runs past its budget is interrupted the same way (``PhaseTimeout``), so a slow phase cannot
eat the time of every phase after it.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import signal
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

TRACEBACK_LINES = 25  # the tail says where it failed; the whole traceback goes to the log


class Report:
    """The check's JSON, rewritten (atomically) after every measurement: a run cut short keeps what it measured."""

    def __init__(self, path: Path, plan: dict) -> None:
        self.path, self.started = path, time.monotonic()
        self.data: dict = {"plan": plan, "timeline": [], "errors": {}, "phase_s": {}}

    @property
    def errors(self) -> dict:
        return self.data["errors"]

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def put(self, section: str, key: str | None, value) -> None:
        if key is None:
            self.data[section] = value
        else:
            self.data.setdefault(section, {})[key] = value
        self.write()

    def mark(self, step: str) -> None:
        self.data["timeline"].append({"step": step, "at_s": round(self.elapsed(), 1)})
        print(f"[{self.data['timeline'][-1]['at_s']:7.1f} s] {step}", flush=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


@dataclass(frozen=True)
class Phase:
    """One guarded step of the check.

    Args:
        name: its key in ``errors`` and ``phase_s`` (and the value ``--fail-phase`` takes).
        budget_s: its own deadline; the runner interrupts it there.
        run: the work; it writes its numbers into the report itself, as it takes them.
        needs: phases whose failure leaves this one nothing to run on (it is skipped, and says why).
        by_s: it must also end this many seconds after the report started (the warm phase: the headline that
            follows is due by then, whatever is left to compile).
    """

    name: str
    budget_s: float
    run: Callable[[], None]
    needs: tuple[str, ...] = ()
    by_s: float | None = None


class PhaseTimeout(BaseException):
    """A phase ran past its deadline. A BaseException, so a library's ``except Exception`` cannot swallow it."""


class InjectedFailure(RuntimeError):
    """Raised by ``--fail-phase NAME`` (tests only): proves the other phases still run."""


class Skipped(RuntimeError):
    """A phase that did not start: what it needs failed, or no time was left for it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``PhaseTimeout`` in the main thread after ``seconds``, and every 5 s after if it was swallowed."""
    active = [True]

    def ring(signum, frame) -> None:
        if active[0]:
            raise PhaseTimeout(f"past its deadline of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 5.0)
    try:
        yield
    finally:
        active[0] = False  # first: a ring between here and the disarm is ignored
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Fallbacks(logging.Handler):
    """Every warning r2r_hf logs while the check runs, into ``report["fallbacks"]`` with the phase it came in: a
    fused read that did not compile, a model left unfused, the router kept in fp32 each say why only in the log,
    and a fallback turns fused numbers into unfused ones without an error."""

    def __init__(self, report: Report) -> None:
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        timeline = self.report.data["timeline"]
        phase = timeline[-1]["step"] if timeline else None
        found = self.report.data.setdefault("fallbacks", [])
        found.append({"phase": phase, "logger": record.name, "message": record.getMessage()[:1000]})
        self.report.write()

    @contextmanager
    def attached(self, logger: str = "r2r_hf") -> Iterator[None]:
        target = logging.getLogger(logger)
        target.addHandler(self)
        try:
            yield
        finally:
            target.removeHandler(self)


def describe(err: BaseException) -> dict:
    """What ``errors[phase]`` holds: the type, the message and the traceback's last lines."""
    lines = "".join(traceback.format_exception(type(err), err, err.__traceback__)).splitlines()
    return {"type": type(err).__name__, "message": str(err)[:2000], "traceback": lines[-TRACEBACK_LINES:]}


def free(device: str) -> str | None:
    """After a failure: collect the cycles (``del`` alone frees no model), empty the CUDA cache, and
    return why nothing more can run here if the CUDA context is broken (a sticky error)."""
    gc.collect()
    if device.startswith("cuda"):
        import torch  # here only: the runner itself needs no torch

        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.ones(1, device=device).sum().item()
        except Exception as err:  # noqa: BLE001 - the fresh process (the compiled child) still runs
            return f"the CUDA context is broken ({type(err).__name__}: {str(err)[:200]})"
    return None


def run_phases(phases: Sequence[Phase], report: Report, *, until_s: float, fail: str | Collection[str] | None = None,
               recover: Callable[[], str | None] = lambda: None, after: Callable[[], None] = lambda: None) -> None:
    """Run ``phases`` in order, each under its guard; none of their exceptions escapes.

    Args:
        until_s: seconds after the report started by which the last of them must end (a phase's deadline is
            its budget or what is left, whichever is less; a phase with under a second left is skipped).
        fail: a phase name (or several) to raise ``InjectedFailure`` in (tests only).
        recover: runs after a failure (frees what the phase left; returns a reason when nothing more can run
            in this process, e.g. a CUDA context broken by a sticky error: every later phase is skipped with it).
        after: runs after every phase (derived numbers, e.g. speed-ups from what was measured so far).
    """
    broken, failing = None, {fail} if isinstance(fail, str) else set(fail or ())
    for phase in phases:
        # what is left before the run's deadline, or the phase's own where it has one (``warm``: the headline is due)
        left = min(until_s, math.inf if phase.by_s is None else phase.by_s) - report.elapsed()
        failed = [n for n in phase.needs if n in report.errors]
        reason = (broken or (f"needs {', '.join(failed)}, which failed" if failed else None)
                  or (f"no time left ({left:.0f} s before the deadline)" if left < 1 else None))
        if reason:
            report.errors[phase.name] = describe(Skipped(reason))
            report.mark(f"{phase.name}: skipped ({reason})")
            continue
        report.mark(phase.name)
        start, error = time.monotonic(), None
        seconds = min(phase.budget_s, left)
        try:
            with deadline(seconds):
                if phase.name in failing:
                    raise InjectedFailure(f"injected into {phase.name} by --fail-phase")
                phase.run()
        except (Exception, PhaseTimeout) as err:  # noqa: BLE001 - recorded, then the next phase runs
            error = describe(err)
            traceback.print_exception(type(err), err, err.__traceback__, file=sys.stdout)
        # Out of the except block: the exception (and the frames, the models, its traceback holds) is gone.
        report.put("phase_s", phase.name, round(time.monotonic() - start, 1))
        if error is not None:
            report.put("errors", phase.name, error)
            report.mark(f"{phase.name}: failed ({error['type']}: {error['message'][:200]})")
            broken = recover()
        after()
