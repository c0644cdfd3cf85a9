"""Per-token overhead of the R2R loop against plain HF generate, on one CPU thread.

    python -m benchmarks.speed.loop_overhead [--tokens 64] [--repeats 3]

Never-route is compared with ``slm.generate`` (the router runs every step and is
part of the cost); always-route with ``llm.generate`` plus the SLM's own per-token
cost (R2R still runs the SLM and router every step). Target: both ratios <= 1.10.
Models are random-initialised Qwen2 configs (no download); timings are the best of
``--repeats`` runs, measured side by side in one process.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.record import hardware, versions
from r2r_hf import R2RForCausalLM


def random_qwen2(hidden: int, layers: int, vocab: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(hidden // 256, 1), tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).eval()


def best_seconds(runs: dict[str, callable], repeats: int) -> dict[str, float]:
    """Best wall time of each run; runs are interleaved round by round so drift hits all alike."""
    for fn in runs.values():
        fn()  # warm-up
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement; the best is kept")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    slm = random_qwen2(hidden=512, layers=8, vocab=8192, seed=0)
    llm = random_qwen2(hidden=1024, layers=12, vocab=8192, seed=1)
    # The router keeps the paper's size ratio: 56M params next to a 1.5B SLM is ~4%; here ~5%.
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[256, 256])
    prompt = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(0))
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)

    seconds = best_seconds(
        {
            "slm": lambda: slm.generate(prompt, **gen),
            "llm": lambda: llm.generate(prompt, **gen),
            "never": lambda: model.generate(prompt, **gen, threshold=float("inf")),
            "always": lambda: model.generate(prompt, **gen, threshold=0.0),
        },
        args.repeats,
    )
    t_slm, t_llm, t_never, t_always = (seconds[k] / args.tokens for k in ("slm", "llm", "never", "always"))

    result = {
        "conditions": {
            "threads": 1, "tokens": args.tokens, "repeats": args.repeats, "prompt_tokens": 32, "dtype": "float32",
            "slm": "random Qwen2 h512 x8 layers, vocab 8192", "llm": "random Qwen2 h1024 x12 layers, vocab 8192",
            "router_hidden_dims": [256, 256], **versions(), "cpu": hardware(),
        },
        "ms_per_token": {
            "slm.generate": 1e3 * t_slm, "llm.generate": 1e3 * t_llm,
            "r2r never-route": 1e3 * t_never, "r2r always-route": 1e3 * t_always,
        },
        "params": {name: sum(p.numel() for p in m.parameters()) for name, m in (("slm", slm), ("llm", llm), ("router", model.router))},
        "never_route_vs_slm": t_never / t_slm,
        "always_route_vs_llm_plus_slm": t_always / (t_llm + t_slm),
    }
    print(f"{'':28s}{'ms/token':>10s}")
    for name, ms in result["ms_per_token"].items():
        print(f"{name:28s}{ms:10.2f}")
    print(f"never-route / slm.generate            = {result['never_route_vs_slm']:.3f}  (target <= 1.10)")
    print(f"always-route / (llm.generate + t_slm) = {result['always_route_vs_llm_plus_slm']:.3f}  (target <= 1.10)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
