"""What the device check measures and how long it may take: the device's plan and the CPU rehearsal's."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.gpu.oracle import AGREEMENT


@dataclass(frozen=True)
class Plan:
    """One check: the shapes, each phase's sizes, the order's deadlines (seconds after ``check.py`` started)."""

    slm: str
    llm: str
    dtype: str
    device: str
    prompt: int  # tokens per prompt (generate's and the servers')
    tokens: int  # tokens per answer of generate's phases (the headline pair, batch-1 speculation)
    headline: float  # the routed share of the headline pair and of every served R2R load
    repeats: int
    deadline_s: float  # the in-process phases end by then (check.sh's backstop is 30 s later: imports)
    warm_by_s: float  # the warm phase ends by then, whatever is left to compile: the headline pair is due next
    emulate: bool  # CPU: emulated CUDA graphs
    region_backend: str  # the fused regions' compiler: inductor on the device; dynamo's "eager" backend in the dry
    # run (dynamo's guards, hence which phase compiles what, as on the device, without inductor's minutes on a CPU)
    # the cost grid (grid.py, on batches of the servers' own shapes): the column its short points start at, its points
    grid_context: int
    grid_rows: tuple[int, ...]  # the LLM's padded reads: rows x tokens
    grid_tokens: tuple[int, ...]
    verify_rows: tuple[int, ...]  # packed reads keeping every position's logits: rows x tokens
    verify_tokens: tuple[int, ...]
    long_span: int  # the long-span points (on the long answers' slots) attend this many columns
    slm_rows: tuple[int, ...]  # the SLM's reads (rows x tokens), the router's graph and top-k (rows)
    slm_tokens: tuple[int, ...]
    grid_replays: int
    host_rows: tuple[int, ...]  # the host's time per decoding step at these rows (each in slm_rows)
    host_steps: int
    # the served phases (served.py)
    serve: tuple[int, ...]  # R2R against the LLM alone at each (a concurrency named twice runs twice: noise)
    serve_tokens: int
    long_users: int  # one configuration of long answers: its concurrency (one answer each) and tokens
    long_tokens: int
    speculate: int  # the speculative server's depth
    spec_users: tuple[int, ...]
    # the fused LLM against its eager forward (exact.py), the SLM's step profiled (kernels.py)
    exact_rows: int
    exact_length: int
    profile_rows: tuple[int, ...]
    profile_steps: int
    compile_s: float  # the peers' child's own deadline (check.sh runs it as its own step)
    agreement: float = AGREEMENT  # the oracle's agreement at pending positions (the real pair's)
    slack: float = 1.0  # every phase's budget is multiplied by it (the deadlines above are not)


# H200, bf16, 1.5B + 32B shapes. Budgets: benchmarks/gpu/check.py's docstring; the whole script (8.5 minutes): check.sh.
DEVICE = Plan("qwen2.5-1.5b", "qwen2.5-32b", "bfloat16", "cuda", prompt=64, tokens=128, headline=0.1, repeats=2,
              deadline_s=450, warm_by_s=150, emulate=False, region_backend="inductor",
              grid_context=128, grid_rows=(1, 2, 4, 8, 16), grid_tokens=(1, 8, 16, 32, 64), verify_rows=(8, 16),
              verify_tokens=(16, 32, 64), long_span=2048,
              slm_rows=(1, 8, 16), slm_tokens=(1, 64), grid_replays=20, host_rows=(8, 16), host_steps=24,
              serve=(8, 16, 16), serve_tokens=128, long_users=8, long_tokens=2048, speculate=4, spec_users=(8, 16),
              exact_rows=2, exact_length=320, profile_rows=(1, 16), profile_steps=10, compile_s=150)
# The dry run rehearses the order, the isolation and the compile count, not the device's timing: tiny shapes, fewer
# points and replays, budgets x 3 (CI runs it beside other pytest workers). Every slot read is fused, as on the
# device, with the regions traced by dynamo and run by its eager backend.
DRY_RUN = Plan("tiny", "tiny-llm", "bfloat16", "cpu", prompt=16, tokens=24, headline=0.1, repeats=1,
               deadline_s=300, warm_by_s=200, emulate=True, region_backend="eager",
               grid_context=16, grid_rows=(1, 2, 8), grid_tokens=(1, 8), verify_rows=(2,), verify_tokens=(8,),
               long_span=48, slm_rows=(1, 8), slm_tokens=(1, 8), grid_replays=2, host_rows=(8,), host_steps=4,
               serve=(4, 8, 8), serve_tokens=4, long_users=2,
               long_tokens=24, speculate=4, spec_users=(4, 8), exact_rows=2, exact_length=40, profile_rows=(1, 8),
               profile_steps=2, compile_s=90, slack=3.0)
