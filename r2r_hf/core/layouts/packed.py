"""A packed read: one forward over the flat list of the tokens several slots' reads take, padded only up to a
bucket of their total.

A padded slot read is a [rows x longest] rectangle: at 16 rows a catch-up of ~5 rows x ~10 tokens read ~518 padded
token-rows for ~55 real ones on the first device run (the 32B's GEMMs past their ridge). A packed read lays the
tokens out flat instead, row after row, and pads the list to a bucket of its total (``tokens_bucket``): every linear layer
(projections, MLP, head) reads the real tokens and the bucket's slack only. Three things need a layout beyond the
flat list:

* **the cache**: token ``t`` writes its keys and values at column ``column[t]`` of slot ``slot[t]`` (padding at the
  spare column of slot 0, which nothing attends);
* **attention**: each token attends its own row. The flat queries are placed in a [slots x group] layout (``place``:
  row ``r``'s ``j``-th token at ``r * group + j``; padding at one extra place that nothing reads) and attend their
  own slot's keys in place (no copy of the cache), under a mask from each place's position (``qpos``; -1: no
  query there, it sees column 0 only). ``group`` is a bucket of the longest row's tokens (``GROUPS``);
* **logits**: only at the positions that need them (``keep``: a writer's last token, a pending position's
  predecessor), gathered before the head; a fixed count per kind of read (``kept``).

Everything here is host arithmetic over host values; ``inputs`` stages the result in one copy the host does not wait
for (``staging.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..staging import staged

GROUPS = (1, 4, 16, 64)  # tokens of one row in the attention's layout (a row reads at most GROUPS[-1] per read)


def tokens_bucket(total: int) -> int:
    """The length a packed read of ``total`` tokens pads its flat list to: 1, 2, 3, then the powers of two and the
    halfway points between them (4, 6, 8, 12, 16, 24...), as far as any read goes (a read pads by a fifth of its
    tokens at most past 2, an eighth on average; computed, so a server of any number of slots has one)."""
    if total <= 3:
        return max(total, 1)
    power = 1 << (total - 1).bit_length()  # the smallest power of two holding ``total``
    halfway = power // 2 + power // 4
    return halfway if total <= halfway else power


def tokens_buckets(most: int) -> list[int]:
    """Every ``tokens_bucket`` of at most ``most`` tokens, smallest first."""
    out = [1]
    while tokens_bucket(out[-1] + 1) <= most:
        out.append(tokens_bucket(out[-1] + 1))
    return out


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest of ``buckets`` holding ``value``."""
    return next(b for b in buckets if b >= value)


def shapes(slots: int) -> list[tuple[int, int]]:
    """Every (tokens, group) bucket pair a packed read of ``slots`` slots can take: a group ``g`` holds a longest row
    of more tokens than the group before it, and the total is at least that and at most ``slots`` x ``g``."""
    out, before = [], 0
    for group in GROUPS:
        low = tokens_bucket(before + 1)
        out += [(width, group) for width in tokens_buckets(tokens_bucket(slots * group)) if width >= low]
        before = group
    return out


@dataclass(frozen=True)
class Packed:
    """One packed read's host plan.

    Args:
        rows, starts, counts: each row read, its first column, how many tokens (in the flat list's order).
        width: the flat list's length (``tokens_bucket`` of the total); group: the attention layout's row length.
        keep: flat positions whose logits the read returns (the rest of ``kept`` points at position 0).
        kept: how many logits rows the read returns.
    """

    rows: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    width: int
    group: int
    keep: tuple[int, ...]
    kept: int

    @property
    def real(self) -> int:
        """The real tokens read (the rest of ``width`` is padding)."""
        return sum(self.counts)

    def position(self, row: int, column: int) -> int:
        """Where the token at ``column`` of ``row`` sits in the flat list."""
        at = 0
        for r, s, n in zip(self.rows, self.starts, self.counts):
            if r == row and s <= column < s + n:
                return at + column - s
            at += n
        raise ValueError(f"column {column} of row {row} is not read here")


def pack(rows: list[int], starts: list[int], counts: list[int], wanted: list[tuple[int, int]], kept: int) -> Packed:
    """Plan a packed read of ``counts[i]`` tokens of row ``rows[i]`` from column ``starts[i]``, returning the logits
    after each (row, column) of ``wanted`` (at most ``kept`` of them) in that order."""
    if max(counts) > GROUPS[-1]:
        raise ValueError(f"a packed read takes at most {GROUPS[-1]} tokens of a row, not {max(counts)}")
    if len(wanted) > kept:
        raise ValueError(f"{len(wanted)} logits wanted from a read that returns {kept}")
    width, group = tokens_bucket(sum(counts)), bucket(max(counts), GROUPS)
    plan = Packed(tuple(rows), tuple(starts), tuple(counts), width, group, (), kept)
    keep = tuple(plan.position(r, c) for r, c in wanted)
    return Packed(plan.rows, plan.starts, plan.counts, width, group, keep, kept)


def layout(plan: Packed, slots: int, capacity: int, trash: int) -> dict[str, torch.Tensor]:
    """The read's index tensors on the host: for each flat position its token's flat index in the [slots, capacity]
    token buffer, position, slot, cache column and attention place; each attention place's position; the kept
    positions. Padding reads token 0, sits at position 0, writes slot 0's ``trash`` column and takes the extra
    place ``slots * group``."""
    width, group = plan.width, plan.group
    slot, column, position, place = [0] * width, [trash] * width, [0] * width, [slots * group] * width
    qpos = [-1] * (slots * group)
    at = 0
    for r, s, n in zip(plan.rows, plan.starts, plan.counts):
        for j in range(n):
            slot[at], column[at], position[at], place[at] = r, s + j, s + j, r * group + j
            qpos[r * group + j] = s + j
            at += 1
    source = [s * capacity + c if t < at else 0 for t, (s, c) in enumerate(zip(slot, position))]
    keep = list(plan.keep) + [0] * (plan.kept - len(plan.keep))
    return {"source": torch.tensor(source), "position": torch.tensor(position), "slot": torch.tensor(slot),
            "column": torch.tensor(column), "place": torch.tensor(place), "qpos": torch.tensor(qpos),
            "keep": torch.tensor(keep)}


def inputs(plan: Packed, tokens: torch.Tensor, trash: int) -> dict[str, torch.Tensor]:
    """The read's device inputs (``layout`` staged in one copy, the ids gathered on the device): ids, position, slot,
    column, place [width]; qpos [slots * group]; keep [kept]."""
    slots, capacity = tokens.shape
    host = layout(plan, slots, capacity, trash)
    names = list(host)
    sizes = [len(host[n]) for n in names]
    values = staged(torch.cat([host[n] for n in names]), tokens.device).split(sizes)
    out = dict(zip(names, values))
    out["ids"] = tokens.view(-1).index_select(0, out.pop("source"))
    return out
