"""Training a router on a labeling run, and calibrating its threshold.

    model = train_router("work/", "my-router/")             # train, calibrate (recall 0.95), save
    calibrate_router(model, load_labels("work/").split_of("validation"), llm_rate=0.15, out_dir="my-router/")

The names load on first use, so ``training.settings`` is read (by the CLI) without importing torch.
"""

import importlib

_EXPORTS = {
    "calibration_report": "calibration", "metrics_at": "calibration", "threshold_for_rate": "calibration",
    "threshold_for_recall": "calibration", "TrainSettings": "settings", "auto_hidden_dims": "train",
    "calibrate_router": "train", "scores_on": "train", "train_router": "train",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
