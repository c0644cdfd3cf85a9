"""Whether the server's steps are captured, and how: the guards of ``generate``'s captured path, for slots.

``auto`` captures where the model's ``CaptureStore`` captures (CUDA graphs on CUDA; the CPU emulation in tests)
and every guard allows: the attention, the rotary embedding, the cache layers and the devices must be what a
fixed-shape step needs (each model's ``Abilities.capture``: ``core/abilities.py``), and a stateful router runs eagerly anyway. Where a guard
refuses, the server runs eagerly and says why once; ``graphs`` refuses to start instead.

Every step is captured at start-up, before the server listens (``capture_batch``): CUDA graphs, and ``compile``
too, which compiles each step on its example inputs then rather than on the decoding thread at first use (where
every answer waited for it). The reads of both models and every bucket share one code object, so dynamo's
recompile limit (8 per code object) is raised to cover them while they compile, and a hit is an error: past it,
later shapes would run uncompiled while ``/health`` said ``compile``. For the same reason nothing inside a read
writes Python state (``slot_cache.count_gathered`` counts on the host): dynamo would guard on its value and compile
the read again while serving, past the limit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from transformers import CompileConfig

from ..core.fast.graphs import CompiledStep, Step, compile_options, gc_paused, recompile_limit
from ..core.fast.slot_reads import capture_slots, captured_steps
from ..core.features import output_device
from ..model.loading import context_length

logger = logging.getLogger(__name__)

# Static slots hold this many tokens per answer unless --max-context says otherwise (the pair's context can be
# 32K or more, and every slot of both models is allocated at start).
DEFAULT_MAX_CONTEXT = 4096


def capture_plan(model, abilities, settings, device: torch.device):
    """(capturer or None, why not or None, columns per slot or None) for the server's batch of ``model``'s pair,
    whose ``abilities`` (``core.abilities.PairAbilities``) say whether its models can be captured."""
    mode = settings.capture
    if mode == "off":
        return None, "capture is off (capture='off', --capture off)", None
    why = abilities.why_not("capture")
    if why is None and output_device(model.llm) != output_device(model.slm):
        why = "the LLM is on another device than the SLM"
    store = model.capture_store
    if why is None and mode != "compile" and not store.captures_on(device):
        why = (f"the models run on {device.type} (CUDA graphs capture on CUDA; capture='compile', --capture compile, "
               "uses torch.compile)")
    if why is not None:
        if mode == "graphs":
            raise ValueError(f"capture='graphs' (--capture graphs) cannot capture these models: {why}. Use 'auto' or "
                             "'off'.")
        return None, why, None
    context = context_length(model.slm, model.llm) or DEFAULT_MAX_CONTEXT
    columns = (settings.max_context or min(context, DEFAULT_MAX_CONTEXT)) + 1
    if mode == "compile":
        steps = captured_steps(settings.max_batch_size, columns, bool(settings.speculate))
        # Room for every step twice: the router is captured again over fp32 where its copy fails its check.
        return compile_now(CompileConfig(fullgraph=False, dynamic=False, mode="default"), 2 * steps), None, columns
    step, pool = store.graph_step, store.graph_step.new_pool(device)
    return (lambda fn, example: step(fn, example, pool)), None, columns


def compile_now(compile_config, limit: int) -> Callable[[Step, dict], Step]:
    """A capturer that compiles each step as it is captured, on its example inputs (which write nothing at
    start-up), with the options of an HF ``CompileConfig``, under a recompile limit of ``limit``."""
    options = compile_options(compile_config)

    def capture(fn: Step, example: dict[str, torch.Tensor]) -> Step:
        step = CompiledStep(fn, options)
        with _recompile_limit(limit):
            step(**example)  # torch.compile compiles on a call: this one, not the decoding thread's first
        return step

    return capture


def capture_batch(batch, model, settings, capturer: Callable[[Step, dict], Step], device: torch.device,
                  policy) -> dict:
    """Capture every step of ``batch`` now (each slot read per rows and tokens bucket, the router per rows bucket,
    the draft blocks ``policy`` asks for); the report ``/health`` and the log give: the path, the steps captured and
    the seconds and memory it took."""
    memory = graph_memory(device)
    before = memory()
    fuse = settings.capture in ("auto", "graphs") and not settings.unfused_graphs and model.capture_store.fuse
    # As the decoding thread replays them; one collection, then none while it captures (``gc_paused``).
    with torch.inference_mode(), gc_paused(collect=True):
        report = capture_slots(batch.layout, capturer, warm=True, fuse=fuse,
                               router_dtype=model.capture_store.router_dtype, speculate=policy.speculate,
                               block=policy.block, gains=policy.draft_cost > 0)
    path = settings.capture if settings.capture != "auto" else "graphs"
    report = {"path": path, **report, "graph_memory_bytes": memory() - before}
    logger.info("%s %d steps at start-up in %.1f s (%d slots x %d tokens, %.0f MB)",
                "compiled" if path == "compile" else "captured", report["steps"], report["seconds"], report["slots"],
                report["columns"], report["graph_memory_bytes"] / 2**20)
    return report


@contextlib.contextmanager
def _recompile_limit(steps: int) -> Iterator[None]:
    """Dynamo's recompile limits raised to ``steps`` (``graphs.recompile_limit``); a hit said in one sentence."""
    from torch._dynamo import exc

    hit = tuple(getattr(exc, n) for n in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit") if hasattr(exc, n))
    try:
        with recompile_limit(steps):
            yield
    except hit as err:
        raise RuntimeError(f"capture='compile' (--capture compile) could not compile every step of these models within "
                           f"torch's recompile limit ({err}); use 'auto' or 'off'.") from err


def graph_memory(device: torch.device) -> Callable[[], int]:
    """A function that gives the device memory allocated so far (0 where torch does not count it)."""
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    return lambda: 0
