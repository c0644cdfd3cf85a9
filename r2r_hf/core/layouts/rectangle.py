"""HF's left-padded rectangle: a generate call's committed tokens and the layout that decodes over them.

``Committed`` holds the tokens written so far in buffers allocated once per call; ``RectangleLayout`` is the
running batch's layout over them (``layouts/__init__.py``). The model calls themselves (the SLM's read, the router,
the LLM's catch-up) are ``model_calls.py``'s, eager, or captured by the fast path (``core/fast``), with the same
signatures. It is exactly what ``slm.generate``/``llm.generate`` compute, with every HF cache and attention
implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..counters import Counters
from ..features import positions_from_mask
from ..staging import staged


@dataclass
class Committed:
    """The committed sequence of a batch, in buffers of a fixed ``capacity`` allocated once per call.

    Args:
        ids: [B, capacity] token ids; only the first ``length`` columns are written.
        mask: [B, capacity] 1 for real tokens, 0 for left padding (ones past the prompt).
        positions: [B, capacity] position ids, continuing from each row's last prompt position.
        length: columns committed so far.
        padded: whether any prompt row is padded; when not, eager forwards pass no mask (as HF does).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    length: int
    padded: bool

    @classmethod
    def from_prompt(
        cls, input_ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None, capacity: int
    ) -> Committed:
        """Buffers of width ``capacity`` holding the prompt (``mask``/``positions`` as HF prepared them; without
        positions, each row's count from its first real token, as ``slm.generate`` counts them)."""
        batch, prompt = input_ids.shape
        ids = input_ids.new_zeros(batch, capacity)
        ids[:, :prompt] = input_ids
        if positions is None and mask is not None:
            positions = positions_from_mask(mask)
        elif positions is None:
            positions = torch.arange(prompt, device=input_ids.device).expand(batch, prompt)
        pos = input_ids.new_zeros(batch, capacity)
        pos[:, :prompt] = positions
        pos[:, prompt:] = positions[:, -1:] + torch.arange(1, capacity - prompt + 1, device=input_ids.device)
        full_mask = input_ids.new_ones(batch, capacity)
        if mask is not None:
            full_mask[:, :prompt] = mask
        return cls(ids, full_mask, pos, prompt, padded=mask is not None)

    def view(self) -> torch.Tensor:
        """[B, length]: the committed ids."""
        return self.ids[:, : self.length]

    def mask_upto(self, end: int) -> torch.Tensor | None:
        """The mask over the first ``end`` columns, or None when nothing is padded."""
        return self.mask[:, :end] if self.padded else None

    def append(self, token: torch.Tensor) -> None:
        self.ids[:, self.length] = token
        self.length += 1


class ModelCalls(Protocol):
    """The three model calls a rectangle runs, over caches of their own (``model_calls.EagerCalls``; the fast
    path's ``fast/static_reads.CapturedCalls``):

    * ``slm_read(seq, start)``  the SLM reads ``seq[start:]``: its next-token logits and post-norm hidden state;
    * ``route_scores(logits, hidden, token)``  the router's scores for the SLM's proposed tokens;
    * ``llm_read(seq, start)``  the LLM catches up on ``seq[start:]`` in one forward: its next-token logits.

    ``close()`` ends the call's use of them (captured calls go back to their store).
    """

    capacity: int  # columns the call's buffers and caches hold

    def slm_read(self, seq: Committed, start: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def route_scores(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor: ...

    def llm_read(self, seq: Committed, start: int) -> torch.Tensor: ...

    def llm_predict(self, seq: Committed, start: int, end: int, keep: list[int]) -> torch.Tensor: ...

    def keep(self, role: str) -> None: ...

    def crop(self, slm_tokens: int, llm_tokens: int, restore: tuple[str, ...] = ()) -> None: ...

    def close(self) -> None: ...


class RectangleLayout:
    """HF's left-padded rectangle over HF's own caches: every row commits at every step, and the LLM reads every
    row to the end whenever it runs (one cache length for the batch).

    Args:
        calls: the model calls over HF caches (``Routing.calls``: eager, compiled or captured).
        seq: the committed buffers, holding the prompt.
        counters: where forwards are counted.
        pad: the token a finished row commits (HF pads finished rows), or None.
        recurrent: the models ("slm", "llm") with recurrent or convolution layers, whose state a rollback puts back to
            a checkpoint (``keep``) and reads again from there.
    """

    lockstep = True
    drafts = None  # (a rectangle's steps are not drafted in blocks: ``RunningBatch.draft``)
    static = False  # (its caches are HF's, sized per call)

    def __init__(self, calls: ModelCalls, seq: Committed, counters: Counters, pad: torch.Tensor | None = None,
                 recurrent: frozenset[str] = frozenset()) -> None:
        self.calls, self.seq, self.counters, self.pad, self.recurrent = calls, seq, counters, pad, recurrent
        self.kept: dict[str, int] = {}  # the column each recurrent model's checkpoint stands at
        self.slm_seen = 0  # columns the SLM has read
        self.llm_seen = 0  # columns the LLM has read (one lag: it reads every row to the end)
        self.rows = seq.ids.shape[0]
        self.prompt = seq.length  # columns of the prompt: an answer index i is column prompt + i

    def append(self, rows: list[int], token: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
        """Commit ``token`` [B] (the pad where a row is no longer ``running``); what was committed."""
        if len(rows) != self.rows:
            raise ValueError("every row of a rectangle commits a token at every step")
        if self.pad is not None:
            token = torch.where(running, token, self.pad)
        self.seq.append(token)
        return token

    def slm_read(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, None]:
        start, self.slm_seen = self.slm_seen, self.seq.length
        self.counters.forward("slm", self.rows, self.seq.length - start)
        return (*self.calls.slm_read(self.seq, start), None)  # (a captured call folds its router in itself)

    def llm_read(self, rows: list[int]) -> torch.Tensor:
        """Every row's logits [B, V] (the rectangle catches every row up)."""
        self.counters.forward("llm", self.rows, self.seq.length - self.llm_seen)
        logits = self.calls.llm_read(self.seq, self.llm_seen)
        self.llm_seen = self.seq.length
        return logits

    def route(self, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return self.calls.route_scores(logits, hidden, token)

    def free(self, row: int) -> None:
        pass  # the rectangle's rows end together with the call

    def row_ids(self, row: int, index: int | None = None) -> torch.Tensor:
        """[B, L] what HF's processors see: the whole rectangle (through its prompt and ``index`` answer tokens)."""
        return self.seq.ids[:, : self.seq.length if index is None else self.prompt + index]

    def tokens_at(self, row: int, indices: list[int]) -> torch.Tensor:
        return self.seq.ids[row, staged([self.prompt + i for i in indices], self.seq.ids.device)]

    def keep(self, role: str, rows: list[int]) -> None:
        """Checkpoint ``role``'s recurrent states where it has read to (every row: they are cut back together, so the
        caller keeps before the first pending token of any row: ``RunningBatch.commit``)."""
        if rows and role in self.recurrent:
            self.calls.keep(role)
            self.kept[role] = self.slm_seen if role == "slm" else self.llm_seen

    def cut(self, row: int, index: int) -> None:
        """Every row back to its first ``index`` answer tokens (one length for the batch: ``row`` is any of them); a
        recurrent model that read past them goes back to its checkpoint and reads again from there."""
        end = self.prompt + index
        if end >= self.seq.length:
            return
        seen = {"slm": self.slm_seen, "llm": self.llm_seen}
        back = {role: self._checkpoint(role, end) if role in self.recurrent else end
                for role, at in seen.items() if at > end}
        self.calls.crop(seen["slm"] - back.get("slm", seen["slm"]), seen["llm"] - back.get("llm", seen["llm"]),
                        tuple(role for role in back if role in self.recurrent))
        self.seq.length, self.slm_seen, self.llm_seen = end, back.get("slm", self.slm_seen), back.get("llm",
                                                                                                      self.llm_seen)

    def _checkpoint(self, role: str, end: int) -> int:
        """Where ``role``'s checkpoint stands: at or before ``end``, else the rollback cannot be exact (raised)."""
        column = self.kept.get(role)
        if column is None or column > end:
            raise RuntimeError(f"the {role.upper()}'s recurrent state was cut back to column {end} without a "
                               f"checkpoint at or before it ({column})")
        return column

    def predict(self, needs: dict[int, list[int]]) -> dict[int, tuple[list[int], torch.Tensor]]:
        """The LLM reads every row through the token before the last needed answer index; for every row, the indices
        any row needs (one length for the batch) and the logits [n, V] predicting each."""
        wanted = sorted({i for indices in needs.values() for i in indices})
        end = self.prompt + wanted[-1]
        self.counters.forward("llm", self.rows, end - self.llm_seen)
        logits = self.calls.llm_predict(self.seq, self.llm_seen, end, [self.prompt + i - 1 for i in wanted])
        self.llm_seen = end
        return {r: (wanted, logits[r]) for r in range(self.rows)}

    def close(self) -> None:
        self.calls.close()
