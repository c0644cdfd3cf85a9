"""A chain of verifiers over one shard: each verifier is asked only what the ones before it passed on,
its verdicts are kept on disk per verifier (so another chain reuses them), and the first verifier
that decides a mismatch decides its label."""

from __future__ import annotations

import time
from typing import Any

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
        path = work.shard("verdicts", k, verifier.key())
        stored = read_json(path, "verdicts") if path.exists() else {"verdicts": {}, "seconds": 0.0, "judged": 0}
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


def decide_shard(work: WorkDir, k: int, chain: list[Verifier], count: int, identical: list[bool]) -> list[tuple[int | None, str]]:
    """(0 neutral / 1 divergent / None undecided, who decided) for each of the shard's ``count`` mismatches."""
    verdicts = [work.read("verdicts", k, v.key())["verdicts"] for v in chain]
    out = []
    for index in range(count):
        if identical[index]:
            out.append((0, IDENTICAL))
            continue
        for verifier, stored in zip(chain, verdicts):
            record: dict[str, Any] | None = stored.get(str(index))
            if record is None:
                raise ValueError(f"The {verifier.name} verdicts of shard {k} lack mismatch {index}; rerun the "
                                 "'verdicts' step.")
            decision = verifier.decide(record)
            if decision is not None:
                out.append((decision, verifier.name))
                break
        else:
            out.append((None, UNDECIDED))
    return out


def verifier_seconds(work: WorkDir, chain: list[Verifier], shards: list[int]) -> dict[str, dict[str, float]]:
    """Seconds and mismatches judged per verifier over ``shards`` (what a label set cost)."""
    out = {}
    for verifier in chain:
        seconds = judged = 0
        for k in shards:
            path = work.shard("verdicts", k, verifier.key())
            if path.exists():
                stored = read_json(path, "verdicts")
                seconds += stored.get("seconds", 0.0)
                judged += stored.get("judged", 0)
        out[verifier.name] = {"seconds": seconds, "judged": judged}
    return out
