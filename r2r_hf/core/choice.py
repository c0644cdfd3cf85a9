"""How each row's token is chosen from a model's logits: HF's processors, then the argmax or a draw.

Both models' tokens go through the same choice, so a row routed to the LLM is processed and drawn exactly as
the LLM's own ``generate`` would process and draw it (``sampling.py`` keeps the random stream exact).

* ``CallChoice`` is one ``generate`` call's: HF's processor list over the whole left-padded batch (what HF's
  own loop passes it) and one draw for the batch. Where the LLM writes, the batch's stream is rewound to
  where the SLM's draw started and the whole batch is drawn again from the LLM's scores, as ``llm.generate``
  draws; the rows the SLM writes keep the SLM's token.
* ``RowChoice`` is the server's: each row has its own processors (built from its own generation settings:
  ``model/row_settings.py``) that see only that row's tokens, and its own random stream, which advances by that
  row's draws only. Where the LLM writes a row, only that row's stream is rewound and drawn again. A row
  answers what it answers alone, whatever its neighbours do, and a row whose scores hold no probability
  (every score -inf or NaN) is flagged instead of failing the batch.

Both are ``Chooser``s: the step (``step.py``) asks them for the streams' states, proposals, the LLM's redraw and
the rows whose draw failed, and never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .sampling import Sampler, _widened
from .staging import in_order, staged

# HF's LogitsProcessorList, or any callable of the same shape: (ids [B, L], logits [B, V]) -> scores [B, V].
Processors = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Chooser(Protocol):
    """How a running batch's rows turn logits into tokens (see the module docstring)."""

    vocab: int  # ids both models can write

    def state(self, rows: list[int]) -> Mapping[int, Any]:
        """Where each row's random stream stands (None or absent: greedy), taken before its draw."""

    def propose(self, logits: torch.Tensor, rows: list[int],
                at: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(processed scores, tokens, whether each draw had a probability or None: none can fail) for ``rows``, row
        ``rows[i]``'s logits at ``at[i]`` of ``logits`` (None: at i, the outputs are [k]); with ``at`` the outputs
        cover every row of ``logits``, and the entries of the others are no proposals (none of them draws)."""

    def redraw(self, logits: torch.Tensor, rows: list[int], writers: list[int],
               states: Mapping[int, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The LLM's choice for ``writers`` from the logits [r, V] of ``rows``, each stream rewound to ``states``."""

    def verify(self, logits: Mapping[int, torch.Tensor], indices: Mapping[int, list[int]],
               pending: Mapping[int, list]) -> dict[int, tuple[torch.Tensor, list[bool], list[Any]]]:
        """The LLM's choice at each pending position (``speculation.py``), as R2R would have made it there: through
        the row's processors over its prefix up to that position, drawn from its stream as it stood before the
        SLM's draw. ``logits[r]`` [n, V] predicts the answer indices ``indices[r]``; ``pending[r]`` lists the row's
        ``rows.Pending``. Per row: (the LLM's tokens [m], whether its stream after each draw stands where it stood
        after the SLM's, the stream after each draw). The streams are left as they were."""

    def restore(self, row: int, state: Any) -> None:
        """Row ``row``'s stream stands at ``state`` (a rollback; None: greedy)."""

    def argmax(self, rows: list[int]) -> bool:
        """Whether each of ``rows`` proposes the raw argmax of the SLM's logits (greedy, no processors): the router's
        scores of that proposal may then come from the SLM's read (``fast/router_copy.folded``)."""

    def flags(self) -> torch.Tensor | None:
        """[S] rows whose last LLM draw failed (read in the next synchronisation), or None: none can fail."""

    def flag(self, rows: torch.Tensor | None, ok: torch.Tensor | None) -> None:
        """Record which of ``rows`` (None: every slot) drew from a probability (``ok``) in the LLM's redraw."""

    def set(self, row: int, rule: RowRule | None) -> None:
        """Slot ``row`` chooses by ``rule`` from now on (None: it is free)."""


def _scores(logits: torch.Tensor, vocab: int, processors: Processors | None = None) -> torch.Tensor:
    """Float32 copies of the logits over the shared vocabulary (the processors may write in place); with
    ``processors`` given and empty, no copy where the logits are float32 already (nothing writes)."""
    return logits[:, :vocab].to(dtype=torch.float32, copy=processors is None or not _none(processors))


def _none(processors: Processors) -> bool:
    """Whether a processor list is empty (a bare callable may do anything)."""
    return isinstance(processors, Sized) and len(processors) == 0


class CallChoice:
    """One generate call's choice (see the module docstring).

    Args:
        processors: HF's processor list of the call.
        sampler: the call's argmax or draw (global stream, or the call's seeded generator).
        vocab: ids both models can write.
        ids: gives the [B, L] committed ids HF's processors see (``ids(index)``: through ``index`` answer tokens).
    """

    def __init__(self, processors: Processors, sampler: Sampler, vocab: int, ids) -> None:
        self.processors, self.sampler, self.vocab, self.ids = processors, sampler, vocab, ids

    def state(self, rows: list[int]) -> dict[int, Any]:
        state = self.sampler.state()  # one stream for the call: every row's is the same
        return {r: state for r in rows}

    def propose(self, logits: torch.Tensor, rows: list[int], at=None) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(processed scores [B, V], tokens [B], None) for every row of the batch (``rows`` and ``at``: all of them)."""
        ids = self.ids()
        scores = self.processors(ids, _scores(logits, self.vocab, self.processors).to(ids.device))
        return scores, self.sampler.pick(scores, width=logits.shape[-1]), None

    def redraw(self, logits: torch.Tensor, rows: list[int], writers: list[int], states) -> tuple:
        """The LLM's choice in the SLM's place: the whole batch drawn again from the state the SLM's draw started
        at (as ``llm.generate`` draws), of which ``writers`` keep theirs. Outputs are the writers', in order."""
        if len(rows) != len(self.ids()):
            raise ValueError("a generate call's LLM reads every row of its batch")
        if len({id(states[w]) for w in writers}) > 1:
            raise ValueError("a generate call's rows share one stream: the LLM writes them in the step they route")
        self.sampler.restore(states[writers[0]])
        scores, tokens, _ = self.propose(logits, rows)
        if len(writers) == len(rows):  # every row writes (a batch of one always does)
            return scores, tokens, None
        picked = staged(writers, tokens.device)
        return scores[picked], tokens[picked], None

    def verify(self, logits: Mapping[int, torch.Tensor], indices: Mapping[int, list[int]],
               pending: Mapping[int, list]) -> dict[int, tuple[torch.Tensor, list[bool], list[Any]]]:
        """As ``Chooser.verify``, over the whole rectangle at each pending column (HF's processors see the batch;
        every row's logits predict the same indices). With sampling the call holds one row (one stream)."""
        saved, rows = self.sampler.state(), sorted(logits)
        at = {i: n for n, i in enumerate(indices[rows[0]])}
        drawn: dict[int, tuple[torch.Tensor, bool, Any]] = {}
        for index in sorted({p.index for ps in pending.values() for p in ps}):
            scores = torch.stack([logits[r][at[index]] for r in rows])
            before = next(p for ps in pending.values() for p in ps if p.index == index)
            self.sampler.restore(before.before)
            scores = self.processors(self.ids(index), _scores(scores, self.vocab).to(scores.device))
            tokens = self.sampler.pick(scores, width=logits[rows[0]].shape[-1])
            after = self.sampler.state()
            drawn[index] = (tokens, after is None or torch.equal(after, before.after), after)
        self.sampler.restore(saved)
        return {r: (torch.stack([drawn[p.index][0][r] for p in ps]), [drawn[p.index][1] for p in ps],
                    [drawn[p.index][2] for p in ps]) for r, ps in pending.items()}

    def restore(self, row: int, state: Any) -> None:
        self.sampler.restore(state)

    def argmax(self, rows: list[int]) -> bool:
        return not self.sampler.do_sample and _none(self.processors)

    def flags(self) -> None:
        return None  # an argmax or a batch draw over HF's processors fails loudly, as HF's own would

    def flag(self, rows: torch.Tensor, ok: torch.Tensor | None) -> None:
        pass

    def set(self, row: int, rule: RowRule | None) -> None:
        pass  # the call's rows share its processors and stream: nothing per row to keep or forget


@dataclass(frozen=True)
class RowRule:
    """One row's choice: its HF processors and its random stream (None: greedy)."""

    processors: Processors
    generator: torch.Generator | None
    batched: bool  # the processors ignore the ids (warpers only): rows with equal settings run as one batch
    key: tuple = ()  # rows with the same key and ``batched`` share one processor call


class RowChoice:
    """Per-row choice over slots (see the module docstring).

    Args:
        vocab: ids both models can write.
        row_ids: gives one row's [1, L] committed ids.
        slots: rows the batch can hold.
        device: where the scores live.
    """

    def __init__(self, vocab: int, row_ids, slots: int, device: torch.device) -> None:
        self.vocab, self.row_ids, self.device = vocab, row_ids, device
        self.rules: list[RowRule | None] = [None] * slots
        self.bad = torch.zeros(slots, dtype=torch.bool, device=device)  # rows whose scores held no probability

    def grow(self, slots: int) -> None:
        self.rules += [None] * (slots - len(self.rules))
        self.bad = torch.cat([self.bad, self.bad.new_zeros(slots - len(self.bad))]) if slots > len(self.bad) else self.bad

    def set(self, row: int, rule: RowRule | None) -> None:
        self.rules[row] = rule
        self.bad[row] = False

    def state(self, rows: list[int]) -> dict[int, torch.Tensor]:
        return {r: self.rules[r].generator.get_state() for r in rows if self.rules[r].generator is not None}

    def verify(self, logits: Mapping[int, torch.Tensor], indices: Mapping[int, list[int]],
               pending: Mapping[int, list]) -> dict[int, tuple[torch.Tensor, list[bool], list[Any]]]:
        """As ``Chooser.verify``, each row through its own processors and stream."""
        out = {}
        for r, ps in pending.items():
            rule, at = self.rules[r], {i: n for n, i in enumerate(indices[r])}
            generator = rule.generator
            saved = None if generator is None else generator.get_state()
            tokens, same, afters = [], [], []
            for p in ps:
                scores = rule.processors(self.row_ids(r, p.index), _scores(logits[r][at[p.index]][None], self.vocab))
                if generator is None:
                    tokens.append(scores[0].argmax(-1))
                    same.append(True)
                    afters.append(None)
                    continue
                generator.set_state(p.before)
                token, ok = _safe_draw(scores[0], logits[r].shape[-1], generator)
                afters.append(generator.get_state())
                tokens.append(token)
                same.append(torch.equal(afters[-1], p.after))
                self.bad[r] |= ~ok  # no probability to draw from: the row fails (read in the next synchronisation)
            if generator is not None:
                generator.set_state(saved)
            out[r] = (torch.stack(tokens), same, afters)
        return out

    def restore(self, row: int, state: Any) -> None:
        if state is not None:
            self.rules[row].generator.set_state(state)

    def argmax(self, rows: list[int]) -> bool:
        return all(self.rules[r].generator is None and _none(self.rules[r].processors) for r in rows)

    def flags(self) -> torch.Tensor:
        return self.bad

    def flag(self, rows: torch.Tensor | None, ok: torch.Tensor | None) -> None:
        if ok is not None:
            if rows is None:
                self.bad.copy_(~ok)
            else:
                self.bad[rows] = ~ok

    def propose(self, logits: torch.Tensor, rows: list[int],
                at: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """As ``Chooser.propose``, each row through its own processors and stream. Where every row is greedy without
        processors the proposals are the argmax of the logits themselves (no float32 copy; ok None: none fails)."""
        at = range(len(rows)) if at is None else at
        rules = [self.rules[r] for r in rows]
        if all(rule.generator is None and _none(rule.processors) for rule in rules):
            scores = logits[:, : self.vocab].to(self.device)  # (the argmax of a float32 copy is the same token)
            return scores, scores.argmax(-1), None
        scores = _scores(logits, self.vocab).to(self.device)
        groups: dict[tuple, tuple[int, list[int]]] = {}
        for i, r, rule in zip(at, rows, rules):
            if rule.batched:
                groups.setdefault(rule.key, (r, []))[1].append(i)
            else:  # processors that read the ids see this row's own tokens only
                scores[i : i + 1] = rule.processors(self.row_ids(r), scores[i : i + 1])
        for first, members in groups.values():
            rule = self.rules[first]
            if not _none(rule.processors):  # (an empty list returns the scores as they are)
                index = staged(members, self.device)
                scores[index] = rule.processors(self.row_ids(first), scores[index])
        tokens, ok = scores.argmax(-1), torch.ones(len(scores), dtype=torch.bool, device=self.device)
        for i, rule in zip(at, rules):
            if rule.generator is not None:
                tokens[i], ok[i] = _safe_draw(scores[i], logits.shape[-1], rule.generator)
        return scores, tokens, ok

    def redraw(self, logits: torch.Tensor, rows: list[int], writers: list[int], states) -> tuple:
        """The LLM's choice for ``writers`` (a subset of ``rows``, whose logits [k, V] these are): each writer's
        stream rewound to where its SLM draw started, then drawn from the LLM's scores."""
        at = {r: i for i, r in enumerate(rows)}
        picked = [at[r] for r in writers]
        for r in writers:
            if states.get(r) is not None:
                self.rules[r].generator.set_state(states[r])
        if not in_order(picked):  # (the LLM reads its writers only, in order, unless it also resolves rows)
            logits = logits.index_select(0, staged(picked, logits.device))
        return self.propose(logits[: len(writers)], writers)


def _safe_draw(scores: torch.Tensor, width: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's draw, and whether its scores held a probability; never raises on the device (no host check).

    Where they did not (all -inf, NaN), the draw is taken from a uniform stand-in and the row is flagged:
    multinomial on NaN would fail the whole batch (on CUDA, with a device-side assert).
    """
    probs = _widened(scores[None], width).softmax(-1)
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    probs = torch.where(ok, torch.nan_to_num(probs, nan=0.0), torch.ones_like(probs))
    return torch.multinomial(probs, num_samples=1, generator=generator)[0, 0], ok


def batched_processors(processors: Sequence) -> bool:
    """Whether a processor list reads only the scores (HF's sampling warpers), so rows may share one call."""
    from transformers import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    pure = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper)
    return all(type(p) in pure for p in processors)
