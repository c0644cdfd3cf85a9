"""How fast R2R runs against its cost model, side by side with plain, compiled and assisted HF generation.

    python -m benchmarks.speed.generate                            # CPU: random Qwen2.5-0.5B + 1.5B, 1 thread, eager
    python -m benchmarks.speed.generate --slm qwen2.5-1.5b --llm qwen2.5-32b --device cuda --cache static \\
        --batch-sizes 1,8 --shares 0,0.05,0.1,0.2 --per-row-from 2 --tokens 128      # the GPU run

Weights are random (no download): speed does not depend on them, only acceptance-based methods
do (HF assisted generation accepts almost nothing between two random models, so its number is a
floor). The routed share p is forced by ``ForcedRouter``, which runs the real paper-sized router
every step (its cost counts) and routes on a fixed schedule: every row at steps where
floor((t + 1) p) > floor(t p), so the LLM's catch-up gap is 1/p; batches from ``--per-row-from``
on route each row independently with probability p, as a real router's rows would.

``--cache static`` runs R2R on the fast path (CUDA graphs on CUDA; ``--compile-mode`` compiles it
with torch.compile instead, which is also how the path runs on a CPU; ``--emulate-graphs`` replays
CPU-emulated CUDA graphs, ``r2r_hf.testing.graphs``, to rehearse the GPU run) and, with a compile
mode or on CUDA, adds HF's own static cache + compile baselines for ``slm.generate`` and
``llm.generate`` (first call reported as warm-up). Per token, R2R should cost t_SLM + t_router + p * t_LLM(g = 1/p); loop efficiency =
that ideal / the measured time, with the component costs of the path that ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers.generation.configuration_utils import CompileConfig

from benchmarks.speed.parts import (
    ForcedRouter,
    captured_components,
    eager_components,
    first_call,
    ideal_per_token,
    llm_call_steps,
    schedule,
    timed,
)
from benchmarks.record import hardware, versions
from benchmarks.synthetic import CONFIGS, random_model
from r2r_hf import R2RForCausalLM

SHARES = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)


def baselines(slm, llm, prompt, gen: dict, static: dict | None, args, batch: int) -> tuple[dict, dict, dict]:
    """ms per token of slm/llm.generate eager (and with HF's static cache + compile), warm-up seconds, notes."""
    ms, warmup, notes = {}, {}, {}
    tokens = args.tokens
    for name, model in (("llm", llm), ("slm", slm)):
        ms[f"{name}_eager"] = 1e3 * timed(lambda m=model: m.generate(prompt, **gen), args.device, args.repeats) / tokens
        if static is not None and (name == "llm" or batch in args.compiled_slm_batches):
            run = lambda m=model: m.generate(prompt, **gen, **static)  # noqa: E731
            warmup[f"{name}_compiled_first_call"] = first_call(run, args.device)
            ms[f"{name}_compiled"] = 1e3 * timed(run, args.device, args.repeats) / tokens
    if batch == 1 and not args.no_assisted:
        if slm.config.vocab_size != llm.config.vocab_size:
            notes["assisted"] = (f"not run: vocabularies differ ({slm.config.vocab_size} vs {llm.config.vocab_size}); "
                                 "HF then needs both tokenizers, which random-weight models do not have")
        else:
            run = lambda: llm.generate(prompt, assistant_model=slm, **gen)  # noqa: E731
            ms["assisted"] = 1e3 * timed(run, args.device, args.repeats) / tokens
    return ms, warmup, notes


@torch.no_grad()
def measure(args: argparse.Namespace) -> dict:
    """Every measurement for each batch size; the JSON is rewritten after each (an interrupted run keeps them)."""
    dtype = getattr(torch, args.dtype)
    slm = random_model(args.slm, dtype, args.device, 0)
    llm = random_model(args.llm, dtype, args.device, 1)
    dims = [int(args.router_dims.split("x")[0])] * int(args.router_dims.split("x")[1])
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=dims)  # 1024x6 = the paper's router
    real_router = model.router.to(dtype=getattr(torch, args.router_dtype))
    fast = args.cache == "static"
    compile_config = CompileConfig(mode=args.compile_mode) if args.compile_mode else None
    r2r_fast = dict(cache_implementation="static", compile_config=compile_config) if fast else None
    if args.emulate_graphs:
        from r2r_hf.testing.graphs import emulated_store

        model.capture_store = emulated_store()
    hf_static = None
    # HF's own compile: its default CompileConfig on CUDA; elsewhere R2R's, which HF honours only when told.
    if fast and (args.device.startswith("cuda") or compile_config is not None):
        hf_static = {"cache_implementation": "static"}
        if compile_config is not None:
            hf_static["compile_config"] = CompileConfig(mode=args.compile_mode)
            hf_static["compile_config"]._compile_all_devices = not args.device.startswith("cuda")
    results = {"conditions": {
        "slm": args.slm, "llm": args.llm, "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
        "new_tokens": args.tokens, "prompt_tokens": args.prompt, "repeats": args.repeats,
        "per_row_from_batch": args.per_row_from, "cache": args.cache or "dynamic",
        "hf_compiled": "generate(cache_implementation='static') with HF's CompileConfig" if fast else None,
        "r2r_path": ("eager" if not fast else f"torch.compile({args.compile_mode})" if compile_config
                     else "CUDA graphs emulated on the CPU" if args.emulate_graphs
                     else "CUDA graphs (captured SLM step, router and LLM catch-up buckets)"),
        "router_params": sum(p.numel() for p in real_router.parameters()),
        "router": f"{args.router_dims} blocks, {args.router_dtype}",
        "hardware": hardware(args.device), **versions(), "weights": "random",
    }, "batches": {}}
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    for batch in args.batch_sizes:
        per_row = args.per_row_from is not None and batch >= args.per_row_from
        prompt = torch.randint(0, 1000, (batch, args.prompt), device=args.device,
                               generator=torch.Generator(device=args.device).manual_seed(batch))
        row: dict = {"per_row": per_row}
        row["baselines_ms"], row["warmup_s"], row["notes"] = baselines(slm, llm, prompt, gen, hf_static, args, batch)
        eager = eager_components(slm, llm, real_router, batch, args.prompt, args.prompt + args.tokens // 2, args.device,
                                 args.repeats)
        forced = ForcedRouter(real_router, batch, args.tokens)
        model.router = forced
        model.capture_store.clear()
        runs = {}
        for share in args.shares:
            decisions = schedule(share, batch, args.tokens, per_row)
            forced.set_schedule(decisions)
            run = {"p": share, "p_llm_call": len(llm_call_steps(decisions)) / args.tokens,
                   "llm_token_share": decisions.float().mean().item()}
            if not fast or (share in args.eager_shares and batch in args.eager_batches):
                run["eager_ms"] = 1e3 * timed(lambda: model.generate(prompt, **gen, threshold=0.5), args.device,
                                              args.repeats) / args.tokens
            if fast:
                call = lambda: model.generate(prompt, **gen, **r2r_fast, threshold=0.5)  # noqa: E731
                if "r2r_first_call" not in row["warmup_s"]:
                    row["warmup_s"]["r2r_first_call"] = first_call(call, args.device)  # captures the SLM step, router
                run["ms_per_step"] = 1e3 * timed(call, args.device, args.repeats) / args.tokens
            else:
                run["ms_per_step"] = run["eager_ms"]
            runs[share] = (run, decisions)
        parts = eager
        if fast:
            state = model.capture_store.state
            parts = captured_components(state, args.prompt + args.tokens // 2, args.repeats, args.device) \
                if state is not None else eager
        row["components_ms"] = {"eager": _ms(eager), **({"captured": _ms(parts)} if parts is not eager else {})}
        row["r2r"] = []
        for share, (run, decisions) in runs.items():
            ideal = ideal_per_token(llm_call_steps(decisions), parts, eager, args.prompt, args.tokens)
            run.update(ideal_ms=1e3 * ideal, loop_efficiency=1e3 * ideal / run["ms_per_step"],
                       tokens_per_s=1e3 * batch / run["ms_per_step"])
            for name, base in row["baselines_ms"].items():
                if name.startswith("llm"):
                    run[f"speedup_vs_{name}"] = base / run["ms_per_step"]
            if "eager_ms" in run:
                run["eager_speedup_vs_llm_eager"] = row["baselines_ms"]["llm_eager"] / run["eager_ms"]
            row["r2r"].append(run)
        model.router = real_router
        results["batches"][str(batch)] = row
        print(json.dumps({"batch": batch, **row}, indent=1, default=str))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


def _ms(parts: dict) -> dict:
    return {k: ({str(g): 1e3 * t for g, t in v.items()} if isinstance(v, dict) else 1e3 * v) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slm", default="qwen2.5-0.5b", choices=sorted(CONFIGS))
    parser.add_argument("--llm", default="qwen2.5-1.5b", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--shares", default=",".join(str(s) for s in SHARES), help="routed shares p")
    parser.add_argument("--per-row-from", type=int, help="batches of this size and up route rows independently")
    parser.add_argument("--cache", choices=("dynamic", "static"), help="static: the fast path + HF-compiled baselines")
    parser.add_argument("--compile-mode", help="run the fast path through torch.compile in this mode (CPU: 'default')")
    parser.add_argument("--emulate-graphs", action="store_true", help="CPU: replay emulated CUDA graphs (a rehearsal)")
    parser.add_argument("--eager-shares", default="0.1", help="with --cache static, also time eager R2R at these p")
    parser.add_argument("--eager-batches", default="1", help="... at these batch sizes")
    parser.add_argument("--compiled-slm-batches", default="1", help="batch sizes that time a compiled slm.generate")
    parser.add_argument("--no-assisted", action="store_true")
    parser.add_argument("--router-dims", default="1024x6", help="block width x blocks (default: the paper's)")
    parser.add_argument("--router-dtype", default="float32", help="router weights' dtype")
    parser.add_argument("--out", default="benchmarks/results/speed.json")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.shares = [float(s) for s in args.shares.split(",")]
    args.eager_shares = [float(s) for s in args.eager_shares.split(",") if s]
    args.compiled_slm_batches = [int(b) for b in args.compiled_slm_batches.split(",") if b]
    args.eager_batches = [int(b) for b in args.eager_batches.split(",") if b]
    torch.set_num_threads(args.threads)
    return measure(args)


if __name__ == "__main__":
    main()
