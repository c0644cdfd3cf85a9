"""A hybrid pair served on this CPU: slots against one answer at a time, speculation on and off (issue 56, item 6).

Before issue 56 a pair with recurrent or linear-attention layers (Qwen3.5/3.6, Qwen3-Next, Nemotron-H, Jamba, Mamba...)
was served one answer at a time on HF's caches: no slots, no batching. Now each slot keeps its rows' recurrent states
(``core/layouts/slot_state.py``). This drives the server's engine in-process over a random-weight Qwen3.5-style pair
(Gated DeltaNet + attention layers, 3:1, as Qwen3.5 stacks them; shapes scaled to this 2-core machine, said in the
JSON) at 1, 4 and 8 concurrent users, each mode in turn in one process, and reports tokens/s, tokens per engine step
and the forwards, with every served answer checked against ``generate`` alone (greedy).

    python -m benchmarks.serving.hybrid                    # writes benchmarks/results/hybrid_cpu.json
    python -m benchmarks.serving.hybrid --tokens 16 --users 1 2   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import torch
import transformers

from benchmarks.record import hardware, versions
from benchmarks.synthetic import HashRouter, Letters, request, serving_shape
from r2r_hf import R2RForCausalLM
from r2r_hf.core.abilities import abilities
from r2r_hf.core.notes import notes
from r2r_hf.model.row_settings import resolve_row
from r2r_hf.serve.engine import Engine
from r2r_hf.serve.settings import ServeSettings

OUT = Path(__file__).resolve().parents[1] / "results" / "hybrid_cpu.json"
SHAPES = {  # Qwen3.5-style: every fourth layer full attention, the others Gated DeltaNet
    "slm": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16,
                linear_key_head_dim=64, linear_value_head_dim=64),
    "llm": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=2, head_dim=64, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=64, linear_value_head_dim=64),
}
VOCAB = 32000
MODES = {  # name -> (slots, ServeSettings fields)
    "one at a time": (False, {}),
    "slots": (True, {}),
    "slots, speculating": (True, {"speculate": 4, "llm_max_wait": 8, "llm_min_rows": (2,)}),
}


class TokenHashRouter(HashRouter):
    """``HashRouter`` keyed on the proposed token's embedding (exact on every path) instead of the hidden state, whose
    last bits differ between two exact ways of reading (a read in slots against ``generate``'s): the served answers can
    then be held to ``generate``'s token for token."""

    def scores(self, topk_logits, token_embedding, hidden):
        return super().scores(topk_logits, token_embedding, token_embedding)


def qwen3_5_like(role: str, seed: int) -> torch.nn.Module:
    shape = SHAPES[role]
    layers = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(shape["num_hidden_layers"])]
    config = transformers.Qwen3_5TextConfig(vocab_size=VOCAB, layer_types=layers, linear_conv_kernel_dim=4,
                                            max_position_embeddings=4096, **shape)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def one_at_a_time(model) -> dict:
    """The models as the server saw them before issue 56 (their abilities say they cannot decode in slots)."""
    saved = {}
    for m in (model.slm, model.llm):
        saved[m] = abilities(m)
        notes(m)["abilities"] = dataclasses.replace(saved[m], slots="(issue 56's before: one answer at a time)")
    return saved


def serve(model, mode: str, users: int, tokens: int, share: float) -> dict:
    """``users`` answers of ``tokens`` tokens submitted at once to an engine in ``mode``; what it took."""
    slotted, fields = MODES[mode]
    saved = {} if slotted else one_at_a_time(model)
    try:
        engine = Engine(model, Letters(), ServeSettings(max_batch_size=8, capture="off", **fields))
        done, answers = threading.Semaphore(0), {}
        prompts = [[(17 * u + 5 * j) % (VOCAB - 3) + 3 for j in range(24 + 8 * u)] for u in range(users)]

        def sink(u):
            def emit(event):
                answers.setdefault(u, []).append(event)
                if event[0] in ("end", "error"):
                    done.release()
            return emit

        settings = [resolve_row(model, p, max_new_tokens=tokens, do_sample=False, threshold=1 - share) for p in prompts]
        engine.start()
        start = time.perf_counter()
        for u, p in enumerate(prompts):
            engine.submit(request(p, settings[u], sink(u)))
        for _ in prompts:
            done.acquire()
        seconds = time.perf_counter() - start
        engine.stop(30)
    finally:
        for m, value in saved.items():
            notes(m)["abilities"] = value
    c = engine.counters
    texts = ["".join(e[2] for e in answers[u] if e[0] == "text") for u in range(users)]
    return {"seconds": seconds, "tokens": c.generated, "tokens_per_s": c.generated / seconds,
            "steps": c.steps, "tokens_per_step": c.generated / max(c.steps, 1), "llm_forwards": c.llm_forwards,
            "slm_forwards": c.slm_forwards, "llm_tokens": c.llm_tokens, "rejected": c.rejected, "agreed": c.agreed,
            "texts": texts, "prompts": prompts}


def alone(model, prompt: list[int], tokens: int, share: float) -> str:
    out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                         threshold=1 - share)
    return Letters().decode(out[0, len(prompt):])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens per user (default: %(default)s)")
    parser.add_argument("--share", type=float, default=0.15, help="share of tokens routed (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("R2R_BENCH_THREADS", "2")))
    slm, llm = qwen3_5_like("slm", 0), qwen3_5_like("llm", 1)
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[256], router_expansion=1)
    result = {"hardware": hardware(), **versions(), "threads": torch.get_num_threads(), "shapes": SHAPES, "vocab": VOCAB,
              "tokens": args.tokens, "share": args.share, "load_before": os.getloadavg(), "runs": {}}
    with torch.inference_mode(), serving_shape(model):
        model.router = TokenHashRouter(model.router.inner)
        for users in args.users:
            for mode in MODES:
                run = serve(model, mode, users, args.tokens, args.share)
                wants = [alone(model, p, args.tokens, args.share) for p in run.pop("prompts")]
                run["answers_equal_alone"] = run.pop("texts") == wants
                result["runs"][f"{mode} / {users}"] = run
                print(f"{users} users, {mode}: {run['tokens_per_s']:.1f} tokens/s, {run['tokens_per_step']:.2f} "
                      f"tokens/step, equal alone: {run['answers_equal_alone']}", flush=True)
            base = result["runs"][f"one at a time / {users}"]["tokens_per_s"]
            for mode in MODES:
                run = result["runs"][f"{mode} / {users}"]
                run["vs_one_at_a_time"] = run["tokens_per_s"] / base
    result["load_after"] = os.getloadavg()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
