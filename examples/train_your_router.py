"""From a prompts file to a calibrated router: label, train, calibrate, load.

    python examples/train_your_router.py --slm SLM --llm LLM --prompts prompts.jsonl --out my-run/

The same as the CLI:
    r2r-hf label --slm SLM --llm LLM --prompts prompts.jsonl --out my-run/labels
    r2r-hf train --data my-run/labels --out my-run/router
"""

import argparse
from pathlib import Path

from r2r_hf import R2RForCausalLM
from r2r_hf.pipeline import LabelSettings, label, load_labels
from r2r_hf.training import TrainSettings, calibrate_router, train_router

parser = argparse.ArgumentParser()
parser.add_argument("--slm", required=True)
parser.add_argument("--llm", required=True)
parser.add_argument("--verifiers", default="llm", help="verifier chain, e.g. code,llm")
parser.add_argument("--judge", help="judge model of the llm verifier (default: the LLM)")
parser.add_argument("--prompts", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--limit", type=int, default=32, help="label only the first N prompts")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
labels, router_dir = Path(args.out) / "labels", Path(args.out) / "router"

# 1. Label: reference answers, SLM features, continuations at mismatches, verdicts. Resumable.
settings = LabelSettings(slm=args.slm, llm=args.llm, verifiers=args.verifiers, judge=args.judge, dtype=args.dtype,
                         max_new_tokens=args.max_new_tokens)
summary = label(settings, args.prompts, labels, limit=args.limit)
print("label shares:", {k: f"{v:.1%}" for k, v in summary["shares"].items()})

# 2. Train on the train split; the threshold is calibrated on the validation split (recall 0.95).
model = train_router(labels, router_dir, TrainSettings(epochs=args.epochs), recall=0.95)
print(f"threshold {model.config.threshold:.3g}, expected LLM token rate {model.record['calibration']['llm_token_rate']:.1%}")

# 3. Or re-calibrate for a cost target: route 10% of tokens.
calibrate_router(model, load_labels(labels).split_of("validation"), llm_rate=0.10, out_dir=router_dir)

# 4. The folder is a normal router: load it with its pair (or push it with `r2r-hf push`).
router = R2RForCausalLM.from_pretrained(router_dir)
print(router.config.slm_name_or_path, "+", router.config.llm_name_or_path, "threshold", router.config.threshold)
