"""How well each router finds the divergent tokens it has not been trained on, at equal LLM token rate.

    python -m benchmarks.quality.router_quality --labels work/coder [--label-set code+divergent] [--router DIR ...] \
        [--rates 0.05,0.1,0.2,0.4]

A second evaluation beside HumanEval, with far less noise: on the labeling run's validation split
(prompts the router never trained on, the LLM's own answers teacher-forced) it gives, for the
shipped router and the entropy and random baselines, the recall of divergent tokens when each
routes the same share of tokens, and the ROC AUC. Writes ``benchmarks/results/router_quality.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.models import ROUTER
from r2r_hf import R2RConfig, R2RForCausalLM
from r2r_hf.training import metrics_at, threshold_for_rate
from r2r_hf.pipeline import load_labels
from r2r_hf.training import scores_on



def roc_auc(scores: torch.Tensor | list[float], targets: torch.Tensor | list[int]) -> float:
    """Probability that a random positive (divergent) outscores a random negative (ties count half); NaN without
    both kinds."""
    scores, targets = torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(targets).bool()
    positives, negatives = scores[targets], scores[~targets].sort().values
    if not len(positives) or not len(negatives):
        return float("nan")
    below = torch.searchsorted(negatives, positives, right=False)
    at_or_below = torch.searchsorted(negatives, positives, right=True)
    return float(((below + at_or_below) / 2).mean() / len(negatives))


def baseline_like(trained: R2RForCausalLM, kind: str) -> R2RForCausalLM:
    """An ``entropy`` or ``random`` router with the trained router's config (same pair, same top-k)."""
    return R2RForCausalLM(R2RConfig(**{**trained.config.to_dict(), "router_type": kind})).eval()


def evaluate(labels: str, rates: list[float], routers_dirs: dict[str, str] | None = None,
             label_set: str | None = None) -> dict:
    validation = load_labels(labels, labels=label_set).split_of("validation")
    trained = {name: R2RForCausalLM.from_pretrained(path, load_pair=False)
               for name, path in (routers_dirs or {"r2r": ROUTER}).items()}
    first = next(iter(trained.values()))
    routers = {**trained, **{kind: baseline_like(first, kind) for kind in ("entropy", "random")}}
    results = {}
    for name, model in routers.items():
        scored = scores_on(model.router, validation)
        scores, targets = scored["scores"], scored["targets"]
        results[name] = {"roc_auc": roc_auc(scores, targets), "at_rate": [
            {"llm_token_rate": rate, **{k: v for k, v in metrics_at(scores, targets, threshold_for_rate(scores, rate)).items()
                                        if k in ("recall", "precision", "llm_token_rate")}}
            for rate in rates]}
    return {"data": f"validation split of {Path(labels).name}, label set {validation.labels}: {len(scores)} tokens, "
                    f"{int(targets.sum())} divergent", "routers": results}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", required=True)
    parser.add_argument("--label-set", help="the run's label set (default: the only one)")
    parser.add_argument("--router", action="append", help="NAME=DIR of a trained router (repeat; default: the shipped one)")
    parser.add_argument("--rates", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--out", default="benchmarks/results/router_quality.json")
    args = parser.parse_args(argv)
    dirs = dict(r.split("=", 1) for r in args.router) if args.router else None
    results = evaluate(args.labels, [float(r) for r in args.rates.split(",")], dirs, args.label_set)
    Path(args.out).write_text(json.dumps(results, indent=1))
    first = next(iter(results["routers"].values()))
    print("| router | ROC AUC | " + " | ".join(f"recall at {r['llm_token_rate']:.0%}" for r in first["at_rate"]) + " |")
    print("|---|---|" + "---|" * len(first["at_rate"]))
    for name, r in results["routers"].items():
        print(f"| {name} | {r['roc_auc']:.3f} | " + " | ".join(f"{p['recall']:.1%}" for p in r["at_rate"]) + " |")


if __name__ == "__main__":
    main()
