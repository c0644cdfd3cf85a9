"""What scoring in the models' dtype costs a router: fp32 against its bf16 copy, on held-out labels.

    python -m benchmarks.quality.router_dtype --labels work/coder [--label-set code+divergent] [--router DIR] \
        [--dtypes float32,bfloat16] [--rates 0.05,0.1,0.2,0.4]

The captured path scores with a copy of the router cast to the SLM's dtype (``r2r_hf/core/fast/router_copy.py``);
this benchmark makes that very copy (``Scorer``) and scores the labelling run's validation split (prompts
the router never trained on) with each dtype: the ROC AUC, the recall at equal LLM token rates, the largest and
typical score change, and how many routing decisions change at the router's own threshold. Writes
``benchmarks/results/router_dtype.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.models import ROUTER
from benchmarks.quality.router_quality import roc_auc
from benchmarks.record import versions
from r2r_hf import R2RForCausalLM
from r2r_hf.core.fast.router_copy import SCORE_TOLERANCE, Scorer
from r2r_hf.pipeline import load_labels
from r2r_hf.training import metrics_at, scores_on, threshold_for_rate


def compare(labels: str, router_dir: str = ROUTER, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
            rates: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4), label_set: str | None = None,
            split: str = "validation") -> dict:
    """Each dtype's quality on the held-out labels, and its change against the first dtype's.

    ``split``: "validation" (the run's own held-out prompts), or "all" for a run of held-out prompts only.
    """
    data = load_labels(labels, labels=label_set)
    validation = data.split_of("validation") if split == "validation" else data
    model = R2RForCausalLM.from_pretrained(router_dir, load_pair=False)
    threshold = float(model.config.threshold)
    results, base = {}, None
    for name in dtypes:
        dtype = getattr(torch, name)
        scoring = Scorer(model.router, dtype, "model").module  # what the captured path scores with, unchecked
        scored = scores_on(scoring, validation)
        scores, targets = scored["scores"].float(), scored["targets"]
        row = {"roc_auc": roc_auc(scores, targets), "at_rate": [
            {"llm_token_rate": rate, **{k: v for k, v in metrics_at(scores, targets, threshold_for_rate(scores, rate))
                                        .items() if k in ("recall", "precision", "llm_token_rate")}}
            for rate in rates]}
        if base is None:
            base = scores
        else:
            change = (scores - base).abs()
            row["against_" + dtypes[0]] = {
                "roc_auc_change": row["roc_auc"] - results[dtypes[0]]["roc_auc"],
                "score_change_max": float(change.max()), "score_change_mean": float(change.mean()),
                "score_change_p99": float(change.quantile(0.99)),
                "decisions_changed_at_threshold": int(((scores >= threshold) != (base >= threshold)).sum()),
                "within_tolerance": bool(change.max() <= SCORE_TOLERANCE)}
        results[name] = row
    return {"data": f"{split} split of {Path(labels).name}, label set {validation.labels}: {len(base)} tokens, "
                    f"{int(targets.sum())} divergent", "router": router_dir, "threshold": threshold,
            "tolerance": SCORE_TOLERANCE, "dtypes": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", required=True, help="a labelling run's folder")
    parser.add_argument("--label-set", help="the run's label set (default: the only one)")
    parser.add_argument("--router", default=ROUTER, help=f"a trained router's folder (default: {ROUTER})")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="the first is the reference")
    parser.add_argument("--rates", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--split", choices=("validation", "all"), default="validation",
                        help="all: the run labelled held-out prompts only (every sample is held out)")
    parser.add_argument("--out", default="benchmarks/results/router_dtype.json")
    args = parser.parse_args(argv)
    found = compare(args.labels, args.router, tuple(args.dtypes.split(",")),
                    tuple(float(r) for r in args.rates.split(",")), args.label_set, args.split)
    given = argv if argv is not None else sys.argv[1:]
    found["command"] = "python -m benchmarks.quality.router_dtype " + " ".join(given)
    found["conditions"] = {**versions(), "device": "cpu"}
    Path(args.out).write_text(json.dumps(found, indent=1))
    first = next(iter(found["dtypes"].values()))
    print(found["data"])
    print("| router dtype | ROC AUC | " + " | ".join(f"recall at {r['llm_token_rate']:.0%}" for r in first["at_rate"])
          + " | largest score change | decisions changed at the threshold |")
    print("|---|---|" + "---|" * len(first["at_rate"]) + "---|---|")
    for name, r in found["dtypes"].items():
        change = r.get("against_" + args.dtypes.split(",")[0], {})
        print(f"| {name} | {r['roc_auc']:.4f} | " + " | ".join(f"{p['recall']:.1%}" for p in r["at_rate"])
              + f" | {change.get('score_change_max', 0):.4f} | {change.get('decisions_changed_at_threshold', 0)} |")


if __name__ == "__main__":
    main()
