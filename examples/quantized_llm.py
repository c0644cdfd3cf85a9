"""Quantise only the LLM with bitsandbytes; the SLM and the router keep their precision.

    python examples/quantized_llm.py [--bits 4|8] [--router DIR] [--slm DIR --llm DIR]

4-bit NF4 is the usual choice on GPUs; on CPUs bitsandbytes runs 8-bit (and 4-bit for hidden
sizes that are multiples of 128).
"""

import argparse
import logging
import sys
import warnings

import torch
from transformers import AutoTokenizer, BitsAndBytesConfig

from r2r_hf import R2RForCausalLM

# bitsandbytes logs at every 8-bit matmul that bf16 inputs are cast to fp16 (thousands of identical lines), and
# transformers may say that the optional `kernels` package is absent: both harmless here, so they are kept quiet.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=r".*kernels.*")

parser = argparse.ArgumentParser()
parser.add_argument("--router", default="hub_cards/r2r-qwen2.5-coder-0.5b-1.5b")
parser.add_argument("--slm")
parser.add_argument("--llm")
parser.add_argument("--bits", type=int, choices=(4, 8), default=8)
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

quantization = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16) if args.bits == 4
                else BitsAndBytesConfig(load_in_8bit=True))
try:
    model = R2RForCausalLM.from_pretrained(
        args.router, slm=args.slm, llm=args.llm,
        slm_kwargs={"dtype": torch.bfloat16},
        llm_kwargs={"quantization_config": quantization},  # quantisation is per model: here the LLM only
    )
except (OSError, ValueError, ImportError) as err:  # a missing router or model, or no bitsandbytes: one sentence
    sys.exit(f"error: {err}")
tok = AutoTokenizer.from_pretrained(model.slm.name_or_path)
print("LLM layer type:", type(model.llm.get_decoder().layers[0].mlp.down_proj).__name__)

inputs = tok("def fizzbuzz(n):", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
print(tok.decode(out.sequences[0], skip_special_tokens=True))
print(f"LLM token rate {out.llm_token_rate:.1%}")
