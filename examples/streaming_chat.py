"""Streaming with HF's TextIteratorStreamer: generate in a thread, print the text as it arrives.

    python examples/streaming_chat.py [--router DIR] [--slm DIR --llm DIR]
"""

import argparse
import sys
from threading import Thread

import torch
from transformers import AutoTokenizer, TextIteratorStreamer

from r2r_hf import R2RForCausalLM
from r2r_hf.model.loading import cpu_dtype_choice

parser = argparse.ArgumentParser()
parser.add_argument("--router", default="hub_cards/r2r-qwen2.5-coder-0.5b-1.5b")
parser.add_argument("--slm")
parser.add_argument("--llm")
parser.add_argument("--max-new-tokens", type=int, default=128)
args = parser.parse_args()
# bfloat16 on a GPU; on a CPU bfloat16 or float32, whichever a decode step measured faster here (cached per machine).
DTYPE = torch.bfloat16 if torch.cuda.is_available() else cpu_dtype_choice().dtype

try:
    model = R2RForCausalLM.from_pretrained(args.router, slm=args.slm, llm=args.llm, dtype=DTYPE)
except (OSError, ValueError) as err:  # a router or model that cannot be found: one sentence, not a traceback
    sys.exit(f"error: {err}")
tok = AutoTokenizer.from_pretrained(model.slm.name_or_path)

history = []
for question in ("Write a function that reverses a string.", "Now make it skip spaces."):
    history.append({"role": "user", "content": question})
    inputs = tok.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    # generate() runs in a worker thread and feeds the streamer; this thread prints as text arrives.
    worker = Thread(target=model.generate,
                    kwargs=dict(**inputs, streamer=streamer, max_new_tokens=args.max_new_tokens, do_sample=False))
    worker.start()
    print(f"\nuser: {question}\nassistant: ", end="", flush=True)
    reply = ""
    for piece in streamer:
        reply += piece
        print(piece, end="", flush=True)
    worker.join()
    history.append({"role": "assistant", "content": reply})
print()
