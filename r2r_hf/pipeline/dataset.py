"""Step 4: one label per answer token for a verifier chain (a label set), and the label dataset's loading API.

Labels (``classes.Label``): identical (the SLM's proposal equals the LLM's token), neutral (they differ, and
the two sentences are the same text or a verifier said it does not matter), divergent (the LLM must write
it), excluded (no verifier of the chain decided). The router learns ``label == Label.DIVERGENT``; excluded
rows are never trained on. Each label records who decided it (``decided_by``).

Load a finished run with one call::

    data = r2r_hf.pipeline.load_labels("work/", labels="code+llm")   # the only label set: labels may be omitted
    data.summary
    for batch in data.batches(1024, shuffle=True): ...   # dicts of tensors, one shard in RAM at a time
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .classes import Label
from .steps import CONTINUATIONS, FEATURES as FEATURES_STEP, LABELS, RESPONSES, STEPS
from .store import WorkDir, read_json, read_tensors, write_json, write_tensors
from .verifiers.chain import IDENTICAL, UNDECIDED, ShardDecisions, verifier_seconds

FEATURES = ("topk_logits", "token_embedding", "hidden")


def check_label_set(work: WorkDir, name: str, chain_settings: list[dict[str, Any]], record: bool = False) -> None:
    """Refuse to mix other verifier settings into an existing label set; with ``record``, write a new set's."""
    path = work.folder(LABELS, name) / "settings.json"
    settings = {"name": name, "verifiers": chain_settings}
    if path.exists():
        old = read_json(path, "settings")
        if old != settings:
            raise ValueError(f"{path.parent} holds labels from other verifier settings ({old['verifiers']}); label "
                             "into a new label set with labels=NAME (--labels NAME; earlier labels are never overwritten).")
    elif record:
        write_json(path, settings)


def write_label_set(work: WorkDir, name: str, chain: list, shards: int, decisions: Callable[[int], ShardDecisions],
                    progress: bool = True) -> dict:
    """Write the labels of every shard for a verifier chain, then the set's ``summary.json``; returns the summary.

    Args:
        work: the run.
        name: the label set.
        chain: the verifiers, in order.
        shards: how many shards the run has.
        decisions: shard index -> the chain's decisions on its mismatches (complete for every shard).
    """
    names = [IDENTICAL] + [v.name for v in chain] + [UNDECIDED]
    by = {n: {Label.NEUTRAL.title: 0, Label.DIVERGENT.title: 0, Label.EXCLUDED.title: 0} for n in names}
    for k in tqdm(range(shards), desc="labels", unit="shard", disable=not progress):
        decided = decisions(k).check(k).decisions
        for decision, who in decided:
            by[who][Label.of(decision).title] += 1
        if work.done(LABELS, k, name):
            continue
        features, _ = read_tensors(work.shard(FEATURES_STEP, k), ["slm_token"])
        mismatches = work.read(CONTINUATIONS, k)["mismatches"]
        labels = torch.full(features["slm_token"].shape, Label.IDENTICAL, dtype=torch.int8)
        decided_by = torch.full(features["slm_token"].shape, -1, dtype=torch.int8)
        for m, (decision, who) in zip(mismatches, decided):
            labels[m["row"]] = Label.of(decision)
            decided_by[m["row"]] = names.index(who)
        write_tensors(work.shard(LABELS, k, name), {"label": labels, "decided_by": decided_by}, {"decided_by": names})
    summary = summarize(work, name)
    summary["decided_by"] = by
    cost = verifier_seconds(work, chain, list(range(shards)))
    summary["cost"].update({f"verifier {v}": c for v, c in cost.items()})
    per_thousand = 1000 / max(summary["tokens"], 1)
    summary["seconds_per_1000_labelled_tokens"] = {step: round(c["seconds"] * per_thousand, 3)
                                                  for step, c in summary["cost"].items()}
    write_json(work.summary_path(name), summary)
    return summary


def summarize(work: WorkDir, label_set: str) -> dict:
    """Class counts and shares, response and cost statistics of a label set."""
    counts = {label.title: 0 for label in Label}
    responses = {"finished": 0, "truncated": 0}
    costed = [step for step in STEPS if step.costed]
    cost = {step.name: {"tokens": 0, "seconds": 0.0} for step in costed}
    for index in work.shards(LABELS, label_set):
        labels, _ = read_tensors(work.shard(LABELS, index, label_set), ["label"])
        values, numbers = torch.unique(labels["label"], return_counts=True)
        for v, n in zip(values.tolist(), numbers.tolist()):
            counts[Label(v).title] += n
        for sample in work.read(RESPONSES, index)["samples"]:
            responses["finished" if sample["finished"] else "truncated"] += 1
        for step in costed:
            path = work.shard(step, index)
            meta = read_tensors(path, [])[1] if step.suffix == ".safetensors" else read_json(path, step)
            cost[step.name]["tokens"] += meta.get("tokens", 0)
            cost[step.name]["seconds"] += meta.get("seconds", 0.0)
    total = sum(counts.values())
    judged = total - counts["excluded"]
    mismatches = counts["neutral"] + counts["divergent"]
    return {
        "label_set": label_set,
        "tokens": total,
        "counts": counts,
        "shares": {k: (v / judged if judged and k != "excluded" else 0.0) for k, v in counts.items() if k != "excluded"},
        "mismatch_rate": mismatches / judged if judged else 0.0,
        "neutral_share_of_mismatches": counts["neutral"] / mismatches if mismatches else 0.0,
        "excluded": counts["excluded"],
        "responses": responses,
        "cost": cost,
    }


def _in_validation(sample_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def pick_label_set(work: WorkDir, labels: str | None) -> str:
    """The label set to read: the one named, or the only one there is."""
    sets = work.label_sets()
    if not sets:
        raise FileNotFoundError(f"{work.root} holds no labels; label it first (pipeline.label, r2r-hf label).")
    if labels is None:
        if len(sets) > 1:
            raise ValueError(f"{work.root} holds several label sets ({', '.join(sets)}); pick one with labels=.")
        return sets[0]
    if labels not in sets:
        raise ValueError(f"{work.root} holds no label set {labels!r}; it holds {', '.join(sets)}.")
    return labels


@dataclass
class LabelData:
    """A finished labeling run's label set (or a split of it), read shard by shard.

    Args:
        root: the run's folder.
        split: ``None`` (all samples), ``"train"`` or ``"validation"``.
        validation_fraction: share of samples (never of tokens) held out.
        seed: decides which samples are held out.
        labels: the label set (default: the only one).
    """

    root: Path
    split: str | None = None
    validation_fraction: float = 0.1
    seed: int = 0
    labels: str | None = None
    shards: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._work = WorkDir(self.root)
        self.labels = pick_label_set(self._work, self.labels)
        self.shards = self._work.shards(LABELS, self.labels)
        if not self.shards:
            raise FileNotFoundError(f"{self.root} label set {self.labels!r} has no labels yet; finish labeling it (its labels step).")

    @property
    def summary(self) -> dict:
        return read_json(self._work.summary_path(self.labels), "summary")

    @property
    def manifest(self) -> dict:
        return self._work.manifest()

    def split_of(self, split: str) -> LabelData:
        """The same data restricted to ``"train"`` or ``"validation"`` samples."""
        return LabelData(self.root, split, self.validation_fraction, self.seed, self.labels)

    def shard(self, index: int) -> dict[str, torch.Tensor]:
        """All usable rows of one shard: features (float32), ``label`` and ``target`` (label == divergent)."""
        tensors, meta = read_tensors(self._work.shard(FEATURES_STEP, index))
        labels, _ = read_tensors(self._work.shard(LABELS, index, self.labels), ["label"])
        if len(labels["label"]) != len(tensors["slm_token"]):
            raise ValueError(f"Shard {index} of {self.root} has {len(labels['label'])} labels for "
                             f"{len(tensors['slm_token'])} tokens; delete labels/{self.labels}/shard-{index:05d} "
                             "and rerun the 'labels' step.")
        keep = labels["label"] != Label.EXCLUDED
        if self.split is not None:
            held = torch.tensor([_in_validation(i, self.validation_fraction, self.seed) for i in meta["ids"]])
            in_val = held[tensors["sample"].long()] if len(held) else torch.zeros(0, dtype=torch.bool)
            keep &= in_val if self.split == "validation" else ~in_val
        out = {k: tensors[k][keep].float() for k in FEATURES}
        out.update({k: tensors[k][keep] for k in ("slm_token", "real_token", "position", "sample")})
        out["label"] = labels["label"][keep].long()
        out["target"] = (out["label"] == Label.DIVERGENT).float()
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
                seed: int = 0, labels: str | None = None) -> LabelData:
    """Open a labeling run's label set.

    Args:
        root: the ``--out`` folder of ``r2r-hf label``.
        split: ``None``, ``"train"`` or ``"validation"`` (split by sample, never by token).
        validation_fraction: share of samples held out for validation.
        seed: which samples are held out.
        labels: the label set (default: the only one the run has).
    """
    return LabelData(Path(root), split, validation_fraction, seed, labels)

