"""What the device check measures and how long it may take: the device's plan and the CPU rehearsal's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """One check: the shapes, the shares, the order's deadlines (seconds after ``check.py`` started)."""

    slm: str
    llm: str
    dtype: str
    device: str
    prompt: int
    tokens: int
    batches: tuple[int, ...]
    shares: tuple[float, ...]
    headline: float  # the share of the headline pair (R2R fused at batch 1 against the fused LLM alone)
    repeats: int
    deadline_s: float  # the in-process phases end by then (check.sh's backstop is 30 s later: imports)
    warm_by_s: float  # the warm phase ends by then, whatever is left to compile: the headline pair is due next
    emulate: bool  # CPU: emulated CUDA graphs
    serve: tuple[int, ...]  # the serving phase's concurrencies (benchmarks/gpu/serve.py)
    serve_tokens: int  # tokens per served answer
    serve_budget_s: float
    serve_fused: bool  # the servers replay fused reads (the slot regions compile in the serving phase)
    agreement_reads: tuple[int, ...]  # the LLM's catch-ups after the prompt in the agreement phase
    compile_s: float  # the compiled child's own deadline (check.sh runs it as its own step)
    slack: float = 1.0  # every phase's budget is multiplied by it (the deadlines above are not)


# H200, bf16, 1.5B + 32B shapes. Budgets: benchmarks/gpu/check.py's docstring; the whole script: check.sh.
DEVICE = Plan("qwen2.5-1.5b", "qwen2.5-32b", "bfloat16", "cuda", prompt=64, tokens=128, batches=(1, 8),
              shares=(0.0, 0.05, 0.1, 0.2), headline=0.1, repeats=2, deadline_s=400, warm_by_s=185, emulate=False,
              serve=(8, 16), serve_tokens=128, serve_budget_s=150, serve_fused=True,
              agreement_reads=(3, 1, 70, 2, 40), compile_s=150)
# The dry run rehearses the order and the isolation, not the device's timing: budgets x 3 (CI runs it beside another
# pytest worker compiling with inductor, where it once took 4x its time alone). Its servers replay HF's forward: the
# slot regions' CPU compile would add a minute (tests/test_serve_captured.py serves fused reads on emulated graphs).
# Its agreement reads fit prompt + tokens, so every phase's cache has one capacity and nothing compiles after ``warm``.
DRY_RUN = Plan("tiny", "tiny-llm", "bfloat16", "cpu", prompt=16, tokens=24, batches=(1, 8),
               shares=(0.0, 0.05, 0.1, 0.2), headline=0.1, repeats=1, deadline_s=300, warm_by_s=200, emulate=True,
               serve=(8, 16), serve_tokens=4, serve_budget_s=60, serve_fused=False, agreement_reads=(3, 1, 9, 2, 1),
               compile_s=90, slack=3.0)
