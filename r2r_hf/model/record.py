"""A router's record: how it was trained, calibrated and evaluated, kept in ``router_metrics.json``.

The config (``config.json``) says what the router is; this file says where it came from and how
well it does, and the model card is rendered from both. Keys (all optional):

* ``calibration``: how the threshold was picked: ``method``, ``target`` (``{"recall": r}`` or
  ``{"llm_token_rate": p}``), ``target_met`` (False where no grid threshold reached the recall target and the
  highest-recall one was kept), the ``recall``, ``precision`` and ``llm_token_rate`` reached, ``data``;
* ``training``: data, label statistics, epochs, settings...;
* ``evaluation``: benchmark results shown in the model card;
* ``license``: the router's licence for its card (default: the pair's, where both agree);
* the calibration report (``all_tokens``, ``mismatches``, ``curve``, ``training_curve``...).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .hub import read_router_json

RECORD_FILE = "router_metrics.json"


def load_record(location: str | os.PathLike, hub: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record stored with a router (a folder or a Hub repo); empty when there is none."""
    record = read_router_json(location, RECORD_FILE, hub)
    return record if isinstance(record, dict) else {}


def save_record(folder: str | os.PathLike, record: dict[str, Any]) -> None:
    """Write ``router_metrics.json`` into ``folder`` (nothing when the record is empty)."""
    if record:
        Path(folder, RECORD_FILE).write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")


def from_legacy_config(fields: dict[str, Any]) -> dict[str, Any]:
    """The record held by a config written before r2r_hf 0.2 (its provenance fields)."""
    record: dict[str, Any] = {}
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


def expected_llm_token_rate(record: dict[str, Any]) -> float | None:
    """The share of tokens the calibrated threshold routed on its calibration data."""
    return (record.get("calibration") or {}).get("llm_token_rate")


# Said wherever a calibration recorded no recall (a rate target on data without a divergent token).
RECALL_NOT_MEASURED = "not measured (no divergent token in the calibration data)"


def target_met(record: dict[str, Any]) -> bool:
    """False where the calibration could not reach its target (records without the flag met theirs)."""
    return (record.get("calibration") or {}).get("target_met", True) is not False


def recall_target(record: dict[str, Any]) -> float | None:
    """The divergent-class recall the threshold was calibrated for (None for a rate target)."""
    return ((record.get("calibration") or {}).get("target") or {}).get("recall")
