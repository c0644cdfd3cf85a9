"""The one decoding step of R2R, which ``generate``'s loop and the server's engine both run.

Over a ``RunningBatch`` (``batch.py``), in order:

1. ``propose``  every row that is not waiting proposes its next token from the SLM's logits, through its
                processors and its random stream (``choice.py``);
2. ``route``    the router scores the proposals; a row routes where its score reaches its threshold and its
                budget allows (``budget.py``);
   ``sync``     the step's one host synchronisation: the routing decisions, together with the tokens the
                previous step committed (the server decodes and stops on them here, one step late, so the host
                never waits twice);
3. ``wait``     routed rows wait for the LLM; it runs when the policy says so (``policy.py``: at once, or when
                enough rows wait, or one waited long enough, or nothing else can go on);
4. ``catch up`` the LLM reads every token it has not read of the rows it writes for (of every row, in HF's
                rectangle), in one forward, and writes their tokens, each drawn from where the row's SLM draw
                started;
5. ``commit``   each row that has a token (the SLM's, where it did not route; the LLM's, where it ran) appends it;
6. ``SLM step`` the SLM reads the committed tokens, whichever model wrote them.

Nothing is rolled back: a waiting row simply has no token until the LLM runs, and its prefix, processors and
random stream are then what they were when it routed, so its answer is the same as if the LLM had run at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batch import RunningBatch
from .choice import CallChoice
from .policy import WaitPolicy


@dataclass(frozen=True)
class Synced:
    """What the host learnt in the step's one synchronisation (plain values, indexed by slot).

    Args:
        previous: the token each row committed at the previous step (-1: none).
        previous_by_llm: whether the LLM wrote it.
        failed: rows whose scores held no probability to draw from (their answer cannot go on).
        also: the values the caller asked to read in the same synchronisation.
    """

    previous: list[int]
    previous_by_llm: list[bool]
    failed: set[int]
    also: list[int]


@dataclass(frozen=True)
class StepResult:
    """What one step did.

    Args:
        synced: what the host read (``Synced``).
        committed: rows that committed a token this step; llm_rows: those whose token the LLM wrote.
        token: [S] the token each row committed (-1 where none; the pad for finished rows of a generate call).
        routed: [S] bool, the router's decision on this step's proposals (False where nothing was proposed).
        router_scores: [S] the router's scores of this step's proposals (NaN where nothing was proposed).
        scores: [S, V] the writers' processed scores, raw_logits: [S, V] the writers' logits (only when the batch
            keeps outputs: generate's output_scores/output_logits).
    """

    synced: Synced
    committed: list[int]
    llm_rows: list[int]
    token: torch.Tensor
    routed: torch.Tensor
    router_scores: torch.Tensor
    scores: torch.Tensor | None = None
    raw_logits: torch.Tensor | None = None


def _taken(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return values if index is None else values[index.to(values.device)]


def _sync(batch: RunningBatch, rows: list[int], routed: torch.Tensor, ok: torch.Tensor | None,
          also: tuple[torch.Tensor, ...]) -> tuple[list[bool], Synced]:
    """The step's one host synchronisation: this step's routing and draw flags, the previous step's tokens."""
    parts = [routed.long(), batch.last_token.to(routed.device)]
    parts.append((~ok).long() if ok is not None else routed.new_zeros(len(rows), dtype=torch.long))
    bad = getattr(batch.choice, "bad", None)
    parts.append(bad.long().to(routed.device) if bad is not None else routed.new_zeros(0, dtype=torch.long))
    parts += [a.reshape(-1).long().to(routed.device) for a in also]
    flat = torch.cat(parts).tolist()
    batch.counters.host_syncs += 1
    k, s = len(rows), len(batch.rows)
    routed_host, previous = [bool(v) for v in flat[:k]], flat[k : k + s]
    failed = {rows[i] for i, v in enumerate(flat[k + s : 2 * k + s]) if v}
    bad_rows = flat[2 * k + s : 2 * k + s + (s if bad is not None else 0)]
    failed |= {r for r, v in enumerate(bad_rows) if v}
    by_llm = [row is not None and row.by_llm for row in batch.rows]
    return routed_host, Synced(previous, by_llm, failed, flat[2 * k + s + len(bad_rows):])


def decode_step(batch: RunningBatch, policy: WaitPolicy, ended: Callable[[Synced], set[int]] | None = None,
                also: tuple[torch.Tensor, ...] = ()) -> StepResult:
    """Advance ``batch`` by one step (see the module docstring).

    Args:
        batch: the running batch.
        policy: when the LLM runs.
        ended: given what the host read, the rows whose answer ended with the previous step's token (the server's
            stop checks); they propose nothing more and commit nothing.
        also: device values to read in the step's synchronisation (generate: whether every row had finished).
    """
    counters, choice = batch.counters, batch.choice
    rows = batch.proposing()
    index = batch.index(rows)

    # 1-2. Propose and route (nothing here waits for the device).
    if rows:
        logits, hidden = _taken(batch.slm_logits, index), _taken(batch.slm_hidden, index)
        rng = choice.state(rows)  # kept so the LLM can draw in the SLM's place
        scores, token, ok = choice.propose(logits, rows)
        batch.pair.router.step()
        router_scores = batch.layout.route(logits, hidden, token).to(token.device)
        live = _taken(batch.running, index)
        routed = (router_scores >= _taken(batch.thresholds, index)) & live
        if batch.budget is not None:
            budget_rows = None if index is None else index.to(batch.budget.share.device)
            routed &= batch.budget.allows(router_scores, budget_rows)
            batch.budget.spend(router_scores, routed, live, budget_rows)
    else:
        logits = token = ok = rng = scores = None
        router_scores = torch.zeros(0, device=batch.device)
        routed = torch.zeros(0, dtype=torch.bool, device=batch.device)
    routed_host, synced = _sync(batch, rows, routed, ok, also)
    gone = (ended(synced) if ended is not None else set()) | synced.failed
    if gone and all(r in gone for r in batch.occupied()):  # every answer ended: nothing is committed or read
        nothing = torch.zeros(len(batch.rows), dtype=torch.bool, device=batch.device)
        counters.steps += 1
        batch.step_no += 1
        return StepResult(synced, [], [], torch.full_like(batch.last_token, -1), nothing,
                          torch.full((len(batch.rows),), float("nan"), device=batch.device))

    # 3. Routed rows wait; the policy says whether the LLM runs now.
    slm_writers = []
    for i, r in enumerate(rows):
        if r in gone:
            continue
        if routed_host[i]:
            batch.rows[r].waiting_since, batch.rows[r].rng = batch.step_no, rng if isinstance(choice, CallChoice) \
                else rng.get(r)
        else:
            slm_writers.append(r)
    waiting = [r for r in batch.waiting() if r not in gone]
    oldest = max((batch.step_no - batch.rows[r].waiting_since for r in waiting), default=0)
    running = len([r for r in batch.occupied() if r not in gone])
    llm_writers = waiting if policy.runs(len(waiting), running, oldest, stalled=not slm_writers) else []

    # Each row's committed token (and, for generate's records, what it was chosen from).
    committed = torch.full((len(batch.rows),), -1, dtype=torch.long, device=batch.device)
    out_scores = out_logits = None
    if rows:
        at = torch.arange(len(rows), device=batch.device) if index is None else index
        committed[at] = token
        if batch.keep_outputs:
            out_scores, out_logits = scores, logits[:, : choice.vocab].float()

    # 4. Catch up: the LLM reads what it has not read of the rows it writes for, and writes their tokens.
    if llm_writers:
        catch = list(range(len(batch.rows))) if isinstance(choice, CallChoice) else llm_writers
        llm_logits = batch.layout.llm_read(catch)
        states = rng if isinstance(choice, CallChoice) else {r: batch.rows[r].rng for r in llm_writers
                                                              if batch.rows[r].rng is not None}
        llm_scores, llm_token, llm_ok = choice.redraw(llm_logits, catch, llm_writers, states)
        writers = torch.tensor(llm_writers, device=batch.device)
        committed[writers] = llm_token
        if llm_ok is not None:
            choice.bad[writers] = ~llm_ok  # read in the next step's synchronisation
        if batch.keep_outputs:  # generate: every row proposed, so rows and slots coincide
            where = torch.zeros(len(batch.rows), dtype=torch.bool, device=batch.device)
            where[writers] = True
            out_scores = torch.where(where[:, None], _full(llm_scores, llm_writers, out_scores), out_scores)
            raw = _full(llm_logits[:, : choice.vocab].to(out_logits.device).float(), catch, out_logits)
            out_logits = torch.where(where[:, None], raw, out_logits)
        counters.llm_calls += 1
        counters.llm_rows += len(llm_writers)
        for r in llm_writers:
            counters.waits.append(batch.step_no - batch.rows[r].waiting_since)
            batch.rows[r].waiting_since = batch.rows[r].rng = None

    # 5-6. Commit (finished rows of a generate call commit the pad token); the SLM reads what was committed.
    writers_all = sorted(slm_writers + llm_writers)
    if set(rows) - set(writers_all):  # a routed row that waits, or one that ended, commits nothing
        wrote = torch.zeros(len(batch.rows), dtype=torch.bool, device=batch.device)
        wrote[torch.tensor(writers_all, dtype=torch.long, device=batch.device)] = True
        committed = torch.where(wrote, committed, -1)
    if batch.pad is not None:
        committed = torch.where(batch.running, committed, batch.pad)
    batch.layout.append(writers_all, committed)
    from_llm = set(llm_writers)
    for r in writers_all:
        state = batch.rows[r]
        state.by_llm = r in from_llm
        state.max_new -= 1
        state.draining = state.max_new <= 0
    batch.last_token = committed
    readers = [r for r in writers_all if not batch.rows[r].draining]  # a token no proposal follows is not read
    if readers:
        logits_new, hidden_new = batch.layout.slm_read(readers)
        at = batch.index(readers)
        if at is None:
            batch.slm_logits, batch.slm_hidden = logits_new, hidden_new
        else:
            batch.slm_logits[at.to(batch.slm_logits.device)] = logits_new
            batch.slm_hidden[at.to(batch.slm_hidden.device)] = hidden_new.to(batch.slm_hidden.device)
    counters.steps += 1
    counters.generated += len(writers_all)
    counters.llm_tokens += len(llm_writers)
    batch.step_no += 1
    full_routed = torch.zeros(len(batch.rows), dtype=torch.bool, device=batch.device)
    full_scores = torch.full((len(batch.rows),), float("nan"), device=batch.device)
    if rows:
        at = torch.arange(len(rows), device=batch.device) if index is None else index
        full_routed[at], full_scores[at] = routed, router_scores.float()
    return StepResult(synced, writers_all, llm_writers, committed, full_routed, full_scores, out_scores, out_logits)


def _full(values: torch.Tensor, rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """``values`` [k, ...] of ``rows`` placed in a tensor shaped like ``like`` (zeros elsewhere)."""
    out = torch.zeros_like(like)
    out[torch.tensor(rows, device=like.device)] = values.to(like.device, like.dtype)
    return out
