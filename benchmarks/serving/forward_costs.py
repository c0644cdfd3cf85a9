"""What one forward costs on this machine, as the server runs it: a slot read of k rows x g tokens, each model.

    python -m benchmarks.serving.forward_costs    # the real pair (benchmarks/models.py), --dtype auto, 1 torch thread

The server's model calls are reads of ``k`` rows of ``g`` new tokens each, over slots that already hold a
150-token context (``core/layouts/slot_cache.py``): the SLM's step (g = 1), a prompt's prefill, the LLM's catch-up. This
times that call over a grid of (k, g) and the router over k rows, and fits ``t = a + b k + c k g`` per model
(what ``benchmarks/serving/cost_model.py`` replays a served run with). Where a batch-8 step costs nearly 8 batch-1
steps the machine is compute-bound and batching cannot amortise much. Writes
benchmarks/results/forward_costs.json (the grid, the fit and its largest relative error).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from benchmarks.models import ROUTER, fetch
from r2r_hf.core.layouts.slot_cache import SlotCache, read_piece

CONTEXT, ROWS, TOKENS = 150, (1, 2, 4, 8, 16), (1, 4, 16, 64)


def read_costs(model, rows: tuple[int, ...] = ROWS, tokens: tuple[int, ...] = TOKENS, repeats: int = 2) -> dict:
    """Seconds per slot read of k rows x g tokens after a ``CONTEXT``-token context, best of ``repeats``."""
    slots = max(rows)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(100, vocab - 1, (slots, CONTEXT + max(tokens)))
    cache = SlotCache(model.config.num_hidden_layers, slots, CONTEXT + max(tokens))
    with torch.inference_mode():
        for r in range(slots):  # the context, one row at a time (a read of 16 x 150 tokens would be one huge piece)
            read_piece(model, cache, ids, [r], [0], [CONTEXT])
        out = {}
        for k in rows:
            for g in tokens:
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    read_piece(model, cache, ids, list(range(k)), [CONTEXT] * k, [g] * k)  # the same columns each time
                    best = min(best, time.perf_counter() - start)
                out[f"{k}x{g}"] = best
    return out


def router_costs(model, rows: tuple[int, ...] = ROWS, repeats: int = 3) -> dict:
    """Seconds per router call (the shipped router's shape) on k rows, best of ``repeats``."""
    from r2r_hf.core.layouts.model_calls import route_scores

    slm, router, k_logits = model.slm, model.router, model.config.num_topk_logits
    out = {}
    with torch.inference_mode():
        for k in rows:
            logits = torch.randn(k, slm.get_output_embeddings().weight.shape[0], dtype=slm.dtype)
            hidden = torch.randn(k, slm.config.hidden_size, dtype=slm.dtype)
            token = torch.zeros(k, dtype=torch.long)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                route_scores(slm, router, k_logits, logits, hidden, token)
                best = min(best, time.perf_counter() - start)
            out[str(k)] = best
    return out


def fit(grid: dict[str, float]) -> dict[str, float]:
    """Least squares ``t = a + b k + c k g`` over a grid keyed "kxg"; with its largest relative error."""
    points = [(int(key.split("x")[0]), int(key.split("x")[1]), t) for key, t in grid.items()]
    design = torch.tensor([[1.0, k, k * g] for k, g, _ in points], dtype=torch.float64)
    times = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(design, times[:, None]).solution[:, 0]
    predicted = design @ coef
    error = float(((predicted - times).abs() / times).max())
    return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "max_relative_error": error}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto (the CLI's measured choice), bfloat16 or float32")
    parser.add_argument("--out", default="benchmarks/results/forward_costs.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from r2r_hf import R2RForCausalLM
    from r2r_hf.model.loading import cpu_dtype_choice

    dtype = cpu_dtype_choice().dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    out = {"conditions": {"dtype": str(dtype).replace("torch.", ""), "threads": 1, "context": CONTEXT,
                          "machine": platform.machine(), "processor": platform.processor() or "unknown",
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "date": time.strftime("%Y-%m-%d")},
           "reads": {}, "fits": {}}
    for role in ("slm", "llm"):
        model = AutoModelForCausalLM.from_pretrained(fetch(role, quiet=True), dtype=dtype).eval()
        grid = read_costs(model)
        out["reads"][role], out["fits"][role] = grid, fit(grid)
        print(role, {k: round(v * 1000, 1) for k, v in grid.items()}, out["fits"][role], flush=True)
        del model
    pair = R2RForCausalLM.from_pretrained(ROUTER, dtype=dtype)
    out["router"] = router_costs(pair)
    print("router", out["router"], flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
