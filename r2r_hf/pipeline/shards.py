"""Which prompts each shard of a run holds, and how a run grows with a larger ``--limit``.

A new run cuts its prompts into shards of ``batch_size``. A shard whose answers are written keeps its
prompts for good: its size is read back from its responses, so a run begun with ``--limit 5`` (shards of
3 and 2) and rerun with ``--limit 7`` keeps both and puts prompts 6 and 7 in a third shard. The layout is a
function of the prompts and the answered shards alone, so every process of a run, and every resume,
computes the same one.
"""

from __future__ import annotations

from .prompts import Prompt
from .store import WorkDir, text_hash


def prompt_hash(prompts: list[Prompt]) -> str:
    """What a responses shard records of its prompts (ids, texts, messages)."""
    return text_hash([(p.id, p.prompt, p.messages) for p in prompts])


def plan_shards(work: WorkDir, prompts: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """The prompts of each shard: an answered shard's own, the rest in chunks of ``batch_size``.

    Refuses prompts that differ from an answered shard's, and a limit that would end inside a shard the run
    already holds (or before shards it holds further on), saying which ``--limit`` works instead.
    """
    written = work.shards("responses")
    shards: list[list[Prompt]] = []
    start = 0
    while start < len(prompts):
        k = len(shards)
        if work.done("responses", k):
            answered = work.read("responses", k)
            size = len(answered["samples"])
            if start + size > len(prompts):
                raise _cut(work, k, start, start + size, len(prompts))
            chunk = prompts[start : start + size]
            if answered.get("prompt_hash") != prompt_hash(chunk):
                raise ValueError(f"The prompts of shard {k} changed since its answers were written ({work.root}); "
                                 "use the original prompts file or a new out= folder.")
        else:
            chunk = prompts[start : start + batch_size]
            if len(chunk) < batch_size and written and k < written[-1]:  # later shards assume this one is full
                raise _cut(work, k, start, start + batch_size, len(prompts))
        shards.append(chunk)
        start += len(chunk)
    return shards


def _cut(work: WorkDir, k: int, start: int, end: int, given: int) -> ValueError:
    fits = f"limit={start} or a limit of at least {end}" if start else f"a limit of at least {end}"
    return ValueError(
        f"Labelling {given} prompts would end inside shard {k} of {work.root}, which holds prompts {start + 1} to "
        f"{end}; pass {fits} (--limit on the command line; a larger limit extends the run), or use a new out= folder."
    )
