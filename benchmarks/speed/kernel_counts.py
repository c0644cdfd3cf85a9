"""Kernels one captured step launches, before and after fusing (issue 32), as the GPU review counted them.

    python -m benchmarks.speed.kernel_counts            # 1.5B and 32B shapes, bf16

A CUDA graph replays every kernel its capture launched; on a GPU each dependent tiny kernel costs ~1.5-2.5 us
even inside a graph (issue 32), so the count bounds a captured step from below. Four captured reads:

* HF's forward (what ``--unfused-graphs`` captures): ``generate``'s read over HF's static cache
  (``core/capture.read_fn``) and the server's over slots (``core/slots.forward_piece``). Counted with a
  ``TorchDispatchMode`` over one forward (views and metadata-only ops excluded: they launch nothing), on the
  meta device, so a 32B costs nothing to build.
* the fused reads (``core/fused_reads``: ``static_read``, ``slot_read``). The ops outside the compiled regions
  are counted the same way; each region's kernels are read from the code inductor generated for it (its
  wrapper's ``call``: fused kernels, extern GEMMs, aten fallbacks such as attention), compiled on this CPU
  (the C++ backend; Triton's groups on a GPU are the same kind of fusion, the count is a proxy) from a model
  of the same shapes with 2 decoder layers (one compiled layer serves all), then scaled to the real depth:
  total = outside + prologue + layers x layer + head. Cold compile times (no inductor cache) are measured
  too: the first shape's, and the recompile a second shape (an 8-token catch-up) costs.

Writes benchmarks/results/kernel_counts.json (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.record import versions
from benchmarks.synthetic import random_model
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import _disable_current_modes
from transformers.cache_utils import StaticCache

from r2r_hf.core.fast import fused_reads
from r2r_hf.core.fast.static_reads import read_fn, static_cache
from r2r_hf.core.layouts.slot_cache import SlotCache, forward_piece, piece_inputs

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


# A launch in inductor's wrapper code: a fused kernel (C++ or Triton), an extern GEMM or an aten fallback.
LAUNCH = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|(?:torch\.ops\.)?aten\.[\w.]+)\(",
                    re.M)


def launches(wrapper: str) -> collections.Counter:
    """The kernels one call of a compiled graph launches, by kind, from its wrapper code's ``call``."""
    start = wrapper.index("def call(")
    body = wrapper[start : re.compile(r"\n\s+return ").search(wrapper, start).start()]
    kinds = collections.Counter()
    for name in LAUNCH.findall(body):
        kinds["fused" if name.startswith(("cpp_fused", "triton_")) else
              "gemm" if name.startswith("extern_kernels") else name.split("(")[0]] += 1
    return kinds


class RegionLaunches:
    """``fused_reads.region_runner`` for counting: each region's first call compiles it (timed, its code kept);
    every call runs outside the counting mode and is tallied by region."""

    def __init__(self) -> None:
        self.kernels: dict[str, collections.Counter] = {}
        self.compile_s: dict[str, float] = {}
        self.calls: collections.Counter[str] = collections.Counter()

    def __call__(self, fn, args: tuple):
        name = fn.__name__
        with _disable_current_modes():
            if name not in self.kernels:
                start = time.perf_counter()
                out, code = run_and_get_code(fn, *args)
                self.compile_s[name] = time.perf_counter() - start
                self.kernels[name] = sum((launches(c) for c in code), collections.Counter())
            else:
                out = fn(*args)
        self.calls[name] += 1
        return out


def fused_read(name: str, rows: int, tokens: int, context: int, hidden: bool, server: bool) -> dict:
    """Kernels of one fused read of ``name``'s shapes: outside the regions, per region, in all; compile times."""
    depth = random_model(name, torch.bfloat16, "meta", seed=0).config.num_hidden_layers
    model = random_model(name, torch.bfloat16, "cpu", seed=0, layers=2)
    regions, runner, capacity = fused_reads.Regions(compile=True), RegionLaunches(), context + 64
    if server:
        cache = SlotCache(model.config.num_hidden_layers, rows, capacity)
        read = fused_reads.slot_read(model, cache, hidden, regions)
        buffer = torch.zeros(rows, capacity, dtype=torch.long)

        def inputs(width):
            return piece_inputs(buffer, list(range(rows)), [context] * rows, [width] * rows, width, cache.trash)
    else:
        cache = static_cache(model, rows, capacity)
        read = fused_reads.static_read(model, cache, hidden, capacity, regions)

        def inputs(width):
            return {"ids": torch.zeros(rows, width, dtype=torch.long),
                    "positions": torch.arange(width).expand(rows, width) + context,
                    "mask": torch.ones(rows, capacity, dtype=torch.long), "last": torch.tensor([width - 1]),
                    "rewind": torch.tensor(width)}
    previous, fused_reads.region_runner = fused_reads.region_runner, runner
    try:  # cold compiles (no inductor cache): the times are what a first start costs
        with torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False):
            one = inputs(1)  # made before counting: the loop makes them for itself
            with Kernels() as outside:
                read(**one)
            first = dict(runner.compile_s)
            runner.kernels.clear()
            read(**inputs(8))  # a second shape: the regions recompile once, with dynamic sizes
    finally:
        fused_reads.region_runner = previous
    per_region = {region: sum(kinds.values()) for region, kinds in runner.kernels.items()}
    kind = "slot" if server else "static"
    layer = f"{kind}_layer"
    regions_total = per_region[f"{kind}_prologue"] + depth * per_region[layer] + per_region["head"]
    outside_total = sum(outside.counts.values())
    return {"kernels": outside_total + regions_total, "outside": outside_total, "outside_top": outside.counts.most_common(8),
            "per_region": per_region, "layer_kinds": dict(runner.kernels[layer]), "layers": depth,
            "compile_s": {"first_shape": {k: round(v, 1) for k, v in first.items()},
                          "second_shape": {k: round(v, 1) for k, v in runner.compile_s.items()}}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kernel_counts.json")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--models", default="qwen2.5-1.5b:slm,qwen2.5-32b:llm", help="NAME:ROLE,... (speed_parts)")
    args = parser.parse_args(argv)
    out = {"conditions": {"dtype": "bfloat16", **versions(),
                          "context": args.context, "rows": 1, "tokens": 1, "date": time.strftime("%Y-%m-%d"),
                          "threads": torch.get_num_threads(),
                          "hf": "aten ops of one forward under a TorchDispatchMode, views excluded (meta device)",
                          "fused": "aten ops outside the regions (the same mode) + each region's launches in "
                                   "inductor's wrapper code (CPU, C++ backend), x the layers"}, "counts": {}}
    for name, role in (pair.split(":") for pair in args.models.split(",")):
        model = random_model(name, torch.bfloat16, "meta", seed=0)
        model.config._attn_implementation = "sdpa"
        hidden = role == "slm"
        for label, fn, server in (("generate", generate_read, False), ("server", slot_read, True)):
            counts = fn(model, 1, 1, args.context, hidden)
            hf = {"kernels": sum(counts.values()), "top": counts.most_common(12)}
            fused = fused_read(name, 1, 1, args.context, hidden, server)
            out["counts"][f"{name} one-token step, {label}"] = {"hf": hf, "fused": fused}
            print(f"{name} {label}: HF {hf['kernels']}, fused {fused['kernels']} (outside {fused['outside']}, "
                  f"regions {fused['per_region']}, compile {fused['compile_s']})", flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))  # after every number
    return out


if __name__ == "__main__":
    main()
