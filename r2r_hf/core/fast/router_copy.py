"""The router as the captured path runs it: in the models' dtype, and folded into the SLM's read.

Two choices, each behind its guard, each measured (benchmarks/results/captured_steps.md, docs/fast_path.md):

* **dtype.** With ``CaptureStore.router_dtype = "model"`` the captured steps score with a copy of the router in
  the SLM's dtype (bf16 on a GPU): half the weight reads of the fp32 router (the paper's 1024 x 6 router at the
  1.5B's widths has 56M parameters, 225 MB read per step in fp32). In ``generate`` the copy follows the router:
  before every call its values are copied in again, into the same memory, so the captured graphs stay valid and
  new weights are never scored stale. The server copies once, when it captures at start-up: a router changed
  while it serves needs a restart. Guard: a state's first call scores its own features with both; where they
  differ by more than ``SCORE_TOLERANCE`` (or the copy gives NaN) the state keeps the fp32 router, said once per
  router. A state is checked once; ``capture_store.clear()`` checks again.
* **fold.** Where a call's proposal is the SLM's raw argmax (greedy, no logits processors: decided on the host
  from the call's settings), the SLM's captured read also proposes and scores: one captured step per decoding
  step instead of two. Elsewhere (sampling, processors) the proposal exists only after the choice, so the
  router stays its own captured step.

Neither applies to a router with per-step state (one that overrides ``Router.step``): its ``step`` updates its
own buffers right before it scores, which a copy would not see and a score taken in the previous step's read
would precede.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Sized

import torch
from torch import nn

from ...router import Router
from ..layouts.model_calls import route_scores
from .graphs import Step

logger = logging.getLogger(__name__)

# Largest |score difference| between the router in the models' dtype and in fp32 on a call's own features for
# the cast copy to be used. On the shipped router's held-out labels bf16 scores moved by at most 0.0085 and the
# AUC by +0.00003 (benchmarks/results/router_dtype.json), so a router further off is one bf16 does not suit.
SCORE_TOLERANCE = 0.02
ROUTER_DTYPES = ("float32", "model")
_SAID: weakref.WeakKeyDictionary[nn.Module, set[torch.dtype]] = weakref.WeakKeyDictionary()  # warned about


def stateless(router: nn.Module) -> bool:
    """Whether ``router`` keeps no per-step state (its ``step`` is the interface's no-op), so it may be copied or
    scored ahead of its step."""
    return type(router).step is Router.step if isinstance(router, Router) else True


def proposal_is_argmax(do_sample: bool, processors) -> bool:
    """Whether a call's proposal is the SLM's raw argmax: greedy and no processor that could move it."""
    return not do_sample and isinstance(processors, Sized) and len(processors) == 0  # a bare callable may move it


def folded(read: Step, slm: nn.Module, router: nn.Module, k: int, vocab: int) -> Step:
    """``read`` (-> logits [B, V], hidden [B, H]) followed by the router on the argmax proposal: -> + scores [B]."""

    def read_and_route(**inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, hidden = read(**inputs)
        token = logits[:, :vocab].argmax(-1)  # the first maximum, as the choice's argmax takes it
        return logits, hidden, route_scores(slm, router, k, logits, hidden, token)

    return read_and_route


class RouterCopy:
    """A copy of ``router`` in ``dtype`` that the captured steps score with (see the module docstring).

    ``module`` is the copy; ``refresh()`` copies the router's current values into it (the same memory, so graphs
    captured over it stay valid). Every value, every time: a version counter misses writes through ``.data``
    (EMA and weight-loading code do that), and one cast copy is cheap beside a call (the paper's router: 113 MB).
    """

    def __init__(self, router: nn.Module, dtype: torch.dtype) -> None:
        self.router, self.dtype = router, dtype
        self.module = copy.deepcopy(router).to(dtype).train(router.training)

    def refresh(self) -> None:
        mine = (*self.module.parameters(), *self.module.buffers())
        theirs = (*self.router.parameters(), *self.router.buffers())
        if len(mine) != len(theirs) or any(m.shape != t.shape for m, t in zip(mine, theirs)):
            raise ValueError("The router's parameters changed shape after its steps were captured; call "
                             "model.capture_store.clear() after replacing the router's modules.")
        with torch.inference_mode():  # the copy may have been made in inference mode (the server captures there)
            for m, t in zip(mine, theirs):
                m.copy_(t)
        self.module.train(self.router.training)


def router_copy(router: nn.Module, slm_dtype: torch.dtype, setting: str) -> RouterCopy | None:
    """The cast copy the captured steps use under ``setting``, or None where they use the router itself."""
    if setting not in ROUTER_DTYPES:
        raise ValueError(f"router_dtype must be one of {', '.join(ROUTER_DTYPES)}, got {setting!r}.")
    weights = next(iter(router.parameters()), None)
    if setting == "float32" or weights is None or not stateless(router):
        return None
    if not slm_dtype.is_floating_point or slm_dtype.itemsize >= weights.dtype.itemsize:
        return None  # a copy only ever reads fewer bytes: a router already as narrow scores as it is
    return RouterCopy(router, slm_dtype)


class Scorer:
    """What captured steps score with (``generate``'s state and the server's router step each hold one): the copy
    of ``router`` that ``setting`` asks for until the first real features check it, else the router itself."""

    def __init__(self, router: nn.Module, slm_dtype: torch.dtype, setting: str) -> None:
        self.router, self.cast = router, router_copy(router, slm_dtype, setting)
        self.checked = self.cast is None  # nothing to check

    @property
    def module(self) -> nn.Module:
        """The router to score with: the cast copy, or the router itself."""
        return self.cast.module if self.cast is not None else self.router

    def refresh(self) -> None:
        """The copy takes the router's current values (``RouterCopy.refresh``)."""
        if self.cast is not None:
            self.cast.refresh()

    def check(self, slm: nn.Module, k: int, features: tuple[torch.Tensor, ...] | None) -> bool:
        """Once, before anything scores: keep the copy where it scores ``features`` (logits, hidden, token) within
        the tolerance, else drop it (also with no features at all). True when it was dropped: steps captured over
        it must be captured again."""
        if self.checked:
            return False
        self.checked = True
        if features is not None and keeps_cast(slm, self.cast, k, *features):
            return False
        self.cast = None
        return True


def keeps_cast(slm: nn.Module, cast: RouterCopy, k: int, logits: torch.Tensor, hidden: torch.Tensor,
               token: torch.Tensor) -> bool:
    """Whether ``cast`` scores these features within ``SCORE_TOLERANCE`` of its router (one host read); where it
    does not, says so: the caller then scores with the router itself."""
    with torch.no_grad():
        want = route_scores(slm, cast.router, k, logits, hidden, token)
        got = route_scores(slm, cast.module, k, logits, hidden, token)
    worst = float((got.float() - want.float()).abs().max())
    if worst <= SCORE_TOLERANCE:  # NaN (a copy that overflowed) fails here too
        return True
    said = _SAID.setdefault(cast.router, set())
    if cast.dtype not in said:  # once per router and dtype, however often its states are rebuilt
        said.add(cast.dtype)
        logger.warning("R2R scores with the router in float32: in %s its scores moved by %.3f (more than %.2f).",
                       str(cast.dtype).removeprefix("torch."), worst, SCORE_TOLERANCE)
    return False
