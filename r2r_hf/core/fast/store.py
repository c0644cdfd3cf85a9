"""Which engine a generate call runs on, and the store that lends captured steps to one call at a time.

A ``CaptureStore`` belongs to one model. It keeps one ``CapturedState`` (static caches and the
calls captured over them) between calls, rebuilds it when the batch size, the pair, the router or
the compile options change, a call needs a longer cache or a weight of a model or of the router was replaced since
the last call (``weight.data = ...``, ``load_state_dict(assign=True)``, ``model.to(dtype)``: captured calls would read
the old memory; a weight written in place is read as it is),
and lends it to one call at a time:
the state's caches hold that call's tokens, so a concurrent call on another thread waits for it
(the device runs one call's steps at a time anyway), and a call made from inside another on the
same thread (a streamer that generates) runs eagerly instead of waiting for itself.

How steps are captured is injected: ``graph_step`` (CUDA graphs by default; the CPU emulation of
``r2r_hf.testing.graphs`` in tests and dry runs) on ``graph_devices``, ``torch.compile`` whenever
the call passes a ``compile_config``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

from transformers import GenerationConfig

from .static_reads import SLACK, CapturedState, CapturedCalls, compiled, read_memory
from ..layouts.model_calls import EagerCalls
from ..layouts.rectangle import ModelCalls
from ..features import output_device
from .fused_reads import regions_for
from .graphs import CudaGraphStep, GraphStep
from ..pair import RoutedPair

logger = logging.getLogger(__name__)


def state_key(slm, llm, router, num_topk: int, compile_config, batch: int, fuse: bool | str,
              router_dtype: str) -> tuple:
    """What a stored state was built for: the same objects (identity), options and batch size."""
    options = None if compile_config is None else json.dumps(compile_config.to_dict(), sort_keys=True, default=str)
    return (slm, llm, router, num_topk, options, batch, fuse, router_dtype)


class CaptureStore:
    """The captured calls and their static caches of one model, lent to one generate call at a time.

    Args:
        graph_step: how a step is captured without ``compile_config`` (a ``graphs.GraphStep``).
        graph_devices: device types on which a static-cache call is captured that way.
        fuse: capture fused reads (``fused.py``: one compiled region per decoder layer, then captured) where a
            model can be fused; False captures HF's eager forward; ``"plain"`` runs the fused regions uncompiled
            (tests). Settable: ``model.capture_store.fuse = False``.
        router_dtype: ``"model"`` (default) scores with a copy of the router in the SLM's dtype where its scores
            stay within ``router_copy.SCORE_TOLERANCE`` of fp32's; ``"float32"`` with the router itself. Settable.
    """

    def __init__(self, graph_step: type[GraphStep] = CudaGraphStep, graph_devices: Sequence[str] = ("cuda",),
                 fuse: bool | str = True, router_dtype: str = "model") -> None:
        self.graph_step, self.graph_devices, self.fuse = graph_step, tuple(graph_devices), fuse
        self.router_dtype = router_dtype
        self.state: CapturedState | None = None
        self._lock = threading.Lock()
        self._holder: int | None = None
        self._warned: set[str] = set()

    def clear(self) -> None:
        """Forget the stored state (a call holding it keeps its own reference until it ends)."""
        self.state = None

    def captures_on(self, device) -> bool:
        """Whether a static-cache call without ``compile_config`` is captured on ``device``."""
        return device.type in self.graph_devices

    def lend(self, pair: RoutedPair, compile_config, batch: int, needed: int, fold: bool = False,
             rollback: int = 0) -> CapturedCalls | None:
        """Captured steps for one call, held by it until their ``close()``; None when the call runs eagerly.

        Args:
            pair: what the call routes with (the models, the router, what each model can do: ``abilities.py``).
            compile_config: the call's ``CompileConfig`` (None: ``graph_step``).
            batch, needed: the call's rows and longest sequence.
            fold: the call proposes the SLM's raw argmax, so its SLM reads score it too (``router_copy.py``).
            rollback: the most tokens the call's rollbacks cut the caches back by (``model_calls.make_cache``).
        """
        if self._holder == threading.get_ident():
            self._warn("R2R runs this call eagerly: a generate call of the same thread (a streamer that generates?) "
                       "holds the captured steps.")
            return None
        self._lock.acquire()
        self._holder = threading.get_ident()
        try:
            state = self._state_for(pair, compile_config, batch, needed)
        except BaseException:
            self._release()
            raise
        if state is None:
            self._release()
            return None
        return CapturedCalls(state, self._release, fold=fold, rollback=rollback, stepwise=pair.abilities.stepwise)

    def _release(self) -> None:
        self._holder = None
        self._lock.release()

    def _state_for(self, pair: RoutedPair, compile_config, batch: int, needed: int) -> CapturedState | None:
        slm, llm, router, able = pair.slm, pair.llm, pair.router, pair.abilities
        fuse = self.fuse if compile_config is None else False  # a compile_config compiles the whole read instead
        key = state_key(slm, llm, router, pair.num_topk, compile_config, batch, fuse, self.router_dtype)
        state = self.state
        moved = state is not None and state.weights != read_memory(slm, llm, router)  # replaced, not written
        if state is None or state.key != key or state.capacity < needed + SLACK or moved:
            self.state = None  # free the old caches and graphs before allocating new ones
            why_not = able.slm.static
            if why_not is not None:
                self._warn(f"R2R runs eagerly: the SLM cannot be captured ({why_not}).")
                return None
            llm_why_not = able.llm.static
            if llm_why_not is None and output_device(llm) != output_device(slm):
                llm_why_not = "it is on another device than the SLM"
            if llm_why_not is not None:
                self._warn(f"R2R captures the SLM's steps only: the LLM cannot be captured ({llm_why_not}).")
            fused = (regions_for(slm, fuse, able.slm.fuse), regions_for(llm, fuse, able.llm.fuse))
            state = CapturedState(slm, llm, router, pair.num_topk, self._capturer(compile_config, output_device(slm)),
                                  batch, needed + SLACK, capture_llm=llm_why_not is None, key=key, fused=fused,
                                  vocab=pair.vocab_size, router_dtype=self.router_dtype)
            self.state = state
        state.reset()
        return state

    def _capturer(self, compile_config, device):
        if compile_config is not None:
            return compiled(compile_config)
        step, pool = self.graph_step, self.graph_step.new_pool(device)
        return lambda fn, example: step(fn, example, pool)

    def _warn(self, message: str) -> None:
        if message not in self._warned:  # once per store and reason
            self._warned.add(message)
            logger.warning(message)


def choose_calls(pair: RoutedPair, generation_config: GenerationConfig, batch: int, needed: int,
                 store: CaptureStore | None, fold: bool = False, rollback: int = 0) -> ModelCalls:
    """The engine one call runs on, decided as HF decides to compile.

    Eager unless ``cache_implementation="static"`` and not ``disable_compile``; then captured
    through ``torch.compile`` when a ``compile_config`` is given, through the store's graphs on its
    graph devices (CUDA), and eager otherwise (or when the SLM cannot be captured). Captured steps
    must be closed when the call ends (``ModelCalls.close``).

    Args:
        pair: the models, the router and the logits it reads.
        generation_config: the call's generation config.
        batch: rows in the call.
        needed: the call's longest sequence (prompt + max_new_tokens).
        store: the model's ``CaptureStore``, or None to run eagerly.
        fold: the call proposes the SLM's raw argmax (``router_copy.proposal_is_argmax``).
        rollback: the most tokens the call's rollbacks cut its caches back by (0: it does not speculate:
            ``model_calls.make_cache``).
    """
    kind, compile_config = generation_config.cache_implementation, generation_config.compile_config
    eager = kind != "static" or generation_config.disable_compile or store is None
    if not eager and compile_config is None and not store.captures_on(output_device(pair.slm)):
        eager = True
    p = pair
    steps = None if eager else store.lend(p, compile_config, batch, needed, fold, rollback)
    return steps if steps is not None else EagerCalls(p.slm, p.llm, p.router, p.num_topk, kind, needed,
                                                      rollback=rollback, stepwise=p.abilities.stepwise)
