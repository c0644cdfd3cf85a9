"""Rows joining and leaving a running batch (core/batching.py) answer what they answer alone.

The loop here is the server engine's, run by hand so the test decides when rows join and leave:
newcomers whose prompts are longer or shorter than the running batch, a running batch the LLM has or
has not read yet, rows leaving from the front, the middle and the end.
"""

import pytest
import torch

from r2r_hf.core.batching import grown, merge, select
from r2r_hf.core.decoding import catch_up, commit, propose_and_route, start
from r2r_hf.core.engines import EagerSteps
from r2r_hf.core.features import positions_from_mask
from r2r_hf.core.routing import Routing
from r2r_hf.core.sampling import RowSampler
from r2r_hf.core.steps import Committed

PROMPTS = ["water", "the old man said that he was a good", "write a new line", "he",
           "the first time you see the old man say that", "def print(x): return"]


def _threshold(model, tok, quantile: float) -> float:
    """A threshold near the ``quantile`` of the router's scores, in the widest gap there (no float near-ties)."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    probe = model.generate(**enc, max_new_tokens=10, do_sample=False, threshold=float("inf"), return_dict_in_generate=True)
    scores = probe.router_scores[probe.generated_mask].sort().values
    gaps = scores[1:] - scores[:-1]
    lo, hi = int(len(gaps) * (quantile - 0.1)), int(len(gaps) * (quantile + 0.1))
    i = lo + int(gaps[lo:hi].argmax())
    return float((scores[i] + scores[i + 1]) / 2)


class Rows:
    """A hand-driven batch: rows with their own thresholds; ``join``, ``step``, ``leave``."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok
        self.batch = self.steps = None
        self.thresholds, self.names, self.out = [], [], {}

    def _routing(self, thresholds, steps):
        return Routing(self.model.router, self.model.shared_vocab_size, torch.tensor(thresholds),
                       lambda ids, logits: logits, RowSampler([None] * len(thresholds)), steps)

    def join(self, names, threshold):
        enc = self.tok([PROMPTS[n] for n in names], return_tensors="pt", padding=True)
        seq = Committed.from_prompt(enc["input_ids"], enc["attention_mask"], positions_from_mask(enc["attention_mask"]),
                                    enc["input_ids"].shape[1] + 4)
        steps = EagerSteps(self.model.slm, self.model.llm, self.model.router, self.model.config.num_topk_logits, None, 0)
        newcomers = start(self._routing([threshold] * len(names), steps), seq, new_tokens=0)  # no budget: no history
        if self.batch is None:
            self.batch, self.steps = newcomers, steps
        else:
            self.batch = merge(self.batch, self.steps, newcomers, steps)
        self.thresholds += [threshold] * len(names)
        self.names += names
        for n in names:
            self.out[n] = []

    def step(self, times=1):
        for _ in range(times):
            routing = self._routing(self.thresholds, self.steps)
            self.batch.seq = grown(self.batch.seq, self.batch.seq.length + 8)
            proposal = propose_and_route(routing, self.batch, torch.ones(len(self.names), dtype=torch.bool))
            token = proposal.token
            if proposal.routed.any():
                token, _, _ = catch_up(routing, self.batch, proposal)
            commit(routing, self.batch, token)
            for n, t, r in zip(self.names, token.tolist(), proposal.routed.tolist()):
                self.out[n].append((t, r))

    def leave(self, names):
        keep = [i for i, n in enumerate(self.names) if n not in names]
        self.batch = select(self.batch, self.steps, keep)
        self.names = [self.names[i] for i in keep]
        self.thresholds = [self.thresholds[i] for i in keep]


def _alone(model, tok, n, threshold, tokens):
    enc = tok([PROMPTS[n]], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=tokens, do_sample=False, threshold=threshold, eos_token_id=10**6,
                         return_dict_in_generate=True)
    return list(zip(out.sequences[0, enc["input_ids"].shape[1]:].tolist(), out.routed[0].tolist()))


@pytest.mark.parametrize("first, later, wait", [
    ([0, 2], [1], 3),      # newcomers longer than the running rows: the running rows shift right
    ([1, 4], [0, 3], 5),   # newcomers shorter: they are padded
    ([3], [5, 1], 1),      # joining right after the first step
])
@pytest.mark.parametrize("lag", ["read", "unread"])
def test_rows_joining_and_leaving_answer_as_alone(model, tok, first, later, wait, lag):
    tau = _threshold(model, tok, 0.15)  # routes most tokens
    # "unread": the running rows never route before the join, so the LLM has read nothing of them yet.
    first_tau = float("inf") if lag == "unread" else tau
    rows = Rows(model, tok)
    rows.join(first, first_tau)
    rows.step(wait)
    assert (rows.batch.llm_seen > 0) == (lag == "read" and any(r for n in first for _, r in rows.out[n]))
    rows.join(later, tau)
    rows.step(4)
    leaving = [rows.names[0], rows.names[-1]] if len(rows.names) > 2 else [rows.names[0]]
    rows.leave(leaving)
    rows.step(3)
    routed_any = False
    for n in first + later:
        got = rows.out[n]
        want = _alone(model, tok, n, first_tau if n in first else tau, len(got))
        assert got == want, f"row {n}"
        routed_any |= any(r for _, r in got)
    assert routed_any, "the LLM wrote some tokens"


def test_leaving_drops_the_columns_that_are_padding_in_every_row_left(model, tok):
    rows = Rows(model, tok)
    rows.join([1, 3], 0.0)  # a long and a short prompt: the short one is padded on the left
    rows.step(2)
    rows.leave([1])
    length, mask = rows.batch.seq.length, rows.batch.seq.mask
    assert length == len(tok(PROMPTS[3])["input_ids"]) + 2 and bool(mask[0, :length].all())
    assert rows.steps.slm_cache.get_seq_length() == length  # the SLM has read every committed column
    assert rows.steps.llm_cache.get_seq_length() == rows.batch.llm_seen <= length
    rows.step(2)
    assert rows.out[3] == _alone(model, tok, 3, 0.0, 4)


def test_rows_with_and_without_a_budget_state_are_refused_before_any_work():
    from r2r_hf.core.budget import Budget
    from r2r_hf.core.decoding import Batch

    def batch(budget):
        seq = Committed.from_prompt(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long),
                                    torch.arange(3)[None], 8)
        return Batch(seq, 0, torch.zeros(1, 4), torch.zeros(1, 2), budget)

    with_budget = batch(Budget.start(0.1, 1, 8, torch.device("cpu")))
    for running, newcomers in ((with_budget, batch(None)), (batch(None), with_budget)):
        with pytest.raises(ValueError, match="cannot join"):
            merge(running, None, newcomers, None)  # no steps: it must refuse before touching a cache
