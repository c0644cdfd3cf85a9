"""A chain of verifiers over one shard: each verifier is asked only what the ones before it passed on,
its verdicts are kept on disk per verifier (so another chain reuses them), and the first verifier
that decides a mismatch decides its label."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..classes import Decision
from ..steps import VERDICTS
from ..store import WorkDir, read_json, write_json
from .base import Mismatch, Verifier

IDENTICAL = "identical sentences"  # decided without a verifier: both sentences are the same text
UNDECIDED = "undecided"  # no verifier of the chain decided: excluded from training


def judge_shard(work: WorkDir, k: int, chain: list[Verifier], items: list[Mismatch], identical: list[bool]) -> None:
    """Ask each verifier of ``chain`` about the mismatches still open before it; store what it says.

    Args:
        work: the run.
        k: the shard.
        chain: the verifiers, in order.
        items: the shard's mismatches as text.
        identical: per mismatch, whether its two sentences are the same text.
    """
    open_items = [m for m, same in zip(items, identical) if not same]
    for verifier in chain:
        path = work.shard(VERDICTS, k, verifier.key())
        stored = read_json(path, VERDICTS) if path.exists() else {"verdicts": {}, "seconds": 0.0, "judged": 0}
        missing = [m for m in open_items if str(m.index) not in stored["verdicts"]]
        if missing:
            start = time.perf_counter()
            for m, verdict in zip(missing, verifier.judge(missing)):
                stored["verdicts"][str(m.index)] = verdict.to_json()
            stored["seconds"] += time.perf_counter() - start
            stored["judged"] += len(missing)
        if missing or not path.exists():  # a verifier asked nothing (no open mismatch) answered all the same
            stored["settings"] = verifier.settings()
            write_json(path, stored)
        open_items = [m for m in open_items if verifier.decide(stored["verdicts"][str(m.index)]) is None]


@dataclass(frozen=True)
class ShardDecisions:
    """What a chain decided about each mismatch of one shard, read from the verdicts on disk.

    Args:
        decisions: per mismatch, (the decision or None, who decided it); only for a complete shard.
        missing: verifier name -> the mismatches it is asked about and has not answered yet (an empty list: its
            verdicts file is not written).
    """

    decisions: list[tuple[Decision | None, str]]
    missing: dict[str, list[int]]

    @property
    def complete(self) -> bool:
        """Every verifier answered what the chain asks it (the verdicts step is done for this shard)."""
        return not self.missing

    def check(self, k: int) -> ShardDecisions:
        """Itself, if complete; else one error saying which verdicts are missing."""
        if self.missing:
            name, indices = next(iter(self.missing.items()))
            what = f"lack mismatch {indices[0]}" if indices else "are not written"
            raise ValueError(f"The {name} verdicts of shard {k} {what}; rerun the 'verdicts' step.")
        return self


def read_decisions(work: WorkDir, k: int, chain: list[Verifier], identical: list[bool]) -> ShardDecisions:
    """The chain's decision on each of shard k's mismatches (``identical``: per mismatch, same sentence text).

    A verifier whose verdicts file is missing, or lacks a mismatch it is asked about, is listed in ``missing``;
    this never raises for a gap, so whether the verdicts step is done is a fact read off the store.
    """
    verdicts = [work.read(VERDICTS, k, v.key())["verdicts"] if work.done(VERDICTS, k, v.key()) else None
                for v in chain]
    missing: dict[str, list[int]] = {v.name: [] for v, stored in zip(chain, verdicts) if stored is None}
    out: list[tuple[Decision | None, str]] = []
    for index, same in enumerate(identical):
        if same:
            out.append((Decision.NEUTRAL, IDENTICAL))
            continue
        for verifier, stored in zip(chain, verdicts):
            record: dict[str, Any] | None = None if stored is None else stored.get(str(index))
            if record is None:
                missing.setdefault(verifier.name, []).append(index)
                break
            decision = verifier.decide(record)
            if decision is not None:
                out.append((Decision(decision), verifier.name))
                break
        else:
            out.append((None, UNDECIDED))
    return ShardDecisions([] if missing else out, missing)


def verifier_seconds(work: WorkDir, chain: list[Verifier], shards: list[int]) -> dict[str, dict[str, float]]:
    """Seconds and mismatches judged per verifier over ``shards`` (what a label set cost)."""
    out = {}
    for verifier in chain:
        seconds = judged = 0
        for k in shards:
            path = work.shard(VERDICTS, k, verifier.key())
            if path.exists():
                stored = read_json(path, VERDICTS)
                seconds += stored.get("seconds", 0.0)
                judged += stored.get("judged", 0)
        out[verifier.name] = {"seconds": seconds, "judged": judged}
    return out
