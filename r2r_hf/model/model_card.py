"""The README.md model card written next to every saved or pushed router.

The skeleton is ``r2r_hf/templates/model_card.md`` (installed as package data); this
module fills it from the router's config (the pair, the threshold) and its record (how the
threshold was calibrated, training statistics, evaluation results, licence; ``record.py``).
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, try_to_load_from_cache

from ..config import R2RConfig
from ..version import __version__
from .hub import is_hub_id
from .record import RECALL_NOT_MEASURED, RouterRecord

CARD_MARKER = "Card written by r2r_hf"  # a README.md carrying it may be regenerated; any other is the user's


def _template() -> str:
    return importlib.resources.files("r2r_hf").joinpath("templates", "model_card.md").read_text(encoding="utf-8")


def _license_of(name_or_path: str | None, revision: str | None = None) -> str | None:
    """The ``license`` in a model's own README front matter, read from its folder or the HF cache."""
    if not name_or_path:
        return None
    if os.path.isdir(name_or_path):
        readme: str | Any = os.path.join(name_or_path, "README.md")
    elif is_hub_id(name_or_path):
        readme = try_to_load_from_cache(name_or_path, "README.md", revision=revision)
    else:
        return None
    if not isinstance(readme, str) or not os.path.isfile(readme):
        return None
    try:
        return ModelCard.load(Path(readme)).data.get("license")
    except Exception:  # noqa: BLE001 - a malformed third-party card just means "unknown"
        return None


def _metadata(config: R2RConfig, record: RouterRecord) -> str:
    lines = ["library_name: r2r_hf", "pipeline_tag: text-generation"]
    bases = [name for name in (config.slm_name_or_path, config.llm_name_or_path) if is_hub_id(name)]
    if bases:
        lines += ["base_model:"] + [f"- {name}" for name in bases]
    licenses = {_license_of(config.slm_name_or_path, config.slm_revision), _license_of(config.llm_name_or_path, config.llm_revision)}
    if record.get("license"):
        lines.append(f"license: {record['license']}")
    elif len(licenses) == 1 and None not in licenses:
        lines.append(f"license: {licenses.pop()}")
    elif None not in licenses:
        lines.append("license: other")
    lines += ["tags:", "- r2r", "- token-routing", "- mixture-of-models", "- efficient-inference"]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns)
    body = "\n".join("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows)
    return head + "\n" + body


def _threshold_section(config: R2RConfig, record: RouterRecord) -> str:
    text = f"Default threshold: **{config.threshold:.4g}** (the LLM writes a token where the router's score >= threshold)."
    cal = record.calibration
    if not cal:
        return text + " It was not calibrated on labelled data."
    details = []
    target, rate = record.recall_target, record.llm_token_rate
    if target is not None:
        details.append(f"target divergent-class recall {target:.3g}" + ("" if record.target_met else " (not reached)"))
    if "recall" in cal:
        recall = cal["recall"]
        details.append(f"recall {RECALL_NOT_MEASURED}" if recall is None
                       else f"measured recall {_fmt(recall)}")
    if rate is not None:
        details.append(f"expected LLM token rate {rate:.1%}")
    if "method" in cal:
        details.append(f"method: {cal['method']}")
    if "data" in cal:
        details.append(f"calibration data: {cal['data']}")
    return text + " Calibrated with " + "; ".join(details) + "."


def _training_section(record: RouterRecord) -> str:
    info = dict(record.training)
    if not info:
        return "No training record is stored with this router."
    parts = []
    stats = info.pop("label_statistics", None)
    if isinstance(stats, dict) and stats:
        parts.append("Label statistics (response tokens):\n\n" + _table([{"class": k, **v} if isinstance(v, dict) else {"class": k, "value": v} for k, v in stats.items()]))
    if info:
        parts.append("\n".join(f"- **{key}**: {_fmt(value)}" for key, value in info.items()))
    return "\n\n".join(parts)


def _evaluation_section(record: RouterRecord) -> str:
    evaluation = dict(record.get("evaluation") or {})
    if not evaluation:
        return "No evaluation is recorded with this router."
    rows = evaluation.pop("results", None)
    parts = []
    if evaluation:
        parts.append("\n".join(f"- **{key}**: {_fmt(value)}" for key, value in evaluation.items()))
    if isinstance(rows, list) and rows:
        parts.append(_table(rows))
    return "\n\n".join(parts)


def render_model_card(config: R2RConfig, record: RouterRecord | dict[str, Any] | None = None,
                      repo_id: str | None = None) -> str:
    """The model card text for a router.

    Args:
        config: the router's config (pair, sizes, threshold).
        record: its record (calibration, training, evaluation, licence), as in ``router_metrics.json``.
        repo_id: where the router is published, used in the usage snippet.
    """
    record = record if isinstance(record, RouterRecord) else RouterRecord(dict(record or {}))
    router = (
        f"an MLP router over {len(config.router_hidden_dims)} residual blocks of width "
        f"{config.router_hidden_dims[0]}" if config.router_type == "mlp" else f"the {config.router_type} baseline router"
    )
    if config.router_type == "mlp" and config.router_signals:  # (a reader of the card should know all it reads)
        router += f", which also reads the SLM's {' and '.join(config.router_signals)} over its top-k logits"
    return _template().format(
        metadata=_metadata(config, record),
        title=f"R2R router: {config.slm_name_or_path} + {config.llm_name_or_path}",
        num_topk_logits=config.num_topk_logits,
        router_description=router,
        slm=config.slm_name_or_path,
        llm=config.llm_name_or_path,
        slm_revision=config.slm_revision or "default branch",
        llm_revision=config.llm_revision or "default branch",
        repo_id=repo_id or "path/to/this-router",
        threshold_section=_threshold_section(config, record),
        training_section=_training_section(record),
        evaluation_section=_evaluation_section(record),
        version=__version__,
    )
