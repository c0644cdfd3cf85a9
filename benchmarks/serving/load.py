"""Load on `r2r-hf serve` over loopback: tokens/s, latencies and the decoding counters at several concurrencies.

    python -m benchmarks.serving.load                      # the real pair (benchmarks/models.py), CPU, 1 thread
    python -m benchmarks.serving.load --requests 8 --max-tokens 16 --concurrency 1,4   # quicker

Each (configuration, concurrency) is a fresh server process (``--threads 1``, up to 16 answers in its batch) on
127.0.0.1; the load generator (the official openai client, streaming) runs in this process and sends a fixed
number of chat requests at a fixed concurrency, then stops. Configurations, all at the shipped router's
threshold unless said: ``wait`` (routed answers wait for a shared LLM forward: m = running answers / 3, at
most 16 steps, the GPU default), ``m1`` (the LLM runs in the step an answer routes: the CPU default), ``llm``
(threshold 0: the LLM writes every token, the SLM's steps still run: the LLM alone in the same server),
``slm`` (threshold 2: no token routes), ``spec`` (speculative routing, ``--speculate 8``), ``spec-below``
(``--speculate 4 --speculate-below 0.95``: the recommended depth, rows the router is surest of waiting) and
``spec-llm`` (threshold 0 with speculation: the LLM's own answers, the SLM drafting). Per run: tokens/s, time to first token, inter-token latency (the gaps
between an answer's stream chunks), and the counters of ``/metrics`` (model forwards per token, rows per LLM
forward, steps a routed answer waited). Each server writes a trace (``R2R_SERVE_TRACE``) that
``benchmarks/serving/cost_model.py`` replays with forward costs. Results go to benchmarks/results/serve_load.json,
rewritten after each run; ``--table`` prints the markdown table of benchmarks/results/serving_cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import openai

from benchmarks.models import ROUTER, fetch
from r2r_hf.testing import server

WAIT = ",".join(str(max(1, round(rows / 3))) for rows in range(1, 17))  # core/policy.py's GPU default
CONFIGS = {"wait": ["--llm-min-rows", WAIT, "--llm-max-wait", "16"], "m1": ["--llm-min-rows", "1", "--llm-max-wait", "0"],
           "llm": ["--threshold", "0", "--llm-min-rows", "1", "--llm-max-wait", "0"],
           "slm": ["--threshold", "2", "--llm-min-rows", "1", "--llm-max-wait", "0"],
           # speculative routing (issue 43): routed answers go on with the SLM's token, 8 pending at most, the LLM
           # resolving with core/policy.speculative_policy's defaults; "spec-llm": threshold 0, the LLM's own answers
           "spec": ["--speculate", "8"], "spec-llm": ["--threshold", "0", "--speculate", "8"],
           # the recommended depth, and rows the router is surest of waiting (the LLM disagrees there far more)
           "spec-below": ["--speculate", "4", "--speculate-below", "0.95"]}


def prompts(n: int) -> list[str]:
    """The first ``n`` standard-library prompts (benchmarks/data/stdlib_prompts.jsonl), cycled."""
    lines = Path("benchmarks/data/stdlib_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["messages"][-1]["content"] for line in lines]
    return [texts[i % len(texts)] for i in range(n)]


def start(slm: str, llm: str, flags: list[str], dtype: str, trace: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A fresh server of the pair with one configuration's ``flags``, tracing to ``trace``; (process, url) once it
    answers (loading the real pair on a CPU takes minutes)."""
    return server.start(ROUTER, "--slm", slm, "--llm", llm, "--dtype", dtype, "--threads", "1", "--model-name", "r2r",
                        "--max-batch-size", "16", *flags, env={"R2R_SERVE_TRACE": str(trace)} if trace else None,
                        timeout=600)


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, tokens, llm, arrivals = None, 0, 0, []
    stream = await client.chat.completions.create(
        model="r2r", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
            if first is None:
                first = arrivals[-1] - start
        if chunk.usage is not None:
            tokens, llm = chunk.usage.completion_tokens, chunk.model_extra["r2r"]["llm_tokens"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens, "llm_tokens": llm, "gaps": gaps}


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
    gaps = sorted(g for d in done for g in d["gaps"])  # inter-token latency: between an answer's stream chunks
    return {"concurrency": concurrency, "requests": len(done), "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "llm_token_rate": sum(d["llm_tokens"] for d in done) / max(tokens, 1),
            "latency_p50_s": statistics.median(latency), "latency_p95_s": _p95(latency),
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": _p95(ttft),
            "tpot_p50_ms": 1000 * statistics.median(tpot) if tpot else None,
            "itl_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
            "itl_p95_ms": 1000 * _p95(gaps) if gaps else None}


def counters(url: str) -> dict[str, float]:
    """The server's decoding counters (``/metrics``), by name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if not sample.labels or set(sample.labels) == {"le"}:
                out[sample.name + (f"[{sample.labels['le']}]" if sample.labels else "")] = sample.value
    return out


def per_run(before: dict, after: dict) -> dict:
    """The run's counters (the warm-up's subtracted) as the ratios benchmarks/results/serving_cpu.md reports."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    tokens = d.get("r2r_generated_tokens_total", 0) or 1
    calls = d.get("r2r_llm_calls_total", 0)
    waits = d.get("r2r_llm_wait_steps_count", 0)
    buckets = sorted(((float(k.split("[")[1][:-1]), v) for k, v in d.items() if k.startswith("r2r_llm_wait_steps_bucket")))

    def wait_quantile(q: float) -> float | None:  # the smallest bucket bound holding q of the waits
        return next((bound for bound, count in buckets if count >= q * waits), None) if waits else None

    return {"llm_forwards_per_token": d.get("r2r_llm_forwards_total", 0) / tokens,
            "llm_calls_per_token": calls / tokens, "slm_forwards_per_token": d.get("r2r_slm_forwards_total", 0) / tokens,
            "rows_per_llm_call": d.get("r2r_llm_call_rows_total", 0) / calls if calls else None,
            "wait_steps_p50_at_most": wait_quantile(0.5), "wait_steps_p95_at_most": wait_quantile(0.95),
            "host_syncs_per_step": d.get("r2r_host_syncs_total", 0) / max(d.get("r2r_steps_total", 0), 1),
            "join_kv_bytes_per_join": d.get("r2r_join_kv_bytes_total", 0) / max(d.get("r2r_joins_total", 0), 1),
            "thrown_per_token": d.get("r2r_speculative_thrown_tokens_total", 0) / tokens,
            "agreement_at_routed": (d.get("r2r_speculative_agreed_total", 0) / resolved) if (resolved := d.get(
                "r2r_speculative_agreed_total", 0) + d.get("r2r_speculative_rejected_total", 0)) else None}


def _p95(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def table(results: dict) -> str:
    rows = ["| server | concurrency | tokens/s | LLM token rate | TTFT p50 / p95 (s) | inter-token p50 / p95 (ms) | "
            "LLM forwards / token | rows / LLM forward | wait steps p50 / p95 (at most) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results["runs"].items():
        for r in sorted(runs, key=lambda r: r["concurrency"]):
            c = r.get("counters", {})
            rows_per = "-" if c.get("rows_per_llm_call") is None else f"{c['rows_per_llm_call']:.2f}"
            rows.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.2f} | {r['llm_token_rate']:.1%} | "
                        f"{r['ttft_p50_s']:.1f} / {r['ttft_p95_s']:.1f} | {r.get('itl_p50_ms') or 0:.0f} / "
                        f"{r.get('itl_p95_ms') or 0:.0f} | {c.get('llm_forwards_per_token', 0):.3f} | {rows_per} | "
                        f"{c.get('wait_steps_p50_at_most')} / {c.get('wait_steps_p95_at_most')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dtype", default=None, help="default: bfloat16, or float32 on a CPU where bf16 is slow")
    parser.add_argument("--out", default="benchmarks/results/serve_load.json")
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--other-load", default="none", help="what else ran on the machine (recorded in conditions)")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return {}
    if args.dtype is None:  # what --dtype auto measures on this CPU (r2r_hf/model/loading.py), named for the record
        from r2r_hf.model.loading import cpu_dtype_choice

        args.dtype = str(cpu_dtype_choice().dtype).replace("torch.", "")
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
    traces = Path(args.out).parent / f"{Path(args.out).stem}_traces"  # serve_load.json: serve_load_traces/
    traces.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            trace = traces / f"{name}-c{concurrency}.jsonl"
            trace.unlink(missing_ok=True)
            process, url = start(slm, llm, CONFIGS[name], args.dtype, trace=trace)
            try:
                asyncio.run(load(url, texts[:2], 2, 4))  # warm-up, not measured (its answers lead the trace)
                before = counters(url)
                warm = len(trace.read_text().splitlines()) if trace.exists() else 0
                run = asyncio.run(load(url, texts, concurrency, args.max_tokens))
                run["counters"] = per_run(before, counters(url))
                run["policy"] = _policy_of(CONFIGS[name])
            finally:
                server.stop(process, timeout=120)
            lines = trace.read_text().splitlines()[warm:]  # the measured run's turns and answers only
            trace.write_text("\n".join(lines) + "\n")
            results["runs"].setdefault(name, [])
            results["runs"][name] = [r for r in results["runs"][name] if r["concurrency"] != concurrency] + [run]
            print(json.dumps({"server": name, **run}), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    return results


def _policy_of(flags: list[str]) -> dict:
    """The policy a configuration's flags name (the server's defaults for what they leave out)."""
    value = dict(zip(flags[::2], flags[1::2]))
    out = {}
    if "--llm-min-rows" in value:
        out["min_rows"] = [int(v) for v in value["--llm-min-rows"].split(",")]
    for flag, name, kind in (("--llm-max-wait", "max_wait", int), ("--speculate", "speculate", int),
                             ("--speculate-below", "speculate_below", float), ("--threshold", "threshold", float)):
        if flag in value:
            out[name] = kind(value[flag])
    return out


if __name__ == "__main__":
    main()
