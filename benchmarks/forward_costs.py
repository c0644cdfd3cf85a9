"""What one forward costs on this machine: a decode step and an 8-token read, batch 1 and 8, for each model.

    python -m benchmarks.forward_costs        # the real pair (benchmarks/models.py), float32, 1 torch thread

It explains the server's batching numbers (docs/performance.md, "Serving under load"): where a batch-8 step
costs nearly 8 batch-1 steps, the machine is compute-bound and batching cannot amortise much. Each timing
follows a 150-token prefill; the decode step is the mean of 5. Writes benchmarks/results/forward_costs.json.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from benchmarks.models import fetch

STEPS, PREFILL, READ = 5, 150, 8


def costs(model, batch: int) -> dict[str, float]:
    ids = torch.randint(100, 1000, (batch, PREFILL + STEPS + READ))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :PREFILL], past_key_values=cache, use_cache=True)
        start = time.perf_counter()
        for i in range(STEPS):
            model(input_ids=ids[:, PREFILL + i : PREFILL + i + 1], past_key_values=cache, use_cache=True)
        step = (time.perf_counter() - start) / STEPS
        cache.crop(-STEPS)
        start = time.perf_counter()
        model(input_ids=ids[:, PREFILL : PREFILL + READ], past_key_values=cache, use_cache=True)
        read = time.perf_counter() - start
    return {"decode_step_ms": round(step * 1000, 1), f"read_{READ}_tokens_ms": round(read * 1000, 1)}


def main() -> None:
    torch.set_num_threads(1)
    out = {"conditions": {"dtype": "float32", "threads": 1, "prefill": PREFILL, "machine": platform.machine(),
                          "cpu_capability": torch.backends.cpu.get_cpu_capability()}, "costs": {}}
    for role in ("slm", "llm"):
        model = AutoModelForCausalLM.from_pretrained(fetch(role, quiet=True), dtype=torch.float32).eval()
        for batch in (1, 8):
            out["costs"][f"{role} batch {batch}"] = costs(model, batch)
            print(role, batch, out["costs"][f"{role} batch {batch}"], flush=True)
        del model
    Path("benchmarks/results/forward_costs.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
