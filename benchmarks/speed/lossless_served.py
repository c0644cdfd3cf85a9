"""Lossless decoding for several users on this CPU, side by side in one process: R2R's server at threshold 0 (the
LLM's own answers, the SLM drafting, every answer in the running batch) against what HF offers them: assisted
generation one request after another (it refuses batches) and ``llm.generate`` on the batch (left-padded).

    python -m benchmarks.speed.lossless_served [--dtype bfloat16] [--users 4,8] [--max-new-tokens 160]

The real pair (``benchmarks/models.py``), greedy, chat template, the ``max(--users)`` HumanEval tasks with the
shortest prompts among those whose recorded LLM answer is at least ``--max-new-tokens`` long (answers of that
length). Per count of users N: the first N tasks, sent to the engine at once (in-process, its own decoding thread,
``ServeSettings(speculate=...)``: adaptive depths, ``--draft-confidence``, or ``--draft-cost``: the expected-gain
rule), and given to ``llm.generate`` as one
batch; assisted generation answers each task once (request by request: its time for N users is the sum over the
first N). Every answer's text is compared with assisted generation's (greedy: ``llm.generate``'s answer alone) and
the batch's. The load (``os.getloadavg``) is recorded with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch

from benchmarks.models import ROUTER
from benchmarks.quality.humaneval import Runner
from benchmarks.record import hardware, versions
from benchmarks.speed.lossless import tasks


def served(runner: Runner, prompts: list[list[int]], new: int, speculate: int, confidence: float | None,
           cost: float | None = None) -> dict:
    """R2R's engine answering ``prompts`` at once at threshold 0: texts, seconds, its counters."""
    from benchmarks.synthetic import request
    from r2r_hf.model.row_settings import resolve_row
    from r2r_hf.serve.engine import Engine
    from r2r_hf.serve.settings import ServeSettings

    settings = ServeSettings(max_batch_size=len(prompts), batch_wait_ms=50, capture="off", speculate=speculate,
                             draft_confidence=confidence, draft_cost=cost)
    engine = Engine(runner.r2r, runner.tok, settings)
    texts, done = [""] * len(prompts), threading.Semaphore(0)

    def emit_for(i):
        def emit(event):
            if event[0] == "text":
                texts[i] += event[2]
            elif event[0] in ("end", "error"):
                done.release()
        return emit

    requests = [request(p, resolve_row(runner.r2r, p, max_new_tokens=new, do_sample=False, threshold=0.0),
                        emit_for(i)) for i, p in enumerate(prompts)]
    engine.start()
    try:
        start = time.perf_counter()
        for r in requests:
            engine.submit(r)
        for _ in requests:
            done.acquire(timeout=7200)
        seconds = time.perf_counter() - start
    finally:
        engine.stop(600)
    return {"texts": texts, "seconds": seconds, "counters": engine.counters.summary()}


def batched(runner: Runner, prompts: list[list[int]], new: int) -> dict:
    """``llm.generate`` on the left-padded batch: texts and seconds."""
    tok, width = runner.tok, max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = runner.llm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              pad_token_id=tok.pad_token_id)
    seconds = time.perf_counter() - start
    return {"texts": [tok.decode(row[width:], skip_special_tokens=True) for row in out], "seconds": seconds}


def assisted(runner: Runner, prompt: list[int], new: int) -> tuple[str, float]:
    """One request through HF assisted generation: its text and seconds."""
    tok = runner.tok
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = runner.llm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), assistant_model=runner.slm,
                              max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default=ROUTER)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--users", default="4,8")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--speculate", type=int, default=16)
    parser.add_argument("--draft-confidence", type=float, default=None)
    parser.add_argument("--draft-cost", type=float, default=None, help="the expected-gain rule's LLM forward in SLM "
                        "steps (2.5: this CPU, bf16); default: drafts by acceptance")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lossless_served_<dtype>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    users = [int(u) for u in args.users.split(",")]
    new = args.max_new_tokens
    runner = Runner(args.router, None, new, getattr(torch, args.dtype))
    runner.slm.generation_config.assistant_confidence_threshold = 0.4  # HF's default (it adapts across calls)
    work = tasks(f"{new}:{max(users)}")
    prompts = [runner.tok(runner.chat_text(p), add_special_tokens=False)["input_ids"] for p, _ in work]
    runs = []
    with torch.inference_mode():  # HF's systems first: the engine's slots may leave the models as it reads them
        assisted(runner, prompts[0], 2), batched(runner, prompts[:2], 2)  # (first calls' one-time work, untimed)
        load = os.getloadavg()
        alone = [assisted(runner, p, new) for p in prompts]
        print("assisted, request by request:", [round(s, 1) for _, s in alone], flush=True)
        for n in sorted(users, reverse=True):
            runs.append({"users": n, "load_before": os.getloadavg(), "batched": batched(runner, prompts[:n], new)})
            print(n, "users: batched llm.generate", round(runs[-1]["batched"]["seconds"], 1), "s", flush=True)
        for run in runs:
            run["r2r"] = served(runner, prompts[: run["users"]], new, args.speculate, args.draft_confidence,
                                args.draft_cost)
            run["load_after"] = os.getloadavg()
            print(run["users"], "users: r2r", round(run["r2r"]["seconds"], 1), "s", flush=True)
    for run in runs:
        n, texts = run["users"], [t for t, _ in alone[: run["users"]]]
        run["assisted"] = {"texts": texts, "seconds": sum(s for _, s in alone[:n]), "load_before": load}
        tokens = sum(len(runner.tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
        for name in ("r2r", "batched", "assisted"):
            run[name]["tokens_per_s"] = tokens / run[name]["seconds"]
            run[name]["same_as_assisted"] = run[name]["texts"] == texts
            run[name]["same_as_batched"] = run[name]["texts"] == run["batched"]["texts"]
        better = max(run["batched"]["tokens_per_s"], run["assisted"]["tokens_per_s"])
        run["r2r_vs_better"] = run["r2r"]["tokens_per_s"] / better
        print(f"{n} users: r2r {run['r2r']['tokens_per_s']:.2f} tokens/s, batched {run['batched']['tokens_per_s']:.2f},"
              f" assisted {run['assisted']['tokens_per_s']:.2f}: {run['r2r_vs_better']:.2f}x the better; equal "
              f"(to assisted): r2r {run['r2r']['same_as_assisted']}, batched {run['batched']['same_as_assisted']}")
    result = {"conditions": {"tasks": [p["task_id"] for p, _ in work], "max_new_tokens": new, "dtype": args.dtype,
                             "threads": args.threads, "speculate": args.speculate,
                             "draft_confidence": args.draft_confidence, "draft_cost": args.draft_cost,
                             "router": args.router, "greedy": True,
                             "cpus": os.cpu_count(), **versions(), "cpu": hardware()}, "runs": runs}
    path = Path(args.out or f"benchmarks/results/lossless_served_{args.dtype}.json")
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
