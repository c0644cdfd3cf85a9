"""Train the shipped Qwen2.5-Coder router from a labeling run and write it to hub_cards/.

    python -m benchmarks.router.build --labels work/coder --label-set code+divergent [--out DIR]   # train + calibrate
    python -m benchmarks.router.build --evaluation benchmarks/results/humaneval-TAG.json [--out DIR]  # to the card

The labeling run comes from (see docs/results.md for the exact command):
    r2r-hf label --slm <0.5B folder> --llm <1.5B folder> --prompts benchmarks/data/stdlib_prompts.jsonl ...
The router names the Hub ids of the pair; offline, load it with slm=/llm= local folders
(benchmarks/models.py fetches them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.models import PAIR, ROUTER
from r2r_hf import R2RForCausalLM
from r2r_hf.pipeline import load_labels
from r2r_hf.model.record import RECORD_FILE
from r2r_hf.training import TrainSettings, calibrate_router, train_router

OUT = Path(ROUTER)


# The paper's batch 1024 / lr 5e-5 assume ~7.6M labels (7k steps per epoch). On ~5*10^4 labels that is
# 50 steps per epoch; smaller batches and a larger step size give the optimiser enough updates.
SETTINGS = dict(batch_size=256, lr=2e-4, epochs=50, patience=10)
# The paper's rule (recall >= 0.95 on the validation split) unless that routes more than this share of
# tokens: past it the LLM's catch-up cost eats the speed-up a user runs R2R for.
RECALL, MAX_LLM_RATE = 0.95, 0.20


def build(labels: str, seed: int, out: Path = OUT, label_set: str | None = None) -> R2RForCausalLM:
    model = train_router(labels, out, TrainSettings(seed=seed, **SETTINGS), recall=RECALL, labels=label_set)
    if model.record.llm_token_rate > MAX_LLM_RATE:
        curve = json.loads((out / RECORD_FILE).read_text()).get("training_curve")
        calibrate_router(model, load_labels(labels, labels=label_set).split_of("validation"), llm_rate=MAX_LLM_RATE,
                         out_dir=out, history=curve)
        model.record["calibration"]["method"] += (f" (recall >= {RECALL} needed more than {MAX_LLM_RATE:.0%} of "
                                                  "tokens: capped at that rate)")
    data = load_labels(labels, labels=label_set)
    summary, manifest = data.summary, data.manifest
    verifiers = json.loads((Path(labels) / "labels" / data.labels / "settings.json").read_text())["verifiers"] \
        if data.labels != "legacy" else [{"name": "llm", "judge": "the LLM (Qwen2.5-Coder-1.5B-Instruct)"}]
    config, record = model.config, model.record
    config.slm_name_or_path, config.llm_name_or_path = PAIR["slm"]["hub_id"], PAIR["llm"]["hub_id"]
    record["license"] = "apache-2.0"
    split = record["calibration"]["data"].rsplit("(", 1)[-1]  # the machine's run folder means nothing on the Hub
    record["calibration"]["data"] = f"the labeling run ({split}"
    record["training"].update({
        "data": "benchmarks/data/stdlib_prompts.jsonl: 'complete this function' prompts from the Python 3.11 "
                f"standard library (disjoint from HumanEval), {summary['responses']['finished'] + summary['responses']['truncated']} "
                f"prompts, labelled with `r2r-hf label` (label set {data.labels})",
        "labeling": {k: manifest[k] for k in ("dtype", "max_new_tokens", "batch_size", "continuation_max_tokens",
                                               "context_tokens")} | {"verifiers": [v["name"] for v in verifiers]},
        "labeling_cost": summary["cost"],
        "weights_used": "Q4_K_M GGUF re-uploads dequantised to bf16 (benchmarks/models.py)",
    })
    model.save_pretrained(out)
    return model


def add_evaluation(path: str, out: Path = OUT) -> None:
    model = R2RForCausalLM.from_pretrained(out, load_pair=False)
    results = json.loads(Path(path).read_text())
    model.record["evaluation"] = {
        "benchmark": results["benchmark"] + ", greedy, chat template; details in docs/results.md",
        "results": [{"system": r["name"], "pass@1": round(r["pass_at_1"], 3), "LLM token rate": round(r["llm_token_rate"], 3),
                     "avg. active params (B)": round(r["avg_activated_params"] / 1e9, 2)} for r in results["results"]],
    }
    model.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--labels", help="labeling run to train on")
    parser.add_argument("--evaluation", help="humaneval.json to show in the model card")
    parser.add_argument("--label-set", help="the run's label set (default: the only one)")
    parser.add_argument("--out", default=str(OUT), help="router folder (default: the shipped one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.labels:
        model = build(args.labels, args.seed, out, args.label_set)
        print(f"wrote {out}: threshold {model.config.threshold:.4g}, "
              f"expected LLM token rate {model.record.llm_token_rate:.1%}")
    if args.evaluation:
        add_evaluation(args.evaluation, out)
        print(f"added the evaluation to {out}/README.md")


if __name__ == "__main__":
    main()
