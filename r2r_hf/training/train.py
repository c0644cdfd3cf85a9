"""Training a router on a labeling run, and calibrating its threshold.

The recipe is the paper's: weighted BCE (positive weight = negatives / positives), AdamW
(lr 5e-5, weight decay 5e-4), fp32, early stopping on validation loss with the best epoch
restored. The validation split is by sample, never by token. Baseline routers (entropy,
random) have nothing to train; they are only calibrated.

Router size: the paper trains a 56M-parameter router on ~7.6M labels. A labeling run on a
CPU yields ~10^5 labels with a few thousand divergent tokens, on which a 56M router overfits in
an epoch. ``auto_hidden_dims`` therefore scales the residual blocks with the training set:
256 x 3 below 200k tokens, 512 x 4 below 2M, and the paper's 1024 x 6 above.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from ..config import R2RConfig
from ..core.features import Features, score
from ..model.hub import check_output_folder
from ..model.modeling import R2RForCausalLM
from ..pipeline.classes import TRAINED, Label
from ..pipeline.dataset import LabelData, load_labels
from ..router import Router
from .calibration import calibration_report
from .settings import DEFAULT_RECALL, TrainSettings

logger = logging.getLogger(__name__)


def auto_hidden_dims(train_tokens: int) -> list[int]:
    """Residual block widths sized to the amount of training data (see the module docstring)."""
    if train_tokens < 200_000:
        return [256] * 3
    if train_tokens < 2_000_000:
        return [512] * 4
    return [1024] * 6


def _count(data: LabelData) -> tuple[int, int, dict[str, int]]:
    tokens = 0
    classes = {label.title: 0 for label in TRAINED}
    for index in data.shards:
        labels = data.shard(index)["label"]
        tokens += len(labels)
        for label in TRAINED:
            classes[label.title] += int((labels == label).sum())
    return tokens, classes[Label.DIVERGENT.title], classes


def scores_on(router: Router, data: LabelData, batch_size: int = 4096) -> dict[str, torch.Tensor]:
    """Router scores, divergent targets and mismatch flags for every usable row of ``data``."""
    router.eval()
    parts: dict[str, list[torch.Tensor]] = {"scores": [], "targets": [], "mismatch": []}
    with torch.no_grad():
        for batch in data.batches(batch_size):
            parts["scores"].append(score(router, Features.from_dict(batch)).cpu())
            parts["targets"].append(batch["target"])
            parts["mismatch"].append(batch["slm_token"] != batch["real_token"])
    return {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}


def _weighted_loss(router: Router, batch: dict, pos_weight: torch.Tensor, device) -> torch.Tensor:
    features = Features.from_dict(batch)  # the training forward needs the router's logit, not its score
    logits = router(features.topk_logits.to(device), features.token_embedding.to(device), features.hidden.to(device))
    return torch.nn.functional.binary_cross_entropy_with_logits(
        logits, batch["target"].to(device), pos_weight=pos_weight, reduction="sum"
    )


def train_router(
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    settings: TrainSettings | None = None,
    recall: float | None = DEFAULT_RECALL,
    llm_rate: float | None = None,
    device: str = "cpu",
    progress: bool = True,
    overwrite: bool = False,
    labels: str | None = None,
    **config_kwargs,
) -> R2RForCausalLM:
    """Train (MLP) or set up (baselines) a router on a labeling run, calibrate it, save it.

    Writes ``out_dir/config.json``, ``model.safetensors``, ``README.md`` and ``router_metrics.json`` (the record).
    ``out_dir`` is checked before any work: a non-empty folder that holds no r2r router is refused unless
    ``overwrite`` (``model.hub.check_output_folder``).

    Args:
        data_dir: the ``--out`` folder of ``r2r-hf label``.
        out_dir: where the router is written.
        settings: optimisation settings.
        recall: calibrate for this divergent-class recall (default 0.95) ...
        llm_rate: ... or for this LLM token rate instead.
        device: where to train.
        progress: show a tqdm bar over epochs.
        overwrite: write into a non-empty folder that holds no r2r router (nothing there is deleted).
        labels: the run's label set to train on (default: the only one).
        config_kwargs: ``R2RConfig`` fields (router_type, router_hidden_dims, router_dropout...).
    """
    settings = settings or TrainSettings()
    if llm_rate is not None:
        recall = None
    if torch.device(device).type == "meta":
        raise ValueError("device='meta' holds no data, so nothing can be trained on it; pass device='cpu' or 'cuda'.")
    check_output_folder(out_dir, overwrite)
    torch.manual_seed(settings.seed)
    data = load_labels(data_dir, validation_fraction=settings.validation_fraction, seed=settings.seed, labels=labels)
    statistics = _label_statistics(data)  # reads the label set's summary: a corrupt one is refused before training
    train, val = data.split_of("train"), data.split_of("validation")
    train_tokens, train_pos, _ = _count(train)
    val_tokens, val_pos, _ = _count(val)
    if val_tokens == 0 or train_tokens == 0:
        raise ValueError(f"{data_dir} is too small to split by sample; label more prompts or change validation_fraction.")
    _check_classes(data_dir, config_kwargs.get("router_type", "mlp"), train_tokens, train_pos, val_pos, recall)
    manifest = data.manifest
    first = data.shard(data.shards[0])
    config_kwargs.setdefault("router_hidden_dims", auto_hidden_dims(train_tokens))
    config = R2RConfig(
        slm_name_or_path=manifest["slm"], llm_name_or_path=manifest["llm"],
        slm_hidden_size=first["hidden"].shape[1], slm_embedding_size=first["token_embedding"].shape[1],
        num_topk_logits=first["topk_logits"].shape[1], **config_kwargs,
    )
    model = R2RForCausalLM(config)
    router = model.router.to(device)
    history: list[dict] = []
    started = time.perf_counter()
    best_epoch = None
    if config.router_type == "mlp":
        pos_weight = torch.tensor((train_tokens - train_pos) / train_pos, device=device)
        optimizer = torch.optim.AdamW(router.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
        best_loss, best_state, waited = math.inf, None, 0
        bar = tqdm(range(settings.epochs), desc="train", unit="epoch", disable=not progress)
        for epoch in bar:
            router.train()
            total = 0.0
            for batch in train.batches(settings.batch_size, shuffle=True, seed=settings.seed * 1000 + epoch):
                optimizer.zero_grad()
                loss = _weighted_loss(router, batch, pos_weight, device)
                (loss / len(batch["target"])).backward()
                optimizer.step()
                total += loss.item()
            router.eval()
            with torch.no_grad():
                val_loss = sum(_weighted_loss(router, b, pos_weight, device).item() for b in val.batches(4096))
            if not (math.isfinite(total) and math.isfinite(val_loss)):
                raise ValueError(
                    f"Training diverged in epoch {epoch + 1} (training loss {total / train_tokens:.4g}, validation "
                    f"loss {val_loss / val_tokens:.4g}); lower the learning rate (lr= of TrainSettings; now "
                    f"{settings.lr:g}), or check {data_dir} for features that are not finite."
                )
            history.append({"epoch": epoch + 1, "train_loss": total / train_tokens, "val_loss": val_loss / val_tokens})
            bar.set_postfix(val_loss=f"{val_loss / val_tokens:.4f}")
            if val_loss < best_loss:
                best_loss, best_state, best_epoch, waited = val_loss, copy.deepcopy(router.state_dict()), epoch + 1, 0
            else:
                waited += 1
                if waited >= settings.patience:
                    break
        router.load_state_dict(best_state)
    router.eval()
    model.router = router.cpu()
    model.record["training"] = {
        "data": str(data_dir),
        "label_set": data.labels,
        "train_tokens": train_tokens, "train_divergent": train_pos,
        "validation_tokens": val_tokens, "validation_divergent": val_pos,
        "label_statistics": statistics,
        "epochs_run": len(history), "best_epoch": best_epoch,
        "seconds": round(time.perf_counter() - started, 1),
        "settings": asdict(settings),
    }
    calibrate_router(model, val, recall=recall, llm_rate=llm_rate, out_dir=out_dir, history=history,
                     overwrite=overwrite)
    return model


def _check_classes(data_dir, router_type: str, train_tokens: int, train_pos: int, val_pos: int,
                   recall: float | None) -> None:
    """Refuse, before training, data a router cannot learn from or be calibrated on."""
    if router_type == "mlp" and train_pos in (0, train_tokens):
        # One class only: pos_weight is 0 or undefined and the loss is trivial; the router would learn nothing.
        raise ValueError(
            f"The training split of {data_dir} holds {train_pos} divergent and {train_tokens - train_pos} "
            "non-divergent tokens, but a router learns from both classes; label more (or more varied) prompts."
        )
    if recall is not None and val_pos == 0:
        raise ValueError(
            f"The validation split of {data_dir} holds no divergent tokens, so a recall target cannot be calibrated; "
            "label more prompts or calibrate to an LLM token rate (llm_rate=)."
        )


def _same_model(a: str, b: str) -> bool:
    """Two names of one model: equal, or a Hub id and a local copy of it (the same last path part)."""
    a, b = a.rstrip("/").lower(), b.rstrip("/").lower()
    return a == b or a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1]


def check_data_fits(config: R2RConfig, data: LabelData) -> None:
    """Refuse labels of another SLM than the router's: its threshold would be picked on features it never sees."""
    labelled_with, reads = data.manifest.get("slm"), config.slm_name_or_path
    if labelled_with and reads and not _same_model(str(labelled_with), str(reads)):
        raise ValueError(
            f"{data.root} was labelled with the SLM {labelled_with!r}, but this router reads the SLM {reads!r}; "
            f"calibrate it on labels of its own SLM (labelled with slm= {reads}), or fix slm_name_or_path in its "
            "config.json if both name the same model."
        )
    first = data.shard(data.shards[0])
    sizes = (first["hidden"].shape[1], first["token_embedding"].shape[1], first["topk_logits"].shape[1])
    if config.router_type == "mlp" and sizes != (config.slm_hidden_size, config.slm_embedding_size,
                                                 config.num_topk_logits):
        raise ValueError(
            f"The features of {data.root} (hidden {sizes[0]}, embedding {sizes[1]}, top {sizes[2]} logits) are not "
            f"the ones this router reads (hidden {config.slm_hidden_size}, embedding {config.slm_embedding_size}, "
            f"top {config.num_topk_logits}): they come from another SLM; calibrate it on labels of its own SLM."
        )


def _label_statistics(data: LabelData) -> dict:
    summary = data.summary
    counts, judged = summary["counts"], summary["tokens"] - summary["counts"]["excluded"]
    return {name: {"count": counts[name], "share": round(counts[name] / max(judged, 1), 4)}
            for name in (label.title for label in TRAINED)} | {"excluded": {"count": counts["excluded"], "share": 0}}


def calibrate_router(
    model: R2RForCausalLM,
    data: LabelData,
    recall: float | None = DEFAULT_RECALL,
    llm_rate: float | None = None,
    out_dir: str | os.PathLike | None = None,
    history: list[dict] | None = None,
    overwrite: bool = False,
) -> dict:
    """Pick the threshold on ``data``; store it in the config and how it was chosen in ``model.record``.

    With ``out_dir``, saves the router there with ``router_metrics.json`` beside it (the folder is checked
    first, as in ``train_router``). A recall target no grid threshold reaches keeps the paper's fallback, the
    highest-recall grid point; the record then says ``target_met: False`` with the recall reached, and a
    warning is logged.

    Args:
        model: the router (no SLM/LLM needed).
        data: calibration data (usually the validation split).
        recall: divergent-class recall target ...
        llm_rate: ... or LLM token rate target.
        out_dir: where to save.
        history: training curve to record in the metrics.
        overwrite: as in ``train_router``.
    """
    if llm_rate is not None:
        recall = None
    if out_dir is not None:
        check_output_folder(out_dir, overwrite)
    check_data_fits(model.config, data)
    scored = scores_on(model.router, data)
    threshold, report = calibration_report(scored["scores"], scored["targets"], scored["mismatch"], recall, llm_rate)
    at = report["all_tokens"]["at_threshold"]
    model.config.threshold = float(threshold) if math.isfinite(threshold) else threshold
    if recall is None:
        method = f"LLM token rate {llm_rate}"
    elif report["target_met"]:
        method = f"lowest LLM token rate with recall >= {recall}"
    else:
        method = f"highest recall on the threshold grid (no grid threshold reaches recall {recall})"
        logger.warning("No threshold on the grid reaches divergent recall %.3g on %s; kept the best reachable "
                       "threshold %.4g (recall %.3g), and the record says target_met: false.", recall, data.root,
                       threshold, at["recall"])
    if at["positives"] == 0:  # e.g. a tiny run: a recall of 0/0 is not a measurement, so none is recorded
        logger.warning("The calibration data %s holds no divergent token, so the router's recall cannot be "
                       "measured; label more prompts for a recall figure.", data.root)
    model.record["calibration"] = {
        "method": method,
        "target": report["target"],
        "target_met": report["target_met"],
        "data": f"{data.root} ({data.split or 'all'} split, {at['tokens']} tokens)",
        "recall": at["recall"] if at["positives"] else None, "precision": at["precision"],
        "llm_token_rate": at["llm_token_rate"],
    }
    if history is not None:
        report["training_curve"] = history
    model.record.update(report)
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return report
