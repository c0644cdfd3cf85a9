"""How fast R2R runs against its cost model, side by side with plain and assisted HF generation.

    python -m benchmarks.speed                                   # CPU: random Qwen2.5-0.5B + 1.5B, 1 thread
    python -m benchmarks.speed --slm qwen2.5-1.5b --llm qwen2.5-32b --device cuda --batch-sizes 1,4,8

Weights are random (no download): speed does not depend on them, only acceptance-based methods
do (HF assisted generation accepts almost nothing between two random models, so its number is a
floor, reported with its acceptance rate). The routed share p is forced by ``ForcedRouter``,
which runs the real paper-sized router every step (its cost counts) and then routes on a fixed
schedule: every row at steps where floor((t + 1) p) > floor(t p), so the LLM's catch-up gap is 1/p.
``--per-row`` instead routes each row independently with probability p, as a real router would
in a batch, so the LLM runs whenever any row routes.

Per token, R2R should cost t_SLM + t_router + p * t_LLM(g = 1/p) (one LLM forward over the g tokens
since its last call). Loop efficiency = that ideal / the measured time.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import DynamicCache

from r2r_hf import R2RForCausalLM
from r2r_hf.router import Router

CONFIGS = {  # published Qwen2.5 shapes (https://huggingface.co/Qwen, config.json of each size)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    # for the smoke test only
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}
SHARES = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)


class ForcedRouter(Router):
    """Runs a real router (so its cost is paid) and then routes on a fixed schedule with share ``p``."""

    def __init__(self, inner: Router, share: float, per_row: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.inner, self.share, self.per_row, self.seed = inner, share, per_row, seed
        self.reset()

    def reset(self) -> None:
        self.step = 0
        self.generator = torch.Generator().manual_seed(self.seed)

    def scores(self, topk_logits, token_embedding, hidden):
        real = self.inner.scores(topk_logits, token_embedding, hidden)
        draw = forced_rows(self.step, real.shape[0], self.share, self.per_row, self.generator).to(real.device)
        self.step += 1
        return draw.float() + 0 * real  # keeps the dependency on the real scores


def forced_rows(step: int, rows: int, share: float, per_row: bool, generator: torch.Generator) -> torch.Tensor:
    """Which rows ``ForcedRouter`` routes at ``step`` (the cost model replays the same draws)."""
    if per_row:
        return torch.rand(rows, generator=generator) < share
    due = math.floor((step + 1) * share) > math.floor(step * share)
    return torch.full((rows,), due, dtype=torch.bool)


def random_model(name: str, dtype: torch.dtype, device: str, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    with torch.device(device):  # built in ``dtype`` on the device: a 32B in fp32 would not fit beside itself
        model = Qwen2ForCausalLM._from_config(Qwen2Config(**CONFIGS[name], max_position_embeddings=4096), dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int, reset=None) -> float:
    """Best wall time of ``repeats`` runs after one warm-up; ``reset`` runs untimed after each run."""
    best = math.inf
    for run in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if run:
            best = min(best, time.perf_counter() - start)
        if reset is not None:
            reset()
    return best


@torch.no_grad()
def components(slm, llm, router, batch: int, prompt: int, context: int, device: str, repeats: int) -> dict:
    """t_SLM (one-token step), t_router, the SLM's prompt prefill, and t_LLM(g) for catch-up chunks of g tokens.

    Steps and chunks run at ``context`` tokens of cache (mid-generation); prefills from an empty cache.
    Seconds.
    """
    ids = torch.randint(0, 1000, (batch, context + 64), device=device)

    def forward_after(model, past: int, new: int, runs: int = repeats) -> float:
        if not past:  # a fresh cache per run, made outside the timed forward
            caches = [DynamicCache(config=model.config) for _ in range(runs + 1)]
            return timed(lambda: model(ids[:, :new], past_key_values=caches.pop(), logits_to_keep=1), device, runs)
        cache = DynamicCache(config=model.config)
        model(ids[:, :past], past_key_values=cache, logits_to_keep=1)
        return timed(lambda: model(ids[:, past : past + new], past_key_values=cache, logits_to_keep=1),
                     device, runs, reset=lambda: cache.crop(-new))  # back to ``past`` tokens, untimed

    hidden = slm.config.hidden_size
    features = (torch.randn(batch, 100, device=device), torch.randn(batch, hidden, device=device),
                torch.randn(batch, hidden, device=device))
    out = {"t_slm": forward_after(slm, context, 1, repeats * 5), "t_router": timed(lambda: router.scores(*features), device, repeats * 5)}
    out["t_slm_prompt"] = forward_after(slm, 0, prompt)  # the SLM's own prefill, paid once per call
    out["t_llm"] = {g: forward_after(llm, context, g, repeats * 3) for g in (1, 2, 5, 10, 20, 64)}
    out["t_llm"][prompt] = forward_after(llm, 0, prompt)  # the first catch-up reads the prompt too
    return out


def t_llm_at(chunk: float, table: dict[int, float]) -> float:
    """Catch-up cost of a chunk of ``chunk`` tokens: linear between measured sizes, extrapolated above."""
    sizes = sorted(table)
    if chunk <= sizes[0]:
        return table[sizes[0]]
    for low, high in zip(sizes, sizes[1:]):
        if chunk <= high:
            return table[low] + (table[high] - table[low]) * (chunk - low) / (high - low)
    low, high = sizes[-2], sizes[-1]
    return table[high] + (table[high] - table[low]) * (chunk - high) / (high - low)


def llm_call_steps(share: float, batch: int, per_row: bool, tokens: int, seed: int = 0) -> list[int]:
    """The steps at which ``ForcedRouter`` routes some row (its draws replayed from the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    return [step for step in range(tokens) if forced_rows(step, batch, share, per_row, generator).any()]


def ideal_per_token(calls: list[int], parts: dict, prompt: int, tokens: int) -> float:
    """The cost model per generated token: t_SLM + t_router, plus the LLM's catch-up forwards.

    The SLM's prompt prefill is spread over the generated tokens, as it is in ``slm.generate``.
    At each step in ``calls`` the LLM reads every token since its previous call (the first call
    also reads the prompt), at the measured t_LLM(g).
    """
    seen, total = 0, 0.0
    for step in calls:
        total += t_llm_at(prompt + step - seen, parts["t_llm"])
        seen = prompt + step
    return parts["t_slm"] + parts["t_router"] + parts["t_slm_prompt"] / tokens + total / tokens


@torch.no_grad()
def measure(args: argparse.Namespace) -> dict:
    """Every measurement for each batch size; the JSON is rewritten after each (an interrupted run keeps them)."""
    dtype = getattr(torch, args.dtype)
    slm = random_model(args.slm, dtype, args.device, 0)
    llm = random_model(args.llm, dtype, args.device, 1)
    dims = [int(args.router_dims.split("x")[0])] * int(args.router_dims.split("x")[1])
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=dims)  # 1024x6 = the paper's router
    real_router = model.router.to(dtype=getattr(torch, args.router_dtype))
    results = {"conditions": {
        "slm": args.slm, "llm": args.llm, "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
        "new_tokens": args.tokens, "prompt_tokens": args.prompt, "repeats": args.repeats, "per_row": args.per_row,
        "cache": args.cache or "dynamic", "router_params": sum(p.numel() for p in real_router.parameters()),
        "router": f"{args.router_dims} blocks, {args.router_dtype}",
        "hardware": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__, "weights": "random",
    }, "batches": {}}
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    if args.cache:
        gen["cache_implementation"] = args.cache
    for batch in args.batch_sizes:
        prompt = torch.randint(0, 1000, (batch, args.prompt), device=args.device,
                               generator=torch.Generator(device=args.device).manual_seed(batch))
        parts = components(slm, llm, real_router, batch, args.prompt, args.prompt + args.tokens // 2, args.device, args.repeats)
        row = {"components_ms": {"t_slm": 1e3 * parts["t_slm"], "t_router": 1e3 * parts["t_router"],
                                 "t_slm_prompt": 1e3 * parts["t_slm_prompt"],
                                 "t_llm": {str(g): 1e3 * t for g, t in parts["t_llm"].items()}}}
        t_slm_gen = timed(lambda: slm.generate(prompt, **gen), args.device, args.repeats) / args.tokens
        t_llm_gen = timed(lambda: llm.generate(prompt, **gen), args.device, args.repeats) / args.tokens
        row["slm_generate_ms"], row["llm_generate_ms"] = 1e3 * t_slm_gen, 1e3 * t_llm_gen
        if batch == 1 and not args.no_assisted:
            assisted = {}
            t_assist = timed(lambda: assisted.update(out=llm.generate(prompt, assistant_model=slm, **gen)),
                             args.device, args.repeats) / args.tokens
            row["assisted_ms"] = 1e3 * t_assist
            row["assisted_speedup"] = t_llm_gen / t_assist
        row["r2r"] = []
        for share in SHARES:
            model.router = ForcedRouter(real_router, share, per_row=args.per_row)
            measured = timed(lambda: model.generate(prompt, **gen, threshold=0.5), args.device, args.repeats) / args.tokens
            calls = llm_call_steps(share, batch, args.per_row, args.tokens)
            ideal = ideal_per_token(calls, parts, args.prompt, args.tokens)
            row["r2r"].append({
                "p": share, "ms_per_step": 1e3 * measured, "tokens_per_s": batch / measured,
                "speedup_vs_llm": t_llm_gen / measured, "ideal_ms": 1e3 * ideal, "loop_efficiency": ideal / measured,
                # per row: the realised share of steps with an LLM call (it averages 1 - (1 - p)^B)
                "p_llm_call": len(calls) / args.tokens if args.per_row else share,
            })
        row["never_route_vs_slm_generate"] = row["r2r"][0]["ms_per_step"] / row["slm_generate_ms"]
        row["always_route_vs_llm_plus_slm"] = row["r2r"][-1]["ms_per_step"] / (row["llm_generate_ms"] + row["slm_generate_ms"])
        results["batches"][str(batch)] = row
        print_batch(batch, row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    model.router = real_router
    return results


def print_batch(batch: int, row: dict) -> None:
    c = row["components_ms"]
    print(f"\nbatch {batch}: t_SLM {c['t_slm']:.2f} ms, t_router {c['t_router']:.2f} ms, "
          f"t_LLM(1) {c['t_llm']['1']:.2f} ms, t_LLM(10) {c['t_llm']['10']:.2f} ms; "
          f"slm.generate {row['slm_generate_ms']:.2f} ms/token, llm.generate {row['llm_generate_ms']:.2f} ms/token"
          + (f", assisted {row['assisted_ms']:.2f} ms/token" if "assisted_ms" in row else ""))
    print(f"{'p':>6} {'ms/step':>9} {'tokens/s':>9} {'vs LLM':>7} {'ideal ms':>9} {'efficiency':>10}")
    for r in row["r2r"]:
        print(f"{r['p']:6.2f} {r['ms_per_step']:9.2f} {r['tokens_per_s']:9.2f} {r['speedup_vs_llm']:6.2f}x "
              f"{r['ideal_ms']:9.2f} {r['loop_efficiency']:10.3f}")
    print(f"never-route / slm.generate = {row['never_route_vs_slm_generate']:.3f}; "
          f"always-route / (llm.generate + slm.generate) = {row['always_route_vs_llm_plus_slm']:.3f}")


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
    parser.add_argument("--per-row", action="store_true", help="route rows independently (Bernoulli p)")
    parser.add_argument("--cache", choices=("dynamic", "static"), help="cache_implementation for every run")
    parser.add_argument("--no-assisted", action="store_true")
    parser.add_argument("--router-dims", default="1024x6", help="block width x blocks (default: the paper's)")
    parser.add_argument("--router-dtype", default="float32", help="router weights' dtype")
    parser.add_argument("--out", default="benchmarks/results/speed.json")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    return measure(args)


if __name__ == "__main__":
    main()
