"""R2R inside a transformers pipeline: existing pipeline code works unchanged.

    python examples/pipeline_usage.py [--router DIR] [--slm DIR --llm DIR]
"""

import argparse
import sys

import torch
from transformers import AutoTokenizer, pipeline

from r2r_hf import R2RForCausalLM
from r2r_hf.model.loading import cpu_dtype_choice

parser = argparse.ArgumentParser()
parser.add_argument("--router", default="hub_cards/r2r-qwen2.5-coder-0.5b-1.5b")
parser.add_argument("--slm")
parser.add_argument("--llm")
parser.add_argument("--max-new-tokens", type=int, default=96)
args = parser.parse_args()
# bfloat16 on a GPU; on a CPU bfloat16 or float32, whichever a decode step measured faster here (cached per machine).
DTYPE = torch.bfloat16 if torch.cuda.is_available() else cpu_dtype_choice().dtype

try:
    model = R2RForCausalLM.from_pretrained(args.router, slm=args.slm, llm=args.llm, dtype=DTYPE)
except (OSError, ValueError) as err:  # a router or model that cannot be found: one sentence, not a traceback
    sys.exit(f"error: {err}")
tok = AutoTokenizer.from_pretrained(model.slm.name_or_path)

generator = pipeline("text-generation", model=model, tokenizer=tok)
chat = [{"role": "user", "content": "Write a one-line Python expression that squares every item of xs."}]
result = generator(chat, max_new_tokens=args.max_new_tokens, do_sample=False)
print(result[0]["generated_text"][-1]["content"])

# Per-call generation settings, including R2R's threshold, pass through the pipeline.
result = generator("def is_prime(n):", max_new_tokens=args.max_new_tokens, do_sample=False, threshold=0.0)
print(result[0]["generated_text"])
