"""The family matrix's served cells: the server's engine in-process, and ``r2r-hf serve`` as a process over HTTP.

Each raises ``pairs.Mismatch`` where a served answer departs from ``generate`` alone (``matrix.py`` classifies).
"""

from __future__ import annotations

import json
import tempfile
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .models import EOS_ID, PAD_ID
from .pairs import NEW, PROMPTS, Mismatch, Pair, Refused


def refused_speculation(slm, llm, slots: bool = False) -> None:
    """Where R2R does not speculate for the pair (in the server's ``slots``, or on HF's caches), the sentence it says
    is the cell's refusal (never a pass)."""
    from ..core.abilities import PairAbilities

    problem = PairAbilities.of(slm, llm).speculation(slots)
    if problem is not None:
        raise Refused(problem)


def cell_served(p: Pair, **settings) -> None:
    """The server's engine (in-process, every prompt at once, greedy and seeded) = ``generate`` alone."""
    from ..model.row_settings import resolve_row
    from ..serve.engine import Engine, Request
    from ..serve.rows import Choice
    from ..serve.settings import ServeSettings

    jobs = [(list(prompt), {"threshold": p.threshold, "do_sample": False} if i != 1 else
             {"threshold": p.threshold, "do_sample": True, "temperature": 1.0, "top_k": 20, "seed": 3})
            for i, prompt in enumerate(PROMPTS)]
    settings = {"capture": "off", **settings}
    engine = Engine(p.model, p.tok, ServeSettings(max_batch_size=4, batch_wait_ms=20, **settings))
    texts, done = {i: [] for i in range(len(jobs))}, threading.Semaphore(0)

    def sink(i):
        def emit(event):
            texts[i].append(event)
            if event[0] in ("end", "error"):
                done.release()
        return emit

    report = engine.capture_report
    if settings["capture"] != "off" and report["path"] == "eager" and not report.get("why"):
        raise Mismatch(f"served: the steps were not captured and the server did not say why ({report})")
    engine.start()
    try:
        for i, (prompt, options) in enumerate(jobs):
            engine.submit(Request([prompt], [Choice(resolve_row(p.model, prompt, max_new_tokens=NEW, **options))],
                                  sink(i)))
        for _ in jobs:
            if not done.acquire(timeout=120):
                raise Mismatch("served: an answer did not end within 120 s")
    finally:
        engine.stop(30)
    for i, (prompt, options) in enumerate(jobs):
        errors = [e for e in texts[i] if e[0] == "error"]
        if errors:
            raise RuntimeError(f"served: {errors[0][1].message}")
        got = "".join(e[2] for e in texts[i] if e[0] == "text")
        ids = torch.tensor([prompt])
        out = p.model.generate(input_ids=ids, max_new_tokens=NEW, pad_token_id=PAD_ID, eos_token_id=EOS_ID, **options)
        want = p.tok.decode(out[0, len(prompt):], skip_special_tokens=True)
        if got != want:
            raise Mismatch(f"served answer {i} ({'sampled' if options['do_sample'] else 'greedy'}) differs from "
                           f"generate alone: {got!r} != {want!r}")


def cell_served_speculation(p: Pair) -> None:
    """The same with ``--speculate 4``."""
    cell_served(p, speculate=4)
    refused_speculation(p.slm, p.llm, slots=True)


def cell_served_captured(p: Pair) -> None:
    """The same on captured steps (``--capture auto``: CUDA graphs, emulated on the CPU), where the models can be
    captured (else the server says why, once, and runs eagerly); fused where a model can be fused (its regions run
    plain here: the LLM's reads packed, the router folded into the SLM's reads), HF's forward elsewhere."""
    from .graphs import emulated_store

    store, p.model.capture_store = p.model.capture_store, emulated_store(fuse="plain")
    try:
        cell_served(p, capture="auto", max_context=64)
    finally:
        p.model.capture_store = store


def serve_over_http(p: Pair, *flags: str) -> None:
    """``r2r-hf serve`` over the pair as a process of its own (saved to folders), every prompt sent at once over HTTP
    with a waiting policy (routed answers wait for a shared LLM forward): each answer = ``generate`` alone."""
    from .server import start, stop

    with tempfile.TemporaryDirectory() as root:
        folders = {}
        for role, model in (("slm", p.slm), ("llm", p.llm)):
            folders[role] = str(Path(root, role))
            model.save_pretrained(folders[role])
            p.tok.save_pretrained(folders[role])
        p.model.save_pretrained(Path(root, "router"))
        process, url = start(Path(root, "router"), "--slm", folders["slm"], "--llm", folders["llm"], "--threads", "1",
                             "--llm-min-rows", "2", "--llm-max-wait", "4", "--max-batch-size", "4", *flags)
        try:
            texts = [p.tok.decode(list(prompt)) for prompt in PROMPTS]
            with ThreadPoolExecutor(len(texts)) as pool:
                got = list(pool.map(lambda text: _complete(url, text, p.threshold), texts))
        finally:
            stop(process)
    for i, text in enumerate(texts):
        ids = p.tok(text, return_tensors="pt").input_ids
        out = p.model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD_ID,
                               eos_token_id=EOS_ID, threshold=p.threshold)
        want = p.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if got[i] != want:
            raise Mismatch(f"served over HTTP: answer {i} differs from generate alone: {got[i]!r} != {want!r}")


def _complete(url: str, prompt: str, threshold: float) -> str:
    # (the server names its model after the router's folder)
    body = json.dumps({"model": "router", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                       "threshold": threshold}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["text"]
