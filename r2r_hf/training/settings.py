"""``TrainSettings``: a router's optimisation settings, declared once (defaults, help, flags).

Light on purpose (stdlib at import): ``r2r-hf train --help`` reads these declarations before torch loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..fields import setting

DEFAULT_RECALL = 0.95  # the divergent-class recall a trained router is calibrated for unless told otherwise


@dataclass
class TrainSettings:
    """Optimisation settings (the paper's defaults).

    Args:
        epochs: at most this many passes over the training split.
        batch_size: rows per step.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        patience: stop after this many epochs without a better validation loss.
        validation_fraction: share of samples held out.
        seed: data split, shuffling, initialisation and dropout.
    """

    epochs: int = setting(50, "at most this many passes over the training split", "positive_int")
    batch_size: int = setting(1024, "rows per step", "positive_int")
    lr: float = setting(5e-5, "AdamW learning rate", "learning_rate")
    weight_decay: float = setting(5e-4, "AdamW weight decay", "finite_non_negative")
    patience: int = setting(10, "stop after this many epochs without a better validation loss", "positive_int")
    validation_fraction: float = setting(0.1, "share of samples held out", cli=False)
    seed: int = setting(0, "data split, shuffling, initialisation and dropout", "seed")

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "patience"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TrainSettings {name} must be a whole number >= 1, got {getattr(self, name)!r}.")
        # AdamW diverges far below 1; inf and NaN are never a learning rate.
        if not 0 < self.lr <= 1:
            raise ValueError(f"TrainSettings lr must be in (0, 1] (the paper's is 5e-5), got {self.lr}.")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"TrainSettings weight_decay must be a finite number >= 0, got {self.weight_decay}.")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(f"TrainSettings validation_fraction must be in (0, 1), got {self.validation_fraction}.")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"TrainSettings seed must be a whole number from 0 to 2**64 - 1, got {self.seed!r}.")
