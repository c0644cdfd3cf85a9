"""Where a running batch's rows keep their tokens and both models' caches, and how the models read them.

* ``rectangle.py``    HF's left-padded rectangle over HF's own caches (``generate``): every row commits a token at
                      every step and the LLM reads every row to the end whenever it runs. It computes exactly what
                      ``slm.generate``/``llm.generate`` compute, with every HF cache and attention implementation.
* ``model_calls.py``  the rectangle's model calls (the SLM's read, the router, the LLM's catch-up) as eager forwards;
                      the fast path (``core/fast``) offers the same calls captured.
* ``slot_layout.py``  one slot per row, each at its own length (the server): rows join, leave and wait for the LLM
                      independently, and the LLM reads only the rows asked for, each from where it last stopped.
* ``slot_cache.py``   the slots' KV cache, and one forward over a piece of several rows' new tokens.
* ``reads.py``        how a slot layout's models read (eagerly, captured padded, captured packed): its ``SlotPath``.

The running batch (``core/batch.py``) sees either through ``Layout``.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Layout(Protocol):
    """What the step asks of a layout (see the module docstring)."""

    # Draft blocks it runs (``fast/drafts.CapturedDrafts``), or None; whether its buffers are static (captured).
    drafts: object | None
    static: bool

    # The rows move in lockstep (HF's rectangle: one length for every row, so the LLM reads every row whenever it
    # runs, no row can wait for it, and a rollback cuts every row back), or each at its own pace (slots).
    lockstep: bool

    def append(self, rows: list[int], token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Commit ``token[r]`` [S] to each row of ``rows``; what was committed (a rectangle pads finished rows)."""

    def slm_read(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The SLM reads every committed token of ``rows`` it has not read: its logits [k, V] and post-norm hidden
        states [k, H] after each row's last token, and where the router is folded into the read, its scores [k] of
        each row's argmax proposal (else None)."""

    def llm_read(self, rows: list[int]) -> torch.Tensor:
        """The LLM does the same (its catch-up): its logits [k, V]."""

    def route(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """The router's scores [k] for the SLM's proposals ``token`` [k]."""

    def predict(self, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The LLM reads each row through the token before the last answer index ``needs[row]`` names; per row, the
        indices it predicts and its logits [n, V] there (a resolution: ``core/speculation.py``)."""

    def tokens_at(self, row: int, indices: list[int]) -> torch.Tensor:
        """[n] the row's committed answer tokens at ``indices``."""

    def keep(self, role: str, rows: list[int]) -> None:
        """Checkpoint ``role``'s state of ``rows`` where it has read them to, before it reads a token a rollback may cut
        (a recurrent state cannot be cut back otherwise: ``slot_state.py``)."""

    def cut(self, row: int, index: int) -> None:
        """The row back to its first ``index`` answer tokens, both models' caches with it (a rollback)."""

    def free(self, row: int) -> None:
        """Slot ``row`` holds no answer any more (a later one writes over it)."""

    def close(self) -> None:
        """The batch is done with the layout (captured calls go back to their store)."""
