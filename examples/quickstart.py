"""Quickstart: load a router with its SLM and LLM, generate, and see which tokens the LLM wrote.

    python examples/quickstart.py                                  # the prebuilt Qwen2.5-Coder router
    python examples/quickstart.py --router org/router --slm DIR --llm DIR
"""

import argparse
import sys

import torch
from transformers import AutoTokenizer

from r2r_hf import R2RForCausalLM
from r2r_hf.model.loading import cpu_dtype_choice
from r2r_hf.views import to_ansi, use_color

parser = argparse.ArgumentParser()
parser.add_argument("--router", default="hub_cards/r2r-qwen2.5-coder-0.5b-1.5b")
parser.add_argument("--slm", help="SLM folder or Hub id (default: the one the router names)")
parser.add_argument("--llm", help="local LLM folder")
parser.add_argument("--max-new-tokens", type=int, default=128)
args = parser.parse_args()
# bfloat16 on a GPU; on a CPU bfloat16 or float32, whichever a decode step measured faster here (cached per machine).
DTYPE = torch.bfloat16 if torch.cuda.is_available() else cpu_dtype_choice().dtype

# The router's config.json names the SLM and LLM; slm=/llm= override them (e.g. with local folders).
try:
    model = R2RForCausalLM.from_pretrained(args.router, slm=args.slm, llm=args.llm, dtype=DTYPE)
except (OSError, ValueError) as err:  # a router or model that cannot be found: one sentence, not a traceback
    sys.exit(f"error: {err}")
tok = AutoTokenizer.from_pretrained(model.slm.name_or_path)  # the SLM's folder (or Hub id) as it was loaded

messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)

# An ordinary HF generate call; return_dict_in_generate adds the routing record.
out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)

print(to_ansi(out, tok, color=use_color()))
print(f"\n{int(out.generated_mask.sum())} tokens, {int(out.routed.sum())} written by the LLM "
      f"(LLM token rate {out.llm_token_rate:.1%}, threshold {out.threshold:.3g})")
