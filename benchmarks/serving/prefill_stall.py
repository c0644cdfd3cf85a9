"""How long a long prompt joining a running batch holds up the others' next token, with and without chunked prefill.

    python -m benchmarks.serving.prefill_stall                  # random Qwen2.5-0.5B + 1.5B shapes, bf16, 1 thread, CPU
    python -m benchmarks.serving.prefill_stall --prompt 512     # quicker

Two answers decode; then a ``--prompt``-token request joins. The stall is the longest gap between the running
answers' tokens while it joins, against their median gap before. With ``--prefill-chunk`` 256 each turn reads
one 256-token chunk of the prompt (both models), then steps the others; with a chunk as long as the prompt the
whole prompt is read in one turn (the behaviour before chunked prefill). Random weights: speed does not depend
on them. Writes benchmarks/results/prefill_stall.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks.synthetic import HashRouter, Letters, random_model, request
from r2r_hf import R2RForCausalLM


def stall(model, prompt_tokens: int, chunk: int, running_tokens: int = 400) -> dict:
    from r2r_hf.model.row_settings import resolve_row
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings

    engine = Engine(model, Letters(), ServeSettings(max_batch_size=4, batch_wait_ms=0, prefill_chunk=chunk,
                                                    capture="off", llm_min_rows=(1,), llm_max_wait=0))
    arrivals: list[float] = []
    joined, finished = threading.Event(), threading.Event()
    vocab = model.shared_vocab_size

    def running(event):  # the first running answer's tokens (the second's arrive in the same steps)
        if event[0] == "text":
            arrivals.append(time.perf_counter())

    def beside(event):
        pass

    def newcomer(event):
        if event[0] == "text" and not joined.is_set():
            joined.set()  # its first token: its prompt has been read
        if event[0] in ("end", "error"):
            finished.set()

    engine.start()
    others = []
    try:
        for seed in (1, 2):
            prompt = torch.randint(100, vocab - 100, (32,), generator=torch.Generator().manual_seed(seed)).tolist()
            others.append(request(prompt, resolve_row(model, prompt, max_new_tokens=running_tokens, do_sample=False,
                                                      threshold=2.0), running if seed == 1 else beside))
            engine.submit(others[-1])
        while len(arrivals) < 16:
            time.sleep(0.01)
        before = [b - a for a, b in zip(arrivals, arrivals[1:])]
        long = torch.randint(100, vocab - 100, (prompt_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
        submitted, mark = time.perf_counter(), len(arrivals)
        engine.submit(request(long, resolve_row(model, long, max_new_tokens=2, do_sample=False, threshold=2.0),
                              newcomer))
        joined.wait(3600)
        read = time.perf_counter() - submitted
        during = [b - a for a, b in zip(arrivals[mark - 1:], arrivals[mark:]) if b >= submitted]
        finished.wait(600)
    finally:
        for other in others:  # the running answers are not needed any more
            engine.cancel(other)
        engine.stop(600)
    return {"prompt_tokens": prompt_tokens, "prefill_chunk": chunk, "median_gap_before_s": statistics.median(before),
            "longest_gap_while_joining_s": max(during), "prompt_read_s": read,
            "tokens_of_the_others_while_joining": len(during)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/prefill_stall.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    slm = random_model("qwen2.5-0.5b", torch.bfloat16, "cpu", seed=0)
    llm = random_model("qwen2.5-1.5b", torch.bfloat16, "cpu", seed=1)
    for m in (slm, llm):
        m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[256] * 3).eval()
    model.router = HashRouter(model.router)
    model.generation_config.eos_token_id = None
    out = {"conditions": {"models": "random Qwen2.5-0.5B + 1.5B shapes", "dtype": "bfloat16", "threads": 1,
                          "device": "cpu", "running answers": 2, "date": time.strftime("%Y-%m-%d")}, "runs": []}
    with torch.inference_mode():
        for chunk in (args.prompt, args.chunk):  # the whole prompt in one turn (as before), then chunked
            out["runs"].append(stall(model, args.prompt, chunk))
            print(json.dumps(out["runs"][-1]), flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
