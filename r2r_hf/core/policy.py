"""When the LLM runs: at once for every routed row, or once several routed rows wait for it.

One LLM forward costs about the same for 1 or 16 rows on a GPU (it reads the weights), and 10-20x an SLM
step. In a batch whose LLM runs whenever any row routes, it runs on 1 - (1 - p)^B of the steps (57 % at B = 8,
p = 0.1), so R2R's advantage fades as users arrive. Letting a routed row wait (no SLM step, no token for it
until the LLM runs) while the others go on lets one LLM forward serve several rows, as the official R2R
server does with ``llm_min_batch_size``.

The LLM runs when (a) at least ``m`` rows wait, ``m`` read from ``min_rows`` by the number of running rows
(one number, or one per count like the official list; the last entry covers larger counts), or (b) the
oldest waiting row has waited ``max_wait`` steps, or (c) no row can go on without it (every running row
waits). ``m = 1`` is the rectangle's behaviour: the LLM runs in the step a row routes.

Waiting never changes a row's answer: its prefix is the same when the LLM runs later, and so are its
processors and its random stream (``choice.py``). It only delays that row's tokens.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def check_min_rows(value: object) -> tuple[int, ...]:
    """``min_rows`` as a tuple of whole numbers >= 1 (one number, or a list by running rows)."""
    values = (value,) if isinstance(value, int) and not isinstance(value, bool) else tuple(value) if isinstance(
        value, (list, tuple)) else None
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"llm_min_rows must be a whole number >= 1 or a list of them (one per count of running "
                         f"rows), got {value!r}.")
    return values


def check_max_wait(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"llm_max_wait must be a whole number of steps >= 0, got {value!r}.")
    return value


def check_speculate(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"speculate must be a whole number of pending positions >= 0 (0: off), got {value!r}.")
    return value


MAX_BLOCK = 16  # drafted steps per host synchronisation at most (each is captured in the block's one graph)


def check_block(value: object, name: str = "block") -> int:
    """Steps drafted per host synchronisation, from 1 (off) to ``MAX_BLOCK``; ``name``: the setting's (the server's
    ``draft_block``, ``--draft-block``)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK:
        raise ValueError(f"{name} must be a whole number of drafted steps from 1 to {MAX_BLOCK} (1: off), got "
                         f"{value!r}.")
    return value


def check_confidence(value: object) -> float:
    """The SLM's probability of its token under which a routed row stops drafting (0: never)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"draft_confidence must be a probability from 0 to 1 (0: draft everywhere), got {value!r}.")
    return float(value)


MEASURED_COST = "auto"  # draft_cost: the pair's own, timed on its device before its policy is made (core/costs.py)


def check_draft_cost(value: object) -> float:
    """An LLM forward's cost in SLM steps for the expected-gain rule (``WaitPolicy.draft_cost``; None: off)."""
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"draft_cost must be an LLM forward's cost in SLM steps (a number >= 0, e.g. 2.5; 0: off) "
                         f"or {MEASURED_COST!r} (measured on the pair's device), got {value!r}.")
    return float(value)


def check_cost_setting(value: object) -> float | str:
    """A ``draft_cost`` as a caller gives it: ``MEASURED_COST`` as is (measured where the pair runs), else a number
    (``check_draft_cost``)."""
    return value if value == MEASURED_COST else check_draft_cost(value)


def check_one_depth_rule(fixed: bool, cost: float | str) -> None:
    """``fixed_depth`` and ``draft_cost`` each choose where a draft ends at threshold 0: at most one of them."""
    if fixed and cost:
        raise ValueError("fixed_depth and draft_cost each choose where a draft ends at threshold 0; give one of them.")


def check_fixed_depth(value: object) -> bool:
    """Whether rows at threshold 0 draft to their full depth every time (None: no, their depth follows their
    acceptance: ``WaitPolicy.adapts``)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"fixed_depth must be True or False, got {value!r}.")
    return value


def check_speculate_below(value: object) -> float:
    """A router score from which routed rows wait rather than speculate (None: speculate wherever they route)."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"speculate_below must be a router score (a number; above 1: speculate everywhere), got "
                         f"{value!r}.")
    return float(value)


@dataclass(frozen=True)
class WaitPolicy:
    """When a batch's LLM runs (see the module docstring).

    Args:
        min_rows: ``m``, one number or one per count of running rows (index: running rows - 1).
        max_wait: steps a routed row may wait at most (0: the LLM runs at once, whatever ``min_rows`` says).
        speculate: routed positions a row may go past with the SLM's token before it waits (0: routed rows wait;
            ``speculation.py``). With speculation, ``min_rows`` counts the rows that hold a pending position or
            wait, and ``max_wait`` bounds the age of the oldest, which also bounds a row's speculative tail.
        speculate_below: a row speculates past a routed position only where the router's score there is below this
            (where it is surer, the LLM disagrees far more often: the row waits for it instead).
        block: steps the server drafts on the device per host synchronisation where no step needs the host before
            the LLM runs (``fast/drafts.py``; 1: a synchronisation per step).
        depths: for rows that route everywhere (threshold 0: lossless decoding, the SLM drafting), the pending
            positions they may hold by the count of running rows (index: running rows - 1; the last entry covers
            larger counts), at most ``speculate``; empty: ``speculate`` (``depth``).
        draft_confidence: a row speculates past a routed position only where the SLM's probability of its token
            there is at least this (where the SLM is unsure the LLM rejects it more often: the row waits and the LLM
            writes the position instead; HF assisted generation's ``assistant_confidence_threshold``; 0: everywhere).
            A row that routes everywhere ends its draft there instead, with that token (``moves.move``).
        adapts: a row that routes everywhere drafts as deep as its own acceptance says (``plan.adapted``: short after
            a rejection, deeper while its drafts are confirmed whole), within the depths above; False: every draft
            may reach them.
        draft_cost: where above 0, a row that routes everywhere ends each draft where one more token no longer pays
            for itself by the cost model's expected-gain rule (``moves.draft_ends``), an LLM forward costing this
            many SLM steps; its drafts may then reach the depths above (it replaces ``adapts``). 0: off.
    """

    min_rows: tuple[int, ...] = (1,)
    max_wait: int = 0
    speculate: int = 0
    speculate_below: float = math.inf
    block: int = 1
    depths: tuple[int, ...] = ()
    draft_confidence: float = 0.0
    adapts: bool = False
    draft_cost: float = 0.0

    def __post_init__(self) -> None:
        if check_min_rows(self.min_rows) != self.min_rows:
            raise ValueError(f"min_rows must be a tuple of whole numbers >= 1, got {self.min_rows!r}.")
        check_max_wait(self.max_wait)
        check_speculate(self.speculate)
        check_speculate_below(self.speculate_below)
        check_block(self.block)
        check_confidence(self.draft_confidence)
        check_draft_cost(self.draft_cost)
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.depths):
            raise ValueError(f"depths must be whole numbers of pending positions >= 1, got {self.depths!r}.")

    @property
    def immediate(self) -> bool:
        """The LLM always runs in the step a row routes (no row ever waits)."""
        return self.max_wait == 0 or max(self.min_rows) == 1

    @property
    def horizon(self) -> int:
        """The most tokens a rollback may cut a row's caches back by (0: the row never speculates): back to its oldest
        pending position, at most ``max_wait`` steps old (or its tail's ``speculate`` positions), past a draft block's
        steps and the frontier token (``compat.record_past``: what a windowed layer keeps for it)."""
        return max(self.max_wait, self.speculate) + self.block + 1 if self.speculate else 0

    def said(self) -> str:
        """The policy in one line (the server says it at start-up)."""
        if not self.speculate:
            return f"the LLM runs once {self.min_rows} rows wait or the oldest waited {self.max_wait} steps"
        by_load = f"; answers at threshold 0: {', '.join(map(str, self.depths))} by running rows" if self.depths else ""
        by_load += "; answers at threshold 0 draft as deep as their own acceptance says" if self.adapts else ""
        by_load += (f"; answers at threshold 0 end each draft where one more token no longer pays for itself (an LLM "
                    f"forward costing {self.draft_cost:g} SLM steps)") if self.draft_cost else ""
        return (f"answers speculate up to {self.speculate} pending positions{by_load}; the LLM resolves once "
                f"{self.min_rows} rows wait or hold full tails, the oldest is {self.max_wait} steps old, or none "
                "can go on")

    def depth(self, running: int, everywhere: bool = False) -> int:
        """Pending positions a row may hold in a batch of ``running`` rows (``everywhere``: it routes every
        position, its depth by load)."""
        if not everywhere or not self.depths:
            return self.speculate
        return min(self.speculate, self.depths[min(max(running, 1), len(self.depths)) - 1])

    def wanted(self, running: int) -> int:
        """``m`` for a batch of ``running`` rows."""
        return self.min_rows[min(max(running, 1), len(self.min_rows)) - 1]

    def runs(self, waiting: int, running: int, oldest_wait: int, stalled: bool) -> bool:
        """Whether the LLM runs this step, given the rows waiting, the rows running, how long the oldest waiting
        row has waited (0: it routed this step) and whether no other row can go on (``stalled``)."""
        if not waiting:
            return False
        return self.immediate or stalled or waiting >= self.wanted(running) or oldest_wait >= self.max_wait


IMMEDIATE = WaitPolicy()


def default_policy(device_type: str, max_rows: int) -> WaitPolicy:
    """The server's policy when its flags name none, by where the models run (chosen from measurements).

    On a GPU a forward reads the weights whatever its rows, so one LLM forward for several routed rows saves
    whole forwards: the cost-model replay of served answers (``benchmarks/serving/cost_model.py``, H200 component
    costs) is best near m = running rows / 3 with a wait of at most 16 steps (at p = 0.1 and 8 rows: 2.2x the
    LLM alone where m = 1 gives 1.4x; at 16 rows 1.7x against 1.1x). On a CPU a forward's cost grows with its
    rows x tokens (this machine's grid: ``benchmarks/serving/forward_costs.py``) and an SLM step costs a third of an LLM
    forward, so a waiting row loses more than the shared forward saves: m = 1 (the LLM runs at once).
    """
    if device_type == "cpu":
        return IMMEDIATE
    return WaitPolicy(tuple(max(1, round(rows / 3)) for rows in range(1, max_rows + 1)), 16)


def serving_policy(device_type: str, max_rows: int, min_rows: tuple[int, ...] | None = None,
                   max_wait: int | None = None, speculate: int = 0, speculate_below: float | None = None,
                   block: int | None = None, draft_confidence: float | None = None,
                   adapts: bool = True, draft_cost: float | None = None) -> WaitPolicy:
    """The server's policy: what its settings name, the rest from the device's default (``default_policy``, or with
    ``speculate`` ``speculative_policy``; draft blocks of ``DRAFT_BLOCK`` steps on a GPU). With ``draft_cost`` the
    expected-gain rule ends the drafts at threshold 0, up to the depths by load (``speculative_policy``'s with
    ``gains``; it replaces ``adapts``)."""
    if speculate:
        default = speculative_policy(device_type, max_rows, speculate, gains=bool(draft_cost))
    elif min_rows is None and max_wait is None:
        return default_policy(device_type, max_rows)
    else:
        default = default_policy("cuda", max_rows)  # what waiting means where it pays
    if block is None:
        block = DRAFT_BLOCK if device_type == "cuda" else 1
    return WaitPolicy(min_rows or default.min_rows, default.max_wait if max_wait is None else max_wait, speculate,
                      check_speculate_below(speculate_below), block, default.depths, check_confidence(draft_confidence),
                      adapts and bool(speculate) and not default.depths and not draft_cost,
                      check_draft_cost(draft_cost) if speculate else 0.0)


# Steps a server drafts per host synchronisation on a GPU (``fast/drafts.py``). Chosen with the cost model
# at the first device run's measured costs (benchmarks/serving/calibrated.py, ``today``: 16 slots, p = 0.1, 256- and
# 2,048-token answers, 0.1 ms of planning per drafted step): speculating, against one synchronisation per step, 2 / 4 / 8
# gave 1.09 / 1.16 / 1.19x at batch 1, 1.17 / 1.22 / 1.25x at 8 users and 1.20 / 1.27 / 1.31x at 16; 4 takes most of
# it with half the graph of 8 and shorter bursts of tokens to the clients. One size for every load: each gains more
# from a larger block (what the first device run measured is the host's time per step, which blocks divide). The
# waiting default gains as much: 1.19 / 1.22x (blocks of 4) at 8 users, 1.26 / 1.29x at 16.
DRAFT_BLOCK = 4


# Threshold 0 (lossless) on a GPU, pending positions per row by running rows (1, 2, 3, ...; the last for more): the
# best depth of the cost model with the first H200 run's measured costs at an agreement of 0.9 per position
# (``benchmarks/serving/lossless.py``, ``results/lossless_h200_predicted.json``): 8 at 1-2 rows, 6 from 3 (at 0.99,
# the real pair's on HumanEval, 16 -> 12; at 0.8, 4 -> 3). A server's --speculate caps it.
LOSSLESS_DEPTHS = (8, 8, 6)
# With the expected-gain rule (``draft_cost``) ending each draft, one or two rows draft as deep as --speculate lets
# them: within 8 the rule rarely ends a draft (the real pair's traces: 3.71x the LLM alone at one user either way),
# up to 32 it gives 4.49x; from three rows the depth by load stays (the rule alone, uncapped, rows of unequal tails
# waiting for each other at the shared resolution: 2.52x against 2.77x at 16 users). Cost model, first H200 run's
# costs (``benchmarks/serving/lossless.py --gains``).
GAIN_ROWS = 2


def speculative_policy(device_type: str, max_rows: int, speculate: int, adapts: bool = True,
                       gains: bool = False) -> WaitPolicy:
    """Where rows speculate: the LLM resolves once every running row (and at least two: one row alone never
    resolves at once, which would be m = 1) holds a pending position or waits, once the oldest pending position is
    ``SERVE_SPECULATE_WAIT`` steps old, or when no row can go on without it (a row that holds ``speculate`` pending
    positions and routes again waits meanwhile). Chosen with the cost model (``benchmarks/serving/speculative.py``,
    H200 estimates, benchmarks/results/): at 8 and 16 users, p = 0.05-0.2, 3 % below the best of its grid in each
    case on average (6 % at worst); resolving once 3/4 of the rows hold ran the LLM too often at p = 0.2 (2.74x the
    LLM alone against 3.12x at 8 users), for somewhat fewer tokens thrown away and a lower inter-token p99. On a
    GPU the rows at threshold 0 hold pending positions by load (``LOSSLESS_DEPTHS``, at most ``speculate``); they
    count as holding once their tails are full (``plan.plan_step``). Each one's depth follows its own acceptance
    (``adapts``, ``plan.adapted``) where no depth by load is set: on a GPU the depth by load is the default, since the
    cost model with the H200's costs predicts per-row depths losing there (``benchmarks/serving/lossless.py
    --adaptive``: 3-15 % at 1-16 users, 0.8-0.99 agreement; rows that fill a shallow tail wait for deep ones at the
    shared resolution, and an LLM forward is dear against an SLM step). With ``gains`` (the expected-gain rule ends
    the drafts) the first ``GAIN_ROWS`` depths are ``speculate``'s."""
    depths = LOSSLESS_DEPTHS if device_type != "cpu" else ()
    if depths and gains:
        depths = (speculate,) * GAIN_ROWS + depths[GAIN_ROWS:]
    return WaitPolicy(tuple(max(2, rows) for rows in range(1, max_rows + 1)), SERVE_SPECULATE_WAIT, speculate,
                      depths=depths, adapts=adapts and not depths)



SERVE_SPECULATE_WAIT = 16
# A generate call that speculates resolves its rows' pending positions once the oldest is this many steps old (or a
# row holds ``speculate`` of them and routes again, or none can go on). Chosen with the cost model:
# benchmarks/results/speculation.md.
SPECULATE_WAIT = 32
_said: set[str] = set()


def say_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process says it (why a feature is off, for a call or a
    model)."""
    if message not in _said:
        _said.add(message)
        logger.warning(message)


def call_policy(generation_config, rows: int) -> WaitPolicy:
    """A generate call's policy: the LLM runs in the step a row routes, or, where the call asks to ``speculate``
    (pending positions a row may hold), once the oldest pending position is ``llm_max_wait`` steps old. Where
    speculation could not give the answers R2R gives without it, it is off for the call, said once."""
    speculate = check_speculate(getattr(generation_config, "speculate", None) or 0)
    wait = getattr(generation_config, "llm_max_wait", None)
    wait = None if wait is None else check_max_wait(wait)  # (checked with speculation off too: never a silent value)
    below = check_speculate_below(getattr(generation_config, "speculate_below", None))
    confidence = check_confidence(getattr(generation_config, "draft_confidence", None))
    fixed = check_fixed_depth(getattr(generation_config, "fixed_depth", None))
    cost = check_cost_setting(getattr(generation_config, "draft_cost", None))  # ("auto": timed before, if speculating)
    check_one_depth_rule(fixed, cost)
    if not speculate:
        return IMMEDIATE
    why = None
    if generation_config.do_sample and rows > 1:
        why = "a sampled batch draws every row from one random stream, which a row's rollback would move for all"
    elif generation_config.return_dict_in_generate and (generation_config.output_scores or
                                                          generation_config.output_logits):
        why = "output_scores/output_logits record what each token was chosen from, and a rollback would rewrite them"
    if why is not None:
        say_once(f"speculation is off for this call: {why}.")
        return IMMEDIATE
    return WaitPolicy((rows + 1,), SPECULATE_WAIT if wait is None else wait, speculate, below,
                      draft_confidence=confidence, adapts=not fixed and not cost, draft_cost=cost)
