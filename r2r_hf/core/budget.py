"""An LLM budget per answer: "at most a share b of this answer's tokens from the LLM", kept online.

A threshold is the paper's knob, but the share of tokens it routes depends on the text (the shipped
router's threshold routes 8 % of HumanEval's tokens and 18 % of its calibration answers). A budget
says what an operator pays for. For each row, at the step that writes its t-th token:

* **never more**: the LLM may write it only while the row's LLM tokens so far are fewer than b * t,
  so after any t tokens at most ceil(b * t) came from the LLM. The first token is the allowance this
  leaves at the start: ceil(b * 1) = 1 for any b > 0, so a 3-token answer may hold 1 LLM token;
* **spent where the router is surest**: and only where the proposal's router score ranks in the top
  b share of the scores this answer has seen so far (fewer than b * t earlier scores are higher), an
  online quantile of the answer's own scores, so an answer whose early tokens are easy does not spend
  its budget on the first ones that pass the threshold and have none left where it is needed;
* **with the threshold**: a row routes only where both its threshold and its budget allow.

b = 0 routes nothing (``slm.generate``); b = 1 with threshold 0 routes everything (``llm.generate``):
fewer than t of t tokens and fewer than t higher scores hold at every step. Rows without a budget
carry b = inf (always allowed). The state is per row, so rows of a batch keep their own budgets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# b * t is compared with integer counts; a float64 product may land a hair above an exact integer
# (0.07 * 100 = 7.000000000000001), which would let one token more through. The margin is relative, so
# it absorbs that rounding (~1e-16 of the product) and still leaves any b > 0 its first token.
_SHRINK = 1 - 1e-12


def cap(share, t):
    """What a row's LLM tokens (and higher earlier scores) must stay below for the LLM to write its t-th token.

    b * t, less float rounding; works on floats and tensors alike (the benchmarks re-check answers with it).
    """
    return share * t * _SHRINK


def check_budget(value: object) -> float:
    """An LLM budget as a float in [0, 1]; anything else is refused in one sentence."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"llm_budget must be a share of the answer's tokens between 0 and 1, got {value!r}.")
    return float(value)


@dataclass
class Budget:
    """The budget state of a batch's rows between steps.

    Args:
        share: [B] float64, each row's budget b (inf: no budget).
        used: [B] the row's tokens written by the LLM so far.
        seen: [B] the row's tokens generated so far.
        history: [B, N] the router scores of those tokens (NaN past ``seen``), sized at the start for the
            longest answer (no host sync per step to grow it).
        kept: rows that keep a budget (the others spend none; the server's rows without one carry b = inf).
        log: step -> (used, seen) after that step, while rows speculate (a rollback restores a row's from the step
            that committed the token it is cut back to).
    """

    share: torch.Tensor
    used: torch.Tensor
    seen: torch.Tensor
    history: torch.Tensor
    kept: set[int] = field(default_factory=set)
    log: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def start(cls, share: torch.Tensor | float, rows: int, columns: int, device: torch.device,
              kept: set[int] | None = None) -> Budget:
        """A fresh state for ``rows`` rows (``share`` one value or one per row) with room for ``columns`` tokens;
        ``kept``: the rows that keep it (None: every row)."""
        kept = set(range(rows)) if kept is None else kept
        share = torch.as_tensor(share, dtype=torch.float64, device=device).expand(rows).clone()
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return cls(share, zeros, zeros.clone(), torch.full((rows, max(columns, 1)), math.nan, device=device), kept)

    def allows(self, scores: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[k] bool: where the LLM may write the next token of rows ``rows`` (all when None) whose router scores
        are ``scores`` [k]."""
        share, used, seen, history = self._of(rows)
        t = (seen + 1).double()
        limit = cap(share, t)
        earlier = torch.arange(history.shape[1], device=history.device) < seen[:, None]
        higher = ((history > scores[:, None].to(history.dtype)) & earlier).sum(-1)
        return (used.double() < limit) & (higher.double() < limit)

    def spend(self, scores: torch.Tensor, routed: torch.Tensor, running: torch.Tensor,
              rows: torch.Tensor | None = None) -> None:
        """Record one step of rows ``rows`` (all when None): running ones saw ``scores`` [k] and the LLM writes
        where ``routed`` [k] (a token that waits for the LLM is spent when it is routed).

        ``history`` was sized for every row's longest answer, so no running row is past its end.
        """
        _, used, seen, history = self._of(rows)
        column = seen.clamp(max=history.shape[1] - 1)[:, None]
        kept = history.gather(1, column)[:, 0]
        history.scatter_(1, column, torch.where(running, scores.to(history.dtype), kept)[:, None])
        used = used + (routed & running).long()
        seen = seen + running.long()
        if rows is None:
            self.history, self.used, self.seen = history, used, seen
        else:
            self.history[rows], self.used[rows], self.seen[rows] = history, used, seen

    def remember(self, step: int, speculating: bool, oldest: int) -> None:
        """While rows that keep a budget may be cut back (``speculating``), keep the state after ``step``; forget the
        states of steps before ``oldest`` (no rollback reaches them)."""
        if not self.kept or not speculating:
            self.log.clear()
            return
        self.log[step] = (self.used.clone(), self.seen.clone())
        self.log = {s: state for s, state in self.log.items() if s >= oldest}

    def restore(self, row: int, step: int) -> None:
        """Row ``row``'s state back to where it stood after step ``step`` (a row that keeps no budget has none)."""
        if row in self.kept:
            used, seen = self.log[step]
            self.used[row], self.seen[row] = used[row], seen[row]

    def _of(self, rows: torch.Tensor | None):
        if rows is None:
            return self.share, self.used, self.seen, self.history
        return self.share[rows], self.used[rows], self.seen[rows], self.history[rows]

    # -------------------------------------------------- rows joining and leaving (the server's slots)
    def place(self, row: int, share: float, columns: int) -> None:
        """Slot ``row`` starts a new answer of at most ``columns`` tokens with budget ``share`` (inf: none)."""
        if columns > self.history.shape[1]:
            pad = columns - self.history.shape[1]
            self.history = torch.nn.functional.pad(self.history, (0, pad), value=math.nan)
        self.share[row], self.used[row], self.seen[row] = share, 0, 0
        self.history[row] = math.nan
        if math.isfinite(share):
            self.kept.add(row)
        else:
            self.kept.discard(row)

    def grow(self, rows: int) -> None:
        """Room for ``rows`` slots (new ones hold no answer)."""
        extra = rows - self.share.shape[0]
        if extra > 0:
            self.share = torch.cat([self.share, self.share.new_full((extra,), math.inf)])
            self.used = torch.cat([self.used, self.used.new_zeros(extra)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(extra)])
            self.history = torch.cat([self.history, self.history.new_full((extra, self.history.shape[1]), math.nan)])
