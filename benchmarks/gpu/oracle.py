"""An agreement oracle for timing runs (benchmarks only; nothing in r2r_hf imports it).

Random weights disagree everywhere: at a pending position the LLM's token is almost never the SLM's, so a
speculating run on them rolls back at every resolution, the worst case. A real pair agrees at 87.6 % of routed
positions (``benchmarks/serving/cost_model.AGREEMENT``). To time the paths a real pair walks
(resolutions that confirm several pending positions, rollbacks at some, the thrown tokens), the oracle replaces the
LLM's verdict at each pending position by a seeded draw that agrees with probability ``agreement``:

* **where it agrees**, the LLM's token there is the SLM's own token (the position is confirmed);
* **where it does not**, the LLM's token is the next id after the SLM's (``(t + 1) % vocab``): the row is cut back
  there and goes on from that token, as after a real rejection.

The seam is the chooser's ``verify`` (``core/choice.py``), wrapped per batch (``OracleChoice``): the LLM's read, the
real ``verify`` (its processors, its draw) and every later stage of the step run as they do; only the tokens
``verify`` hands back change. The draw is a pure function of (seed, answer index, the SLM's token there), computed
on the device (no host synchronisation is added) and on the host alike (``agrees``), so a test can say what answer
the verdicts imply. **An answer decoded under the oracle is not R2R's answer**: it is a timing stand-in, and every
result timed with it says so (``stamp``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from r2r_hf.core.batch import RunningBatch
from r2r_hf.core.staging import staged

AGREEMENT = 0.876  # the shipped pair's measured agreement at routed positions (113 of 129)
NOTE = ("timed with the agreement oracle (benchmarks/gpu/oracle.py): at each pending position the LLM's verdict was a "
        "seeded draw agreeing with probability {p}; the answers are a timing stand-in, not R2R's")
_MASK = 0x7FFFFFFF


def _mixed(seed, index, token):
    """A 31-bit hash of (seed, index, token): the same arithmetic for Python ints and int64 tensors (no product
    passes 2**62, so int64 never wraps)."""
    x = (seed * 0x9E3779B1 + index * 0x85EBCA77 + token * 0xC2B2AE3D) & _MASK
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK
    return x ^ (x >> 15)


def agrees(seed: int, agreement: float, index, token):
    """Whether the oracle agrees at answer ``index`` with the SLM's ``token`` there (ints, or tensors alike)."""
    return _mixed(seed, index, token) < round(agreement * 2**31)


def disagreeing(token, vocab: int):
    """The LLM's token where the oracle disagrees: the next id after the SLM's."""
    return (token + 1) % vocab


class OracleChoice:
    """A batch's chooser with the oracle's verdicts (see the module docstring); everything else is the chooser's.

    Args:
        inner: the batch's chooser.
        layout: the batch's layout (the SLM's committed tokens at the pending positions).
        agreement: the probability that the oracle agrees at a pending position.
        seed: the draw's seed.
    """

    def __init__(self, inner, layout, agreement: float, seed: int = 0) -> None:
        if not 0.0 <= agreement <= 1.0:
            raise ValueError(f"the oracle's agreement must be a probability in [0, 1], not {agreement}.")
        self.inner, self.layout, self.agreement, self.seed = inner, layout, agreement, seed

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def verify(self, logits: Mapping[int, torch.Tensor], indices: Mapping[int, list[int]],
               pending: Mapping[int, list]) -> dict[int, tuple[torch.Tensor, list[bool], list[Any]]]:
        """The chooser's ``verify`` (its work is paid), with each pending position's token the oracle's."""
        verified = self.inner.verify(logits, indices, pending)
        out = {}
        for r, (tokens, same, afters) in verified.items():
            index = [p.index for p in pending[r]]
            slm = self.layout.tokens_at(r, index).to(tokens.device)
            yes = agrees(self.seed, self.agreement, staged(index, tokens.device), slm)
            out[r] = (torch.where(yes, slm, disagreeing(slm, self.inner.vocab)), same, afters)
        return out


def install(batch, agreement: float, seed: int = 0) -> OracleChoice:
    """Put the oracle in front of ``batch``'s chooser (a running server's batch: ``engine.batch``)."""
    choice = batch.choice.inner if isinstance(batch.choice, OracleChoice) else batch.choice
    batch.choice = OracleChoice(choice, batch.layout, agreement, seed)
    return batch.choice


def remove(batch) -> None:
    """``batch``'s own chooser again."""
    if isinstance(batch.choice, OracleChoice):
        batch.choice = batch.choice.inner


@contextlib.contextmanager
def agreement_oracle(agreement: float = AGREEMENT, seed: int = 0) -> Iterator[None]:
    """Every running batch built while it lasts (each ``generate`` call's, a server started inside it) verifies
    through the oracle."""
    original = RunningBatch.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        install(self, agreement, seed)

    RunningBatch.__init__ = init
    try:
        yield
    finally:
        RunningBatch.__init__ = original


def stamp(result: dict, agreement: float, seed: int = 0) -> dict:
    """``result`` marked as timed with the oracle (what it stood in for, and that its answers are not R2R's)."""
    return {**result, "oracle": {"agreement": agreement, "seed": seed, "note": NOTE.format(p=agreement)}}
