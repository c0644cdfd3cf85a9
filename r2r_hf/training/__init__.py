"""Training a router on a labeling run, and calibrating its threshold.

    model = train_router("work/", "my-router/")             # train, calibrate (recall 0.95), save
    calibrate_router(model, load_labels("work/").split_of("validation"), llm_rate=0.15, out_dir="my-router/")
"""

from .calibration import (
    calibration_report,
    metrics_at,
    threshold_for_rate,
    threshold_for_recall,
)
from .train import (
    TrainSettings,
    auto_hidden_dims,
    calibrate_router,
    scores_on,
    train_router,
)

__all__ = [
    "TrainSettings", "auto_hidden_dims", "calibrate_router", "calibration_report", "metrics_at", "scores_on",
    "threshold_for_rate", "threshold_for_recall", "train_router",
]
