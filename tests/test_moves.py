"""One rule for who goes on and who waits (core/moves.py), written once on the host and once on the device.

``moves.move`` decides every step's moves (``plan.plan_step``); a draft block decides its steps' on the device
(``fast/drafts.device_move`` inside ``draft_fn``) and the host applies what it read back. One table of cases runs
through both forms, and whole blocks drafted on the device (a scripted SLM and router, CPU tensors) are held to the
host's (``moves.draft_on_host``, which the cost model's replay drafts with): a device rule that drifts fails here.
"""

import itertools
import random

import pytest
import torch

from r2r_hf.core.fast.drafts import device_draft_ends, device_move, draft_fn, inputs, read_back
from r2r_hf.core.moves import BlockPlan, Move, Standing, draft_ends, draft_on_host, move
from r2r_hf.core.staging import CHANCE_UNIT

WRITES, SPECULATES, WAITS, FRONTIER = Move.WRITES, Move.SPECULATES, Move.WAITS, Move.FRONTIER

# (why, standing (pending, depth, left, everywhere, ended), routed, sure, the move)
TABLE = [
    ("not routed: it writes the SLM's token", Standing(0, 4, 9, False, False), False, False, WRITES),
    ("not routed, whatever its tail holds", Standing(4, 4, 9, True, True), False, True, WRITES),
    ("routed with room in its tail: it speculates", Standing(1, 4, 9, False, False), True, False, SPECULATES),
    ("routed, its tail full: it waits", Standing(4, 4, 9, False, False), True, False, WAITS),
    ("routed, past its depth (the load grew): it waits", Standing(5, 3, 9, False, False), True, False, WAITS),
    ("routed, no speculation (depth 0): it waits", Standing(0, 0, 9, False, False), True, False, WAITS),
    ("routed, the router or the SLM sure: it waits", Standing(0, 4, 9, False, False), True, True, WAITS),
    ("routed, an end token in its tail: it waits", Standing(1, 4, 9, False, True), True, False, WAITS),
    ("routes everywhere, its last pending position: frontier", Standing(3, 4, 9, True, False), True, False, FRONTIER),
    ("routes everywhere, depth 1: frontier at once", Standing(0, 1, 2, True, False), True, False, FRONTIER),
    ("routes everywhere, room for more: it speculates", Standing(2, 4, 9, True, False), True, False, SPECULATES),
    ("routes everywhere, its last token: it speculates (no next token)", Standing(3, 4, 1, True, False), True, False,
     SPECULATES),
    ("routes everywhere, its tail full: it waits", Standing(4, 4, 9, True, False), True, False, WAITS),
    ("routes everywhere, an end in its tail: it waits", Standing(3, 4, 9, True, True), True, False, WAITS),
    ("routes everywhere, the SLM unsure: its draft ends with that token", Standing(1, 4, 9, True, False), True, True,
     FRONTIER),
    ("routes everywhere, the SLM unsure at its first: a draft of one", Standing(0, 8, 9, True, False), True, True,
     FRONTIER),
    ("routes everywhere, the SLM unsure at its last token: it waits", Standing(1, 4, 1, True, False), True, True,
     WAITS),
    ("routes everywhere, the SLM unsure, its tail full: it waits", Standing(4, 4, 9, True, False), True, True, WAITS),
    ("routes everywhere, the SLM unsure, an end in its tail: it waits", Standing(1, 4, 9, True, True), True, True,
     WAITS),
    ("the router decides its next: no frontier", Standing(3, 4, 9, False, False), True, False, SPECULATES),
]


# The expected-gain rule (why, standing, the SLM's probability of the proposal, whether the draft ends with it). A
# tail's ``chance`` and ``expected`` are what its tokens' probabilities make them (``Standing.of``); cost 2.5 is this
# CPU's LLM forward in SLM steps for the coder pair.
GAIN = [
    ("off (cost 0): never", Standing(3, 32, 99, True, False, 0.1, 1.5, 0.0), 0.01, False),
    ("the router decides the row's tokens: never", Standing(3, 32, 99, False, False, 0.1, 1.5, 2.5), 0.01, False),
    ("a sure first token goes on", Standing(0, 32, 99, True, False, 1.0, 1.0, 2.5), 0.99, False),
    ("a doubtful first token ends a draft of one", Standing(0, 32, 99, True, False, 1.0, 1.0, 2.5), 0.3, True),
    ("at 0.5 the first token: 0.5 * 3.5 = 1.75 >= 1.5 goes on", Standing(0, 32, 99, True, False, 1.0, 1.0, 2.5), 0.5,
     False),
    ("ten sure tokens: a sure eleventh goes on", Standing(10, 32, 99, True, False, 0.99**10,
                                                        1 + sum(0.99**k for k in range(1, 11)), 2.5), 0.99, False),
    ("a draft of 0.9s ends where 0.9^d * (d + 2.5) drops under what it expects (d = 5 on)",
     Standing(5, 32, 99, True, False, 0.9**5, 1 + sum(0.9**k for k in range(1, 6)), 2.5), 0.9, True),
    ("a dear LLM (cost 5.6, an H200) keeps the 0.9s going longer (to d = 8)",
     Standing(5, 32, 99, True, False, 0.9**5, 1 + sum(0.9**k for k in range(1, 6)), 5.6), 0.9, False),
]


@pytest.mark.parametrize("why,standing,chance,want", GAIN, ids=[row[0] for row in GAIN])
def test_the_expected_gain_rule(why, standing, chance, want):
    assert draft_ends(standing, chance) is want


def test_the_expected_gain_rule_on_the_device_reads_the_same_table():
    columns = [torch.tensor(c, dtype=torch.float64) for c in zip(*[(s.chance, s.expected, s.pending, s.cost, c)
                                                                    for _, s, c, _ in GAIN])]
    chance, expected, pending, cost, proposal = columns
    everywhere = torch.tensor([s.everywhere for _, s, _, _ in GAIN])
    got = device_draft_ends(chance, expected, pending.long(), everywhere, cost, proposal).tolist()
    assert got == [want for *_, want in GAIN]


def test_a_tail_stands_where_its_tokens_probabilities_put_it():
    """``Standing.of`` over a row's pending tokens and ``Standing.after`` step by step give the same floats (the
    host's steps and a draft block's moves agree on where a draft ends)."""
    from r2r_hf.core.ledger import Pending, RowState

    chances = [0.97, 0.5, 0.999, 0.8]
    row = RowState(routes=True, pending=[Pending(i, i, chance=c) for i, c in enumerate(chances)])
    stepped = Standing(0, 8, row.max_new + 4, True, False, cost=2.5)
    for c in chances:
        stepped = stepped.after(Move.SPECULATES, False, c)
    assert Standing.of(row, 8, 2.5) == stepped
    assert stepped.chance == 0.97 * 0.5 * 0.999 * 0.8
    assert stepped.expected == 1 + 0.97 + 0.97 * 0.5 + 0.97 * 0.5 * 0.999 + 0.97 * 0.5 * 0.999 * 0.8
    assert Standing(0, 8, 9, True, False).after(Move.WRITES, False, 0.1).chance == 1.0  # (not pending: unmoved)


def on_device(cases: list[tuple[Standing, bool, bool]]) -> list[Move]:
    """Each case's move as the draft block decides it on the device, read back as the block's read-back reads it."""
    columns = list(zip(*[(*s[:5], routed, sure) for s, routed, sure in cases]))
    pending, depth, left, everywhere, ended, routed, sure = (torch.tensor(c) for c in columns)
    commit, frontier = device_move(routed, sure, pending, depth, left, everywhere, ended,
                                   active=torch.ones(len(cases), dtype=torch.bool))
    return [Move.of(c, r, d) for c, r, d in zip(commit.tolist(), routed.tolist(), (commit & ~frontier).tolist())]


@pytest.mark.parametrize("why,standing,routed,sure,want", TABLE, ids=[row[0] for row in TABLE])
def test_the_host_rule(why, standing, routed, sure, want):
    assert move(standing, routed, sure) is want


def test_the_device_rule_reads_the_same_table():
    got = on_device([(standing, routed, sure) for _, standing, routed, sure, _ in TABLE])
    assert {why: m for (why, *_), m in zip(TABLE, got)} == {why: want for why, *_, want in TABLE}


def test_the_host_and_the_device_agree_on_every_small_case():
    cases = [(Standing(p, d, left, e, x), routed, sure) for p, d, left, e, x, routed, sure in
             itertools.product(range(4), range(4), range(1, 4), *[(False, True)] * 4)]
    assert on_device(cases) == [move(*case) for case in cases]


def test_the_read_back_and_the_host_name_the_same_moves():
    """``Move.of`` inverts the flags a block reads back (committed, routed, read) for every move."""
    flags = {m: (m.commits, m is not WRITES, m.commits and m is not FRONTIER) for m in Move}
    assert {m: Move.of(*f) for m, f in flags.items()} == {m: m for m in Move}


class ScriptedSLM:
    """The SLM's and the router's outputs a block reads, scripted per slot and per token the slot committed in the
    block: the argmax token, how sure the SLM is of it, the router's score."""

    VOCAB = 12

    def __init__(self, rng: random.Random, slots: int, steps: int, lengths: list[int]) -> None:
        shape = (slots, steps + 1)
        self.token = torch.tensor([[rng.randrange(self.VOCAB) for _ in range(shape[1])] for _ in range(slots)])
        self.sharp = torch.tensor([[rng.choice((1.0, 3.0, 5.0, 12.0)) for _ in range(shape[1])] for _ in range(slots)])
        self.score = torch.tensor([[rng.choice((0.1, 0.6, 0.95)) for _ in range(shape[1])] for _ in range(slots)])
        self.lengths = torch.tensor(lengths)

    def outputs(self, written: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each slot's logits [S, V], hidden state [S, 2] and router score [S] after ``written`` tokens."""
        at = written.clamp(0, self.token.shape[1] - 1)[:, None]  # (a slot not read: any)
        token, sharp = self.token.gather(1, at)[:, 0], self.sharp.gather(1, at)[:, 0]
        logits = torch.nn.functional.one_hot(token, self.VOCAB).float() * sharp[:, None]
        return logits, torch.zeros(len(token), 2), self.score.gather(1, at)[:, 0]

    def read(self, ids, position, column, real):
        """``draft_fn``'s read: the slot read its token at ``position``, so it has written one more."""
        return self.outputs(position[:, 0] - self.lengths + 1)

    def propose(self, r: int, written: int, threshold: float, below: float, everywhere: bool, confidence: float):
        """What the device proposes for slot ``r`` after ``written`` tokens: (token, routed, sure, chance as the host
        reads it back)."""
        logits, _, score = (v[r] for v in self.outputs(torch.full((len(self.lengths),), written)))
        top = logits.float().softmax(-1).amax()
        return (int(self.token[r, min(written, self.token.shape[1] - 1)]), float(score) >= threshold,
                (float(score) >= below and not everywhere) or float(top) < confidence,
                int((top * CHANCE_UNIT).round()) / CHANCE_UNIT)


@pytest.mark.parametrize("seed", range(6))
def test_a_block_drafted_on_the_device_is_the_hosts(seed):
    """Random blocks (tails, depths, lengths left, rows at threshold 0, ends in a tail or in the token before the
    block, rows that do not draft): the device's moves, tokens, routing and sure flags at every drafting row are the
    host's, step by step."""
    rng, slots, steps, made, gained = random.Random(seed), 5, 4, set(), set()
    for _ in range(40):
        cost = rng.choice((0.0, 2.5, 5.6))
        standing = tuple(None if rng.random() < 0.2 else tail(rng, Standing(0, rng.randrange(1, 5), rng.randrange(1, 7),
                                                                           rng.random() < 0.4, rng.random() < 0.15,
                                                                           cost=cost)) for _ in range(slots))
        ends = tuple(frozenset(rng.sample(range(ScriptedSLM.VOCAB), rng.randrange(3))) for _ in range(slots))
        plan = BlockPlan(steps, standing, ends, below=0.9, confidence=rng.choice((0.0, 0.5)))
        lengths = [rng.randrange(3, 9) for _ in range(slots)]
        previous = [rng.choice((-1, rng.randrange(ScriptedSLM.VOCAB))) for _ in range(slots)]
        slm = ScriptedSLM(rng, slots, steps, lengths)
        everywhere = [bool(s and s.everywhere) for s in standing]
        thresholds = torch.tensor([0.0 if e else 0.5 for e in everywhere])
        logits, hidden, scores = slm.outputs(torch.zeros(slots, dtype=torch.long))
        given = inputs(plan, lengths, logits=logits, hidden=hidden, scores=scores, thresholds=thresholds,
                       previous=torch.tensor(previous))
        tokens = torch.zeros(slots, max(lengths) + steps + 2, dtype=torch.long)
        out = draft_fn(slm.read, steps, ScriptedSLM.VOCAB, tokens.shape[1] - 1, tokens, gains=cost > 0)(**given)
        device = read_back(given["previous"], out[:7])
        host = draft_on_host(plan, previous, lambda r, written: slm.propose(
            r, written, float(thresholds[r]), plan.below, everywhere[r], plan.confidence))
        assert device.moves == host.moves, (plan, previous)
        for i, step in enumerate(host.moves):
            assert {r: (device.token[i][r], device.routed[i][r], device.sure[i][r]) for r in step} == \
                   {r: (host.token[i][r], host.routed[i][r], host.sure[i][r]) for r in step}
            if cost:  # (without the rule the block reads no probabilities back)
                assert {r: device.chance[i][r] for r in step} == {r: host.chance[i][r] for r in step}
            made |= set(step.values())
            gained |= {r for r in step if standing[r].cost and standing[r].everywhere and host.sure[i][r]
                       and host.routed[i][r]}
    assert made == set(Move), "the blocks make every move"
    assert gained, "some drafts end by the expected-gain rule"


def tail(rng: random.Random, standing: Standing) -> Standing:
    """``standing`` holding a random tail of up to 3 pending tokens (their probabilities moved on as a row's are)."""
    for _ in range(rng.randrange(4)):
        standing = standing.after(Move.SPECULATES, False, rng.choice((0.3, 0.6, 0.9, 0.99)))
    return standing
