"""One rule for who goes on and who waits (core/moves.py), written once on the host and once on the device.

``moves.move`` decides every step's moves (``plan.plan_step``); a draft block decides its steps' on the device
(``fast/drafts.device_move`` inside ``draft_fn``). One table of cases runs through both forms: a device rule that
drifts fails here.
"""

import itertools

import pytest
import torch

from r2r_hf.core.fast.drafts import device_move
from r2r_hf.core.moves import Move, Standing, move

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
    ("routes everywhere, the SLM unsure: it waits", Standing(3, 4, 9, True, False), True, True, WAITS),
    ("the router decides its next: no frontier", Standing(3, 4, 9, False, False), True, False, SPECULATES),
]


def on_device(cases: list[tuple[Standing, bool, bool]]) -> list[Move]:
    """Each case's move as the draft block decides it on the device, read back as the block's read-back reads it."""
    columns = list(zip(*[(*s, routed, sure) for s, routed, sure in cases]))
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
