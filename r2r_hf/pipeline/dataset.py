"""Step 4: one label per answer token, and the label dataset's loading API.

Labels: 0 identical (the SLM's proposal equals the LLM's token), 1 neutral (they differ but
the verifier, or identical sentences, say it does not matter), 2 divergent (the LLM must
write it), -1 excluded (the verifier's answer could not be parsed). The router learns
``label == 2``; rows labelled -1 are never trained on.

Load a finished run with one call::

    data = r2r_hf.pipeline.load_labels("work/")
    data.summary
    for batch in data.batches(1024, shuffle=True): ...   # dicts of tensors, one shard in RAM at a time
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .store import WorkDir, read_json, read_tensors, write_json, write_tensors

IDENTICAL, NEUTRAL, DIVERGENT, EXCLUDED = 0, 1, 2, -1
CLASS_NAMES = {IDENTICAL: "identical", NEUTRAL: "neutral", DIVERGENT: "divergent", EXCLUDED: "excluded"}
FEATURES = ("topk_logits", "token_embedding", "hidden")


def shard_labels(features: dict[str, torch.Tensor], continuations: list[dict], verdicts: list[dict]) -> torch.Tensor:
    """Per-token labels of a shard from its mismatches and their verdicts."""
    labels = torch.full(features["slm_token"].shape, IDENTICAL, dtype=torch.int8)
    for mismatch, verdict in zip(continuations, verdicts):
        value = verdict["verdict"]
        labels[mismatch["row"]] = NEUTRAL if value == 0 else DIVERGENT if value == 1 else EXCLUDED
    return labels


def summarize(work: WorkDir) -> dict:
    """Class counts and shares, response and cost statistics of a finished run."""
    counts = {name: 0 for name in CLASS_NAMES.values()}
    responses = {"finished": 0, "truncated": 0}
    cost = {step: {"tokens": 0, "seconds": 0.0} for step in ("responses", "features", "continuations", "verdicts")}
    for index in work.shards("labels"):
        labels, _ = read_tensors(work.shard("labels", index), ["label"])
        values, numbers = torch.unique(labels["label"], return_counts=True)
        for v, n in zip(values.tolist(), numbers.tolist()):
            counts[CLASS_NAMES[v]] += n
        for sample in read_json(work.shard("responses", index))["samples"]:
            responses["finished" if sample["finished"] else "truncated"] += 1
        for step in cost:
            path = work.shard(step, index)
            meta = read_tensors(path, [])[1] if step == "features" else read_json(path)
            cost[step]["tokens"] += meta.get("tokens", 0)
            cost[step]["seconds"] += meta.get("seconds", 0.0)
    total = sum(counts.values())
    judged = total - counts["excluded"]
    return {
        "tokens": total,
        "counts": counts,
        "shares": {k: (v / judged if judged and k != "excluded" else 0.0) for k, v in counts.items() if k != "excluded"},
        "mismatch_rate": (counts["neutral"] + counts["divergent"]) / judged if judged else 0.0,
        "unparsable_verdicts": counts["excluded"],
        "responses": responses,
        "cost": cost,
    }


def write_labels(work: WorkDir, index: int) -> None:
    """Write the labels shard ``index`` from the steps before it."""
    features, _ = read_tensors(work.shard("features", index), ["slm_token"])
    continuations = read_json(work.shard("continuations", index))["mismatches"]
    verdicts = read_json(work.shard("verdicts", index))["verdicts"]
    write_tensors(work.shard("labels", index), {"label": shard_labels(features, continuations, verdicts)}, {})


def _in_validation(sample_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


@dataclass
class LabelData:
    """A finished labeling run (or a split of it), read shard by shard.

    Args:
        root: the run's folder.
        split: ``None`` (all samples), ``"train"`` or ``"validation"``.
        validation_fraction: share of samples (never of tokens) held out.
        seed: decides which samples are held out.
    """

    root: Path
    split: str | None = None
    validation_fraction: float = 0.1
    seed: int = 0
    shards: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        work = WorkDir(self.root)
        self.shards = work.shards("labels")
        if not self.shards:
            raise FileNotFoundError(f"{self.root} holds no labels; run `r2r-hf label` there first.")
        self._work = work

    @property
    def summary(self) -> dict:
        return read_json(self.root / "summary.json")

    @property
    def manifest(self) -> dict:
        return read_json(self._work.manifest_path)

    def split_of(self, split: str) -> LabelData:
        """The same data restricted to ``"train"`` or ``"validation"`` samples."""
        return LabelData(self.root, split, self.validation_fraction, self.seed)

    def shard(self, index: int) -> dict[str, torch.Tensor]:
        """All usable rows of one shard: features (float32), ``label`` and ``target`` (label == divergent)."""
        tensors, meta = read_tensors(self._work.shard("features", index))
        labels, _ = read_tensors(self._work.shard("labels", index))
        keep = labels["label"] != EXCLUDED
        if self.split is not None:
            held = torch.tensor([_in_validation(i, self.validation_fraction, self.seed) for i in meta["ids"]])
            in_val = held[tensors["sample"].long()] if len(held) else torch.zeros(0, dtype=torch.bool)
            keep &= in_val if self.split == "validation" else ~in_val
        out = {k: tensors[k][keep].float() for k in FEATURES}
        out.update({k: tensors[k][keep] for k in ("slm_token", "real_token", "position", "sample")})
        out["label"] = labels["label"][keep].long()
        out["target"] = (out["label"] == DIVERGENT).float()
        return out

    def batches(self, batch_size: int, shuffle: bool = False, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of rows; with ``shuffle`` the shard order and the rows within each shard are shuffled."""
        order = list(self.shards)
        rng = random.Random(seed)
        if shuffle:
            rng.shuffle(order)
        for index in order:
            rows = self.shard(index)
            n = len(rows["label"])
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(rng.randrange(2**31))) if shuffle \
                else torch.arange(n)
            for start in range(0, n, batch_size):
                pick = perm[start : start + batch_size]
                yield {k: v[pick] for k, v in rows.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every row in memory at once (small runs, analysis)."""
        parts = [self.shard(i) for i in self.shards]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def load_labels(root: str | os.PathLike, split: str | None = None, validation_fraction: float = 0.1,
                seed: int = 0) -> LabelData:
    """Open a labeling run's dataset.

    Args:
        root: the ``--out`` folder of ``r2r-hf label``.
        split: ``None``, ``"train"`` or ``"validation"`` (split by sample, never by token).
        validation_fraction: share of samples held out for validation.
        seed: which samples are held out.
    """
    return LabelData(Path(root), split, validation_fraction, seed)


def write_summary(work: WorkDir) -> dict:
    summary = summarize(work)
    write_json(work.root / "summary.json", summary)
    return summary
