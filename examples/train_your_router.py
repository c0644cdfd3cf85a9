"""From a prompts file to a calibrated router: label, train, calibrate, load.

    python examples/train_your_router.py                 # the demo's pair on 32 standard-library prompts
    python examples/train_your_router.py --slm SLM --llm LLM --prompts prompts.jsonl --out my-run/
    python examples/train_your_router.py ... --llm-rate 0.1        # calibrate to a cost instead of a recall

The same as the CLI:
    r2r-hf label --slm SLM --llm LLM --prompts prompts.jsonl --out my-run/labels --verifier code,divergent
    r2r-hf train --data my-run/labels --out my-run/router

The default verifier chain is the code one (``code,divergent``: a difference the code verifier cannot show
harmless counts as divergent; the shipped router, whose prompts are half GSM8K questions, adds ``maths``);
``--verifiers code,llm --judge MODEL`` asks a judge model instead (a small judge is no better than chance:
docs/results.md).
"""

import argparse
import sys
from pathlib import Path

from r2r_hf import R2RForCausalLM
from r2r_hf.pipeline import LabelSettings, label, load_labels
from r2r_hf.training import TrainSettings, calibrate_router, train_router

STDLIB_PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "stdlib_prompts.jsonl"
parser = argparse.ArgumentParser()
parser.add_argument("--slm", default="Qwen/Qwen2.5-Coder-0.5B-Instruct", help="SLM Hub id or folder")
parser.add_argument("--llm", default="Qwen/Qwen2.5-Coder-1.5B-Instruct", help="LLM Hub id or folder")
parser.add_argument("--verifiers", default="code,divergent", help="verifier chain, e.g. code,divergent or code,llm")
parser.add_argument("--judge", help="judge model of the llm verifier (default: the LLM)")
parser.add_argument("--prompts", default=str(STDLIB_PROMPTS),
                    help="JSONL of prompts (default: the standard-library ones the previous router learned from)")
parser.add_argument("--out", default="my-run", help="run folder (labels/ and router/ go inside)")
parser.add_argument("--limit", type=int, default=32, help="label only the first N prompts")
parser.add_argument("--max-new-tokens", type=int, default=256)
parser.add_argument("--epochs", type=int, default=20)
target = parser.add_mutually_exclusive_group()
target.add_argument("--recall", type=float, default=0.95, help="calibrate to this divergent recall (the paper's rule)")
target.add_argument("--llm-rate", type=float, help="calibrate to route this share of the tokens instead")
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
labels, router_dir = Path(args.out) / "labels", Path(args.out) / "router"

try:
    # 1. Label: reference answers, SLM features, continuations at mismatches, verdicts. Resumable.
    settings = LabelSettings(slm=args.slm, llm=args.llm, verifiers=args.verifiers, judge=args.judge, dtype=args.dtype,
                             max_new_tokens=args.max_new_tokens)
    summary = label(settings, args.prompts, labels, limit=args.limit)
    print("label shares:", {k: f"{v:.1%}" for k, v in summary["shares"].items()})

    # 2. Train on the train split; the threshold is calibrated on the validation split (recall, or a rate).
    target = {"llm_rate": args.llm_rate} if args.llm_rate is not None else {"recall": args.recall}
    model = train_router(labels, router_dir, TrainSettings(epochs=args.epochs), **target)
except (OSError, ValueError) as err:  # bad input or too little data: one sentence, not a traceback
    sys.exit(f"error: {err}")
print(f"threshold {model.config.threshold:.3g}, expected LLM token rate {model.record['calibration']['llm_token_rate']:.1%}")

# 3. Or re-calibrate for a cost target: route 10% of tokens.
calibrate_router(model, load_labels(labels).split_of("validation"), llm_rate=0.10, out_dir=router_dir)

# 4. The folder is a normal router: load it with its pair (or push it with `r2r-hf push`).
router = R2RForCausalLM.from_pretrained(router_dir)
print(router.config.slm_name_or_path, "+", router.config.llm_name_or_path, "threshold", router.config.threshold)
