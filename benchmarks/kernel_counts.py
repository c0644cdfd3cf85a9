"""Kernels one captured step launches: aten ops of one forward, counted as the GPU review counted them.

    python -m benchmarks.kernel_counts            # 1.5B and 32B shapes, bf16, on the meta device (no memory)

A CUDA graph replays every kernel its capture launched; on a GPU each dependent tiny kernel costs ~1.5-2.5 us
even inside a graph (issue 32), so the count bounds a captured step from below. Counted with a
``TorchDispatchMode`` over one forward (views and metadata-only ops excluded: they launch nothing), on the
meta device, so a 32B costs nothing to build. Two captured reads are counted:

* ``generate``'s (``core/capture.read_fn``): HF's static cache, a 2-D mask HF turns into a 4-D one;
* the server's (``core/slots.forward_piece``): slots, one prepared 4-D mask for every layer.

Both replay HF's unfused eager forward (norms, rotary, casts, the KV write): fusing it is issue 32's second half.
Writes benchmarks/results/kernel_counts.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.speed_parts import random_model
from transformers.cache_utils import StaticCache

from r2r_hf.core.capture import read_fn
from r2r_hf.core.slots import SlotCache, forward_piece, piece_inputs

# Ops that only reshape or alias memory: no kernel runs for them.
FREE = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "slice",
        "select", "alias", "as_strided", "detach", "split", "split_with_sizes", "chunk", "unbind", "lift_fresh",
        "_reshape_alias", "view_as", "expand_as", "contiguous", "sym_size", "sym_stride", "sym_numel", "numel",
        "dim", "size", "stride", "is_contiguous", "empty", "empty_like", "empty_strided", "new_empty", "unflatten",
        "flatten", "movedim", "narrow", "diagonal", "_to_copy_noop", "to", "type_as", "clone_noop"}


class Kernels(TorchDispatchMode):
    """Counts the aten ops that launch work, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in FREE:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count(fn, *args, **kwargs) -> collections.Counter:
    with torch.inference_mode(), Kernels() as kernels:
        fn(*args, **kwargs)
    return kernels.counts


def generate_read(model, rows: int, tokens: int, context: int, hidden: bool) -> collections.Counter:
    """``generate``'s captured read of ``tokens`` new tokens per row after ``context`` (the HF static cache)."""
    cache = StaticCache(config=model.config, max_cache_len=context + 64)
    cache.early_initialization(rows, *model._get_static_cache_init_shape(), dtype=model.dtype, device="meta")
    step = read_fn(model, cache, hidden)
    ids = torch.zeros(rows, tokens, dtype=torch.long, device="meta")
    positions = torch.arange(tokens, device="meta").expand(rows, tokens) + context
    mask = torch.ones(rows, context + 64, dtype=torch.long, device="meta")
    last = torch.tensor([tokens - 1], device="meta")
    return count(step, ids, positions, mask, last, torch.tensor(0, device="meta"))


def slot_read(model, rows: int, tokens: int, context: int, hidden: bool) -> collections.Counter:
    """The server's captured read: ``rows`` slots, ``tokens`` new tokens each, over a static slot cache."""
    cache = SlotCache(model.config.num_hidden_layers, rows, context + 64)
    buffer = torch.zeros(rows, context + 64, dtype=torch.long, device="meta")
    inputs = piece_inputs(buffer, list(range(rows)), [context] * rows, [tokens] * rows, tokens, cache.trash)
    cache.plan(list(range(rows)), inputs["column"], cache.capacity)
    forward_piece(model, cache, **inputs, used=cache.capacity, hidden=hidden)  # allocates the buffers (uncounted)
    cache.plan(list(range(rows)), inputs["column"], cache.capacity)
    return count(forward_piece, model, cache, **inputs, used=cache.capacity, hidden=hidden)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kernel_counts.json")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)
    out = {"conditions": {"dtype": "bfloat16", "device": "meta", "transformers": transformers.__version__,
                          "torch": torch.__version__, "context": args.context, "date": time.strftime("%Y-%m-%d"),
                          "method": "aten ops of one forward under a TorchDispatchMode, views excluded"}, "counts": {}}
    for name, role in (("qwen2.5-1.5b", "slm"), ("qwen2.5-32b", "llm")):
        model = random_model(name, torch.bfloat16, "meta", seed=0)
        model.config._attn_implementation = "sdpa"
        hidden = role == "slm"
        for label, fn in (("generate (HF static cache)", generate_read), ("server (slots)", slot_read)):
            counts = fn(model, 1, 1, args.context, hidden)
            out["counts"][f"{name} one-token step, {label}"] = {"kernels": sum(counts.values()),
                                                                "top": counts.most_common(12)}
            print(name, label, sum(counts.values()), counts.most_common(8), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
