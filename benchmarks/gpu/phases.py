"""The device check's ``generate`` measurements, one function per phase (``check.py`` orders them and guards each;
the grid is ``grid.py``'s, the served phases ``served.py``'s).

Weights are random (speed does not depend on them) and the routed share is forced (``ForcedRouter`` runs the real
router every step and routes on a schedule), as in ``benchmarks/speed/generate.py``. Each function writes its numbers
into the report as it takes them.
"""

from __future__ import annotations

import platform
import time

import torch

from benchmarks.gpu.plan import Plan
from benchmarks.gpu.runner import Report
from benchmarks.record import hardware, versions
from benchmarks.gpu import oracle
from benchmarks.speed.parts import ForcedRouter, first_call, graph_decode_per_token, llm_call_steps, schedule, timed
from benchmarks.synthetic import random_model
from r2r_hf import R2RForCausalLM
from r2r_hf.core.abilities import abilities
from r2r_hf.core.fast.fused_reads import regions_for
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
    report.put("fused_check", None, {role: fused_check(getattr(model, role)) for role in ("slm", "llm")})
    return model


def fused_check(model) -> dict:
    """What the fused self-check decided for ``model`` (``problem``: None where it fuses) and what it measured: the
    fused read's largest logit gap over the largest logit (``max_rel``), its ``tolerance``, and HF's own read in
    slots' gap (``slot_read_max_rel``, the rounding the tolerance allows twice)."""
    able = abilities(model)
    measured = able.measured
    return {"problem": able.fuse, "max_rel": measured.get("fuse_max_rel"), "tolerance": measured.get("fuse_tolerance"),
            "slot_read_max_rel": measured.get("slot_read_max_rel")}


def warm(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """Compile every shape class ``generate``'s timed phases meet: R2R at batch 1, every token routed, so each model
    reads the prompt in pieces and one token per step (each region's one row x (one token | a piece) classes; the
    tokens and cache dims are marked dynamic, ``core/fast/fused_reads.py``, so every catch-up bucket reuses them), over
    caches of the timed phases' capacity. The collector runs once, then stays off while the warm-up captures
    (``gc_paused``). The slot reads' classes (the grid, the servers) are ``warm_grid``'s and ``warm_servers``'."""
    with gc_paused(collect=True):
        start, before = time.perf_counter(), compiles()
        model.generate(prompt, **gen, cache_implementation="static", threshold=0.0)
        report.put("warm", "1", {"seconds": time.perf_counter() - start, "compiles": compiles() - before,
                                 "fused": what_ran(model)})
        model.capture_store.clear()


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
    regions = regions_for(net, fused, abilities(net).fuse)
    seconds = graph_decode_per_token(net, prompt, plan.tokens, model.capture_store.graph_step, plan.device,
                                     plan.repeats, regions)
    value = 1e3 * seconds
    report.put(f"{role}_{'fused' if fused else 'graphs'}_ms", str(batch),
               {"ms_per_token": value, "fused": regions is not None} if fused else value)








def speculative(model, plan: Plan, prompt: torch.Tensor, gen: dict, report: Report) -> None:
    """R2R speculating at batch 1 (``speculate=8``, the LLM resolving once the oldest pending token is 32 steps old)
    at the headline share on the forced schedule, fused path, with the agreement oracle (``oracle.py``: the LLM
    agrees at a pending position with the real pair's probability; random weights alone would roll every
    resolution back): its time per token and its counters, stamped as timed with the oracle."""
    router, forced = model.router, ForcedRouter(model.router, 1, plan.tokens)
    model.router = forced
    try:
        forced.set_schedule(decisions(plan, plan.headline, 1))
        last = {}

        def call() -> None:  # (keeps its output: the counters come from a timed call, not one more 32B generate)
            with oracle.agreement_oracle(plan.agreement):
                last["out"] = model.generate(prompt, **gen, cache_implementation="static", threshold=0.5,
                                             speculate=8, llm_max_wait=32, return_dict_in_generate=True)

        run = {"p": plan.headline, "first_call_s": first_call(call, plan.device)}
        run["ms_per_token"] = 1e3 * timed(call, plan.device, plan.repeats) / plan.tokens
        run["counters"] = {k: v for k, v in last["out"].counters.items() if v is not None}
        run["fused"] = what_ran(model)
        report.put("r2r_speculative_ms", "1", oracle.stamp(run, plan.agreement))
    finally:
        model.router = router
