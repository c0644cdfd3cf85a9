"""The device check's measurements, one function per phase (``check.py`` orders them and guards each).

Weights are random (speed does not depend on them) and the routed share is forced (``ForcedRouter`` runs the real
router every step and routes on a schedule), as in ``benchmarks/speed/generate.py``; ``r2r_router`` alone routes on the
real router's scores. Each function writes its numbers into the report as it takes them.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict

import torch

from benchmarks.gpu.plan import Plan
from benchmarks.gpu.runner import Report
from benchmarks.record import hardware, versions
from benchmarks.speed.parts import (ForcedRouter, captured_components, eager_components, first_call,
                                    graph_decode_per_token, ideal_per_token, llm_call_steps, schedule, timed)
from benchmarks.synthetic import random_model
from r2r_hf import R2RForCausalLM
from r2r_hf.core.fast.fused_reads import fused_regions, self_check
from r2r_hf.core.fast.graphs import gc_paused


def conditions(plan: Plan) -> dict:
    return {"hardware": hardware(plan.device), **versions(), "python": platform.python_version(),
            "weights": "random", "graphs": "emulated on the CPU (r2r_hf.testing.graphs)" if plan.emulate else "CUDA",
            "decoding": "greedy, min_new_tokens = max_new_tokens (every call writes the same number of tokens)"}


def compiles() -> int:
    """Graphs dynamo compiled so far in this process (each fused region's shape class is one)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def build(plan: Plan, report: Report) -> R2RForCausalLM:
    """The pair with the paper's router (1024 x 6 blocks); the fused self-check's measured difference per model."""
    dtype = getattr(torch, plan.dtype)
    slm, llm = random_model(plan.slm, dtype, plan.device, 0), random_model(plan.llm, dtype, plan.device, 1)
    dims = [1024] * 6 if not plan.emulate else [64] * 2
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=dims)
    if plan.emulate:
        from r2r_hf.testing.graphs import emulated_store

        model.capture_store = emulated_store(fuse=True)  # the fused path, compiled on the CPU (tiny: seconds)
    # Written down whatever it decides: a pass says nothing of the margin, a refusal turns every number unfused.
    report.put("fused_check", None, {role: self_check(getattr(model, role)) for role in ("slm", "llm")})
    return model


def warm(model, plan: Plan, prompts: dict, gen: dict, report: Report) -> None:
    """Compile every shape class the check meets before any timed phase: R2R at batch 1, then 2, every token
    routed, so each model reads the prompt in pieces and one token per step. That is each region's (one row |
    several) x (one token | a piece) classes: the rows, tokens and cache dims are marked dynamic
    (``core/fast/fused_reads.py``), so batch 8 and every catch-up bucket reuse them (sizes 1 specialise), and the caches
    have the timed phases' capacity. Batch 1 first: the headline pair needs only its classes. Last, the SLM alone
    (``slm_fused_1``): its head without the hidden state is one more compile. The collector runs once, then stays
    off while the warm-up captures (``gc_paused``)."""
    with gc_paused(collect=True):
        for batch in (1, 2):
            start, before = time.perf_counter(), compiles()
            model.generate(prompts[batch], **gen, cache_implementation="static", threshold=0.0)
            report.put("warm", str(batch), {"seconds": time.perf_counter() - start, "compiles": compiles() - before,
                                            "fused": what_ran(model)})
            model.capture_store.clear()
        start, before, regions = time.perf_counter(), compiles(), fused_regions(model.slm)
        if regions is not None:  # one untimed run (repeats 0)
            graph_decode_per_token(model.slm, prompts[1], plan.tokens, model.capture_store.graph_step, plan.device, 0,
                                   regions)
        report.put("warm", "slm alone", {"seconds": time.perf_counter() - start, "compiles": compiles() - before})


def what_ran(model) -> dict:
    """Which of the models' reads the stored state replays fused (a region that failed to compile fell back)."""
    state = model.capture_store.state
    return {} if state is None else {role: regions is not None for role, regions in state.fused.items()}


def decisions(plan: Plan, share: float, batch: int) -> torch.Tensor:
    """The forced schedule at ``share``: one for the whole batch at batch 1, rows independent above."""
    return schedule(share, batch, plan.tokens, per_row=batch > 1)


def r2r_shares(model, plan: Plan, batch: int, prompt: torch.Tensor, gen: dict, report: Report,
               shares: tuple[float, ...]) -> None:
    """R2R on the captured (fused) path at each forced share; ``r2r_captured[batch]`` gains one entry per share, in
    order of p, written as it is measured."""
    router = model.router
    forced = ForcedRouter(router, batch, plan.tokens)
    model.router = forced
    try:
        for share in shares:
            forced.set_schedule(decisions(plan, share, batch))
            call = lambda: model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)  # noqa: E731
            run = {"p": share, "p_llm_call": len(llm_call_steps(decisions(plan, share, batch))) / plan.tokens,
                   "first_call_s": first_call(call, plan.device)}
            run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
            run["tokens_per_s"] = 1e3 * batch / run["ms_per_token"]
            runs = [r for r in report.data.get("r2r_captured", {}).get(str(batch), []) if r["p"] != share]
            report.put("r2r_captured", str(batch), sorted([*runs, run], key=lambda r: r["p"]))
            report.put("fused", str(batch), what_ran(model))
    finally:
        model.router = router


def alone(model, role: str, plan: Plan, batch: int, prompt: torch.Tensor, report: Report, fused: bool) -> None:
    """``role``'s model alone, its one-token step replayed on graphs: of fused reads (``{role}_fused_ms``, the fair
    denominator: what R2R's own reads replay) or of HF's forward (``{role}_graphs_ms``). A model that cannot be
    fused is measured on HF's forward and says so (``fused``: False)."""
    net = getattr(model, role)
    regions = fused_regions(net) if fused else None
    seconds = graph_decode_per_token(net, prompt, plan.tokens, model.capture_store.graph_step, plan.device,
                                     plan.repeats, regions)
    value = 1e3 * seconds
    report.put(f"{role}_{'fused' if fused else 'graphs'}_ms", str(batch),
               {"ms_per_token": value, "fused": regions is not None} if fused else value)


def r2r_unfused(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R at the headline share, batch 1, on graphs of HF's own forward (what ``--unfused-graphs`` captures)."""
    store, router = model.capture_store, model.router
    forced = ForcedRouter(router, 1, plan.tokens)
    forced.set_schedule(decisions(plan, plan.headline, 1))
    fuse, store.fuse, model.router = store.fuse, False, forced
    try:
        call = lambda: model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)  # noqa: E731
        run = {"p": plan.headline, "first_call_s": first_call(call, plan.device)}
        run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
        report.put("r2r_unfused_ms", "1", run)
    finally:
        store.fuse, model.router = fuse, router
        store.clear()  # the next phase captures fused reads again


def r2r_router(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R at batch 1 with the real router, which the forced schedules cannot have (they keep per-step state): the
    router folded into the SLM's captured read and in the models' dtype (``core/fast/router_copy.py``). The threshold is the
    90th percentile of its never-routed scores, so about 10 % of tokens route; the share it routed is reported."""
    def call(threshold: float):
        return model.generate(prompt, **gen, cache_implementation="static", threshold=threshold,
                              return_dict_in_generate=True)

    probe = call(float("inf"))
    threshold = float(probe.router_scores[probe.generated_mask].float().quantile(0.9))
    run = {"threshold": threshold, "first_call_s": first_call(lambda: call(threshold), plan.device)}
    run["p_measured"] = float(call(threshold).llm_token_rate)
    state = model.capture_store.state
    run["router"] = {"folded": state.router_step is None, "dtype": str(next(state.scorer.module.parameters()).dtype)}
    report.put("r2r_router_ms", "1", run)
    run["ms_per_token"] = 1e3 * timed(lambda: call(threshold), plan.device, plan.repeats) / plan.tokens
    report.put("r2r_router_ms", "1", run)


def components(model, plan: Plan, batch: int, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """Captured and eager component costs at ``batch``, and each share's ideal time (and loop efficiency,
    where R2R at that share was measured): the schedules are rebuilt, so this needs no other phase."""
    router, forced = model.router, ForcedRouter(model.router, batch, plan.tokens)
    model.capture_store.clear()  # capture this batch size's state (and only it)
    model.router = forced
    try:
        model.generate(prompt, **gen, cache_implementation="static", threshold=0.5)
    finally:
        model.router = router
    context = plan.prompt + plan.tokens // 2
    parts = captured_components(model.capture_store.state, context, plan.repeats, plan.device)
    eager = eager_components(model.slm, model.llm, forced, batch, plan.prompt, context, plan.device, plan.repeats)
    ms = lambda parts: {k: ({str(g): 1e3 * t for g, t in v.items()} if isinstance(v, dict) else 1e3 * v)  # noqa: E731
                        for k, v in parts.items()}
    report.put("components_ms", str(batch), {"captured": ms(parts), "eager": ms(eager)})
    measured = {r["p"]: r["ms_per_token"] for r in report.data.get("r2r_captured", {}).get(str(batch), [])}
    rows = []
    for share in plan.shares:
        ideal = 1e3 * ideal_per_token(llm_call_steps(decisions(plan, share, batch)), parts, eager, plan.prompt,
                                      plan.tokens)
        rows.append({"p": share, "ideal_ms": ideal,
                     "loop_efficiency": ideal / measured[share] if share in measured else None})
    report.put("cost_model", str(batch), rows)


def speculative(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R speculating (issue 43: ``speculate=8``, the LLM resolving once the oldest pending token is 32 steps old)
    at the headline share, batch 1, on the forced schedule, fused path. Random weights: the LLM disagrees with the
    SLM at almost every routed position, so every resolution rolls back at its first pending token — the worst
    case, with its counters; the resolving reads' own cost is ``components_ms``' ``t_llm_every``, and the cost
    model (``benchmarks/serving/speculative.py``) takes the agreement measured on a real pair (0.876)."""
    router, forced = model.router, ForcedRouter(model.router, 1, plan.tokens)
    model.router = forced
    try:
        forced.set_schedule(decisions(plan, plan.headline, 1))
        last = {}

        def call() -> None:  # (keeps its output: the counters come from a timed call, not one more 32B generate)
            last["out"] = model.generate(prompt, **gen, cache_implementation="static", threshold=0.5, speculate=8,
                                         llm_max_wait=32, return_dict_in_generate=True)

        run = {"p": plan.headline, "first_call_s": first_call(call, plan.device)}
        run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
        run["counters"] = {k: v for k, v in last["out"].counters.items() if v is not None}
        run["fused"] = what_ran(model)
        report.put("r2r_speculative_ms", "1", run)
    finally:
        model.router = router


def bf16_agreement(model, plan: Plan, report: Report) -> None:
    """Teacher-forced logits of the captured path against the eager one (dynamic cache), 2 rows, over a cache of
    the timed phases' capacity (prompt + tokens: the warm phase compiled for it)."""
    from r2r_hf.core.layouts.model_calls import EagerCalls
    from r2r_hf.testing.agreement import agreement, teacher_forced

    length = plan.prompt + plan.tokens
    if plan.prompt + sum(plan.agreement_reads) + 8 > length:
        raise ValueError(f"the agreement reads {plan.agreement_reads} do not fit {plan.tokens} tokens")
    ids = torch.randint(0, 1000, (2, length), device=plan.device, generator=torch.Generator(plan.device).manual_seed(3))
    reads = [plan.prompt + plan.agreement_reads[0], *plan.agreement_reads[1:]]
    k = model.config.num_topk_logits
    model.capture_store.clear()
    eager = EagerCalls(model.slm, model.llm, model.router, k, None, length)
    captured = model.capture_store.lend(model.slm, model.llm, model.router, k, None, 2, length)
    try:
        found = agreement(teacher_forced(eager, ids, plan.prompt, reads), teacher_forced(captured, ids, plan.prompt, reads))
    finally:
        captured.close()
    report.put("agreement", None, {"dtype": plan.dtype, "reads": reads, **{r: asdict(a) for r, a in found.items()}})


def eager(model, role: str, plan: Plan, batch: int, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """``role`` decoding eagerly (HF's dynamic cache); R2R at the headline share."""
    if role != "r2r":
        ms = 1e3 * timed(lambda: getattr(model, role).generate(prompt, **gen), plan.device, plan.repeats) / plan.tokens
        report.put(f"{role}_eager_ms", str(batch), ms)
        return
    router, forced = model.router, ForcedRouter(model.router, batch, plan.tokens)
    forced.set_schedule(decisions(plan, plan.headline, batch))
    model.router = forced
    try:
        ms = 1e3 * timed(lambda: model.generate(prompt, **gen, threshold=0.5), plan.device, plan.repeats) / plan.tokens
    finally:
        model.router = router
    report.put("r2r_eager_ms", str(batch), {str(plan.headline): ms})


def serving(model, plan: Plan, report: Report) -> None:
    """The server's engine in-process under load (``benchmarks/gpu/serve.py``): R2R fused against the LLM alone on
    the same engine, at each concurrency; each server's numbers as they come."""
    from benchmarks.gpu.serve import serving_phase
    from benchmarks.synthetic import serving_shape

    # Its own deadline comes 10 s before the phase's: a load cut there still stops its engine and says so.
    deadline = time.monotonic() + plan.serve_budget_s * plan.slack - 10
    with serving_shape(model), torch.inference_mode():
        serving_phase(model, plan.headline, plan.serve, plan.serve_tokens, plan.prompt,
                      lambda name, value: report.put("serving", name, value), deadline, fused=plan.serve_fused,
                      peer=not plan.emulate)  # HF's generate_batch warms up for ~20-30 s on a CPU: the device's only
