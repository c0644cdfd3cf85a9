"""Whether the server's steps are captured, and how: the guards of ``generate``'s captured path, for slots.

``auto`` captures where the model's ``CaptureStore`` captures (CUDA graphs on CUDA; the CPU emulation in tests)
and every guard allows: the attention, the rotary embedding, the cache layers and the devices must be what a
fixed-shape step needs (``core.capture.capturable``), and a stateful router runs eagerly anyway. Where a guard
refuses, the server runs eagerly and says why once; ``graphs`` refuses to start instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import CompileConfig

from ..core.fast.graphs import gc_paused
from ..core.fast.slot_reads import capture_slots
from ..core.fast.static_reads import capturable, compiled
from ..core.features import output_device
from ..model.loading import context_length

logger = logging.getLogger(__name__)

# Static slots hold this many tokens per answer unless --max-context says otherwise (the pair's context can be
# 32K or more, and every slot of both models is allocated at start).
DEFAULT_MAX_CONTEXT = 4096


def capture_plan(model, settings, device: torch.device):
    """(capturer or None, why not or None, columns per slot or None) for the server's batch."""
    mode = settings.capture
    if mode == "off":
        return None, "capture is off (capture='off', --capture off)", None
    why = capturable(model.slm) or capturable(model.llm)
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
        return compiled(CompileConfig(fullgraph=False, dynamic=False, mode="default")), None, columns
    step, pool = store.graph_step, store.graph_step.new_pool(device)
    return (lambda fn, example: step(fn, example, pool)), None, columns


def graph_memory(device: torch.device) -> Callable[[], int]:
    """A function that gives the device memory allocated so far (0 where torch does not count it)."""
    if device.type == "cuda":
        return lambda: torch.cuda.memory_allocated(device)
    return lambda: 0


def capture_batch(model, settings, batch, capturer, device: torch.device) -> dict:
    """Capture the server's batch of slots now (``core.fast.slot_reads.capture_slots``); what it took, for /health."""
    memory = graph_memory(device)
    before = memory()
    # As the decoding thread replays them; one collection, then none while it captures (``gc_paused``).
    with torch.inference_mode(), gc_paused(collect=True):
        fuse = settings.capture in ("auto", "graphs") and not settings.unfused_graphs and model.capture_store.fuse
        report = capture_slots(batch.layout, capturer, warm=settings.capture != "compile", fuse=fuse,
                               router_dtype=model.capture_store.router_dtype)
    used = memory() - before
    logger.info("captured %d steps in %.1f s (%d slots x %d tokens, %.0f MB)", report["steps"], report["seconds"],
                report["slots"], report["columns"], used / 2**20)
    return {"path": settings.capture if settings.capture != "auto" else "graphs", **report, "graph_memory_bytes": used}
