"""Picking the routing threshold, and the metrics that describe a router at a threshold.

Two targets:

* **recall** (the paper's rule): on the grid ``linspace(0.01, 0.99, 100)``, among thresholds whose
  divergent-class recall reaches the target, take the one with the lowest LLM token rate (the
  largest); if none reaches it, take the highest-recall point (the report then says ``target_met: False``).
* **LLM token rate**: the threshold that routes that share of tokens (a score quantile); this is
  how routers are compared at equal cost.
"""

from __future__ import annotations

import math

import torch

GRID = torch.linspace(0.01, 0.99, 100)


def _rates(scores: torch.Tensor, targets: torch.Tensor, threshold: float) -> tuple[float, float]:
    routed = scores >= threshold
    positives = targets.bool()
    recall = (routed & positives).sum().item() / max(positives.sum().item(), 1)
    return recall, routed.float().mean().item() if len(scores) else 0.0


def threshold_for_recall(scores: torch.Tensor, targets: torch.Tensor, recall: float = 0.95) -> float:
    """The largest grid threshold whose recall of divergent tokens is >= ``recall``.

    Args:
        scores: router scores in [0, 1].
        targets: 1 for divergent tokens, 0 otherwise.
        recall: the target recall.
    """
    if not 0 < recall <= 1:
        raise ValueError(f"The recall target must be in (0, 1], got {recall}.")
    if targets.sum() == 0:
        raise ValueError("The calibration data holds no divergent tokens, so recall is undefined.")
    best, best_recall, fallback = None, -1.0, None
    for t in GRID.tolist():
        r, _ = _rates(scores, targets, t)
        if r >= recall:
            best = t
        if r > best_recall:
            best_recall, fallback = r, t
    return best if best is not None else fallback


def threshold_for_rate(scores: torch.Tensor, llm_rate: float) -> float:
    """The threshold that routes a share ``llm_rate`` of the tokens (ties may route a few more)."""
    if not 0 <= llm_rate <= 1:
        raise ValueError(f"The LLM token rate target must be in [0, 1], got {llm_rate}.")
    if llm_rate == 0:
        return math.inf
    ordered = torch.sort(scores.float(), descending=True).values
    k = max(1, min(len(ordered), round(llm_rate * len(ordered))))
    return float(ordered[k - 1])


def metrics_at(scores: torch.Tensor, targets: torch.Tensor, threshold: float) -> dict[str, float]:
    """Accuracy, precision, recall, F1 and LLM token rate (positive rate) at ``threshold``."""
    routed = scores >= threshold
    positives = targets.bool()
    tp = (routed & positives).sum().item()
    fp = (routed & ~positives).sum().item()
    fn = (~routed & positives).sum().item()
    n = max(len(scores), 1)
    precision = tp / max(tp + fp, 1)
    recall = tp / max(tp + fn, 1)
    return {
        "threshold": threshold,
        "accuracy": (routed == positives).sum().item() / n,
        "precision": precision,
        "recall": recall,
        "f1": 2 * precision * recall / max(precision + recall, 1e-12),
        "llm_token_rate": routed.sum().item() / n,
        "tokens": len(scores),
        "positives": positives.sum().item(),
    }


def recall_rate_curve(scores: torch.Tensor, targets: torch.Tensor) -> list[dict[str, float]]:
    """Recall of divergent tokens against LLM token rate over the threshold grid."""
    curve = []
    for t in GRID.tolist():
        recall, rate = _rates(scores, targets, t)
        curve.append({"threshold": round(t, 4), "recall": recall, "llm_token_rate": rate})
    return curve


def calibration_report(
    scores: torch.Tensor, targets: torch.Tensor, mismatch: torch.Tensor, recall: float | None, llm_rate: float | None
) -> tuple[float, dict]:
    """Pick the threshold for one target and describe the router there and at 0.5.

    Args:
        scores, targets: validation scores and divergent labels (one per token).
        mismatch: True where the SLM's proposal differed from the LLM's token.
        recall: recall target (exclusive with ``llm_rate``).
        llm_rate: LLM token rate target.

    Returns:
        (threshold, report) where the report holds the target, whether it was met, metrics on all tokens
        and on mismatches at 0.5 and at the threshold, and the recall-vs-rate curve.
    """
    if (recall is None) == (llm_rate is None):
        raise ValueError("Give exactly one calibration target: a recall (e.g. 0.95) or an LLM token rate (e.g. 0.15).")
    threshold = threshold_for_recall(scores, targets, recall) if recall is not None else threshold_for_rate(scores, llm_rate)
    at_threshold = metrics_at(scores, targets, threshold)
    report = {
        "target": {"recall": recall} if recall is not None else {"llm_token_rate": llm_rate},
        # A rate target is met by construction; a recall target only where some grid threshold reaches it.
        "target_met": recall is None or at_threshold["recall"] >= recall,
        "threshold": threshold,
        "all_tokens": {"at_0.5": metrics_at(scores, targets, 0.5), "at_threshold": at_threshold},
        "mismatches": {
            "at_0.5": metrics_at(scores[mismatch], targets[mismatch], 0.5),
            "at_threshold": metrics_at(scores[mismatch], targets[mismatch], threshold),
        },
        "curve": recall_rate_curve(scores, targets),
    }
    return threshold, report
