"""Load on `r2r-hf serve` over loopback: tokens/s, latency and time to first token at several concurrencies.

    python -m benchmarks.serve_load                      # the real pair (benchmarks/models.py), CPU, 1 thread
    python -m benchmarks.serve_load --requests 8 --max-tokens 16 --concurrency 1,4   # quicker

Each configuration is a fresh server process (``--threads 1``) on 127.0.0.1; the load generator (the
official openai client, streaming) runs in this process and sends a fixed number of chat requests
at a fixed concurrency, then stops. Configurations: ``batched`` (the router's threshold, batches
of up to 8 answers), ``batch1`` (the same with ``--max-batch-size 1``) and ``llm`` (the LLM writes
every token: the same server at threshold 0, so the SLM's steps still run; that is "serving the LLM
alone in the same server"). Results go to benchmarks/results/serve_load.json, rewritten after each
measurement, and ``--table`` prints the markdown table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai

from benchmarks.models import fetch

ROUTER = "hub_cards/r2r-qwen2.5-coder-0.5b-1.5b"
CONFIGS = {"batched": ["--max-batch-size", "8"], "batch1": ["--max-batch-size", "1"],
           "llm": ["--max-batch-size", "8", "--threshold", "0"]}


def prompts(n: int) -> list[str]:
    """The first ``n`` standard-library prompts (benchmarks/data/stdlib_prompts.jsonl), cycled."""
    lines = Path("benchmarks/data/stdlib_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["messages"][-1]["content"] for line in lines]
    return [texts[i % len(texts)] for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(slm: str, llm: str, flags: list[str], dtype: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    command = [sys.executable, "-m", "r2r_hf.cli", "--quiet", "serve", ROUTER, "--slm", slm, "--llm", llm,
               "--dtype", dtype, "--threads", "1", "--port", str(port), "--model-name", "r2r", *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not start: {process.stderr.read()[-2000:]}")
        time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, tokens, llm = None, 0, 0
    stream = await client.chat.completions.create(
        model="r2r", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens, llm = chunk.usage.completion_tokens, chunk.model_extra["r2r"]["llm_tokens"]
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens, "llm_tokens": llm}


async def load(url: str, texts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Send every prompt, at most ``concurrency`` at a time; returns the run's measurements."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: str) -> dict:
        async with gate:
            return await one(client, prompt, max_tokens)

    start = time.perf_counter()
    async with client:
        done = await asyncio.gather(*(gated(p) for p in texts))
    wall = time.perf_counter() - start
    tokens = sum(d["tokens"] for d in done)
    latency = sorted(d["latency"] for d in done)
    ttft = sorted(d["ttft"] for d in done if d["ttft"] is not None)
    # Time per output token after the first: the decoding rate a user sees once the answer has started.
    tpot = sorted((d["latency"] - d["ttft"]) / (d["tokens"] - 1) for d in done if d["ttft"] is not None and d["tokens"] > 1)
    return {"concurrency": concurrency, "requests": len(done), "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "llm_token_rate": sum(d["llm_tokens"] for d in done) / max(tokens, 1),
            "latency_p50_s": statistics.median(latency), "latency_p95_s": _p95(latency),
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": _p95(ttft),
            "tpot_p50_ms": 1000 * statistics.median(tpot) if tpot else None}


def _p95(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def table(results: dict) -> str:
    rows = ["| server | concurrency | tokens/s | LLM token rate | latency p50 / p95 (s) | TTFT p50 / p95 (s) | "
            "ms per token after the first (p50) |", "|---|---|---|---|---|---|---|"]
    for name, runs in results["runs"].items():
        for r in runs:
            rows.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['llm_token_rate']:.1%} | "
                        f"{r['latency_p50_s']:.1f} / {r['latency_p95_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                        f"{r['ttft_p95_s']:.2f} | {r['tpot_p50_ms']:.0f} |" if r.get("tpot_p50_ms") else
                        f"{r['ttft_p95_s']:.2f} | - |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dtype", default=None, help="default: bfloat16, or float32 on a CPU where bf16 is slow")
    parser.add_argument("--out", default="benchmarks/results/serve_load.json")
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--other-load", default="none", help="what else ran on the machine (recorded in conditions)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return {}
    if args.dtype is None:
        from r2r_hf.model.loading import bf16_is_slow_here

        args.dtype = "float32" if bf16_is_slow_here() else "bfloat16"
    slm, llm = fetch("slm", quiet=True), fetch("llm", quiet=True)
    texts = prompts(args.requests)
    results = {"conditions": {
        "pair": "Qwen2.5-Coder-0.5B-Instruct + 1.5B-Instruct (dequantised Q4_K_M GGUF, benchmarks/models.py)",
        "router": ROUTER, "dtype": args.dtype, "device": "cpu", "server_threads": 1,
        "hardware": f"{platform.machine()}, {os.cpu_count()} vCPUs (the load generator shares them)",
        "cpu_capability": __import__("torch").backends.cpu.get_cpu_capability(),
        "requests_per_run": args.requests, "max_tokens": args.max_tokens, "decoding": "greedy, chat template",
        "prompts": "benchmarks/data/stdlib_prompts.jsonl", "client": "openai AsyncOpenAI, streaming",
        "other_load": args.other_load,
    }, "runs": {}}
    if Path(args.out).exists():  # a later invocation adds its servers' runs (same conditions) to the file
        earlier = json.loads(Path(args.out).read_text())
        if earlier["conditions"] == results["conditions"]:
            results["runs"] = earlier["runs"]
    for name in args.configs.split(","):
        process, url = start(slm, llm, CONFIGS[name], args.dtype)
        try:
            asyncio.run(load(url, texts[:2], 2, 4))  # warm-up, not measured
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                run = asyncio.run(load(url, texts, concurrency, args.max_tokens))
                results["runs"].setdefault(name, [])
                results["runs"][name] = [r for r in results["runs"][name] if r["concurrency"] != concurrency] + [run]
                print(json.dumps({"server": name, **run}), flush=True)
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(results, indent=1))
        finally:
            stop(process)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
