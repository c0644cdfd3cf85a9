"""A router's record: how it was trained, calibrated and evaluated, kept in ``router_metrics.json``.

The config (``config.json``) says what the router is; this file says where it came from and how
well it does, and the model card is rendered from both. ``RouterRecord`` is the one typed form;
``read_record``/``write_record`` the one way in and out. Sections (all optional):

* ``calibration`` (``Calibration``): how the threshold was picked;
* ``training`` (``Training``): data, label statistics, epochs, settings...;
* ``evaluation``: benchmark results shown in the model card;
* ``license``: the router's licence for its card (default: the pair's, where both agree);
* the calibration report (``all_tokens``, ``mismatches``, ``curve``, ``training_curve``...).

A record is also a mapping of those sections (``record["calibration"]["recall"]``), in the order they were
written, so a file from any earlier release reads and writes back the same.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from .hub import read_router_json

RECORD_FILE = "router_metrics.json"
# Said wherever a calibration recorded no recall (a rate target on data without a divergent token).
RECALL_NOT_MEASURED = "not measured (no divergent token in the calibration data)"


class Calibration(TypedDict, total=False):
    """How the threshold was picked (a key absent: not recorded)."""

    method: str
    target: dict[str, float]  # {"recall": r} or {"llm_token_rate": p}
    target_met: bool  # False: no grid threshold reached the recall target; the highest-recall one was kept
    data: str
    recall: float | None  # None: not measured (no divergent token in the calibration data)
    precision: float
    llm_token_rate: float
    source: str  # an official checkpoint's location


class Training(TypedDict, total=False):
    """How the router was trained (``train_router``)."""

    data: str
    label_set: str
    train_tokens: int
    train_divergent: int
    validation_tokens: int
    validation_divergent: int
    label_statistics: dict[str, Any]
    epochs_run: int
    best_epoch: int
    seconds: float
    settings: dict[str, Any]


@dataclass
class RouterRecord(MutableMapping):
    """A router's provenance: its sections (``entries``, in written order) and what is read off them."""

    entries: dict[str, Any] = field(default_factory=dict)

    # -------------------------------------------------------------- typed reads
    @property
    def calibration(self) -> Calibration:
        return self.entries.get("calibration") or {}

    @property
    def training(self) -> Training:
        return self.entries.get("training") or {}

    @property
    def llm_token_rate(self) -> float | None:
        """The share of tokens the calibrated threshold routed on its calibration data."""
        return self.calibration.get("llm_token_rate")

    @property
    def recall_target(self) -> float | None:
        """The divergent-class recall the threshold was calibrated for (None for a rate target)."""
        return (self.calibration.get("target") or {}).get("recall")

    @property
    def target_met(self) -> bool:
        """False where the calibration could not reach its target (records without the flag met theirs)."""
        return self.calibration.get("target_met", True) is not False

    # ------------------------------------------------------------ mapping view
    def __getitem__(self, key: str) -> Any:
        return self.entries[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.entries[key] = value

    def __delitem__(self, key: str) -> None:
        del self.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def read_record(location: str | os.PathLike, hub: dict[str, Any] | None = None) -> RouterRecord:
    """The record stored with a router (a folder or a Hub repo); empty when there is none."""
    stored = read_router_json(location, RECORD_FILE, hub)
    return RouterRecord(dict(stored) if isinstance(stored, dict) else {})


def write_record(folder: str | os.PathLike, record: RouterRecord) -> None:
    """Write ``router_metrics.json`` into ``folder`` (nothing when the record is empty)."""
    if record:
        Path(folder, RECORD_FILE).write_text(json.dumps(dict(record), indent=1, default=str), encoding="utf-8")


def from_legacy_config(fields: dict[str, Any]) -> RouterRecord:
    """The record held by a config written before r2r_hf 0.2 (its provenance fields)."""
    record = RouterRecord()
    calibration = dict(fields.get("calibration") or {})
    if fields.get("threshold_recall_target") is not None:
        calibration.setdefault("target", {"recall": fields["threshold_recall_target"]})
    if fields.get("expected_llm_token_rate") is not None:
        calibration.setdefault("llm_token_rate", fields["expected_llm_token_rate"])
    for key, value in (("calibration", calibration), ("training", fields.get("training")),
                       ("evaluation", fields.get("evaluation")), ("license", fields.get("license"))):
        if value:
            record[key] = value
    return record
