"""The router's training prompts: the standard-library prompts and GSM8K *train* questions (maths in words), mixed.

    python -m benchmarks.router.gsm8k_prompts [--count 368]
        # -> benchmarks/data/router_prompts.jsonl: the first 64 standard-library prompts, then the other 336 and the
        #    GSM8K ones interleaved in proportion

The two sources are interleaved so that every shard of the labeling run (64 prompts) from the second on holds both:
a run stopped part-way, or labelled in parts, trains on both kinds of difference. The first shard is the first 64
standard-library prompts alone because the run had answered them before the order changed (a shard's prompts are
fixed once answered).

GSM8K's train split (``../shared/data/gsm8k/train.jsonl``, MIT; never its test split) gives answers whose
differences are numbers and operators more than code: labels of another kind than the standard library's. The
questions are a fixed-seed sample, each asked to be solved step by step in words and arithmetic, ending with the
number after ``####`` (GSM8K's own convention). None of them is a coding task, so none overlaps HumanEval or MBPP+.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

GSM8K_TRAIN = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k" / "train.jsonl"
GSM8K_SHA256 = "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465"
INSTRUCTION = ("Solve this problem step by step, in words and arithmetic (no code). End with the final answer on a "
               "line of its own, as: #### <number>\n\n{question}")
STDLIB = Path("benchmarks/data/stdlib_prompts.jsonl")
KEPT = 64  # the first shard, answered before the sources were interleaved
COMBINED = Path("benchmarks/data/router_prompts.jsonl")


def gsm8k_prompts(count: int, path: Path = GSM8K_TRAIN, seed: int = 0) -> list[dict]:
    """``count`` questions of GSM8K's train split drawn with ``seed``, in the file's order, as chat prompts."""
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != GSM8K_SHA256:
        raise ValueError(f"{path} is not the pinned GSM8K train split (sha256 {GSM8K_SHA256[:12]}...).")
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    picked = sorted(random.Random(seed).sample(range(len(rows)), count))
    return [{"id": f"gsm8k-train-{i}", "messages": [{"role": "user", "content": INSTRUCTION.format(
        question=rows[i]["question"].strip())}]} for i in picked]


def interleave(a: list, b: list) -> list:
    """``a`` and ``b`` merged in proportion, each in its own order (at every point each has given its share)."""
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if j >= len(b) or (i < len(a) and (i + 1) * len(b) <= (j + 1) * len(a)):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=368, help="GSM8K questions (400 + 368 = 24 shards of 32)")
    args = parser.parse_args(argv)
    stdlib = STDLIB.read_text(encoding="utf-8").splitlines(keepends=True)
    gsm8k = [json.dumps(p, ensure_ascii=False) + "\n" for p in gsm8k_prompts(args.count)]
    COMBINED.write_text("".join(stdlib[:KEPT] + interleave(stdlib[KEPT:], gsm8k)), encoding="utf-8")
    print(f"wrote {COMBINED}: the first {KEPT} of {STDLIB}, then its other {len(stdlib) - KEPT} and {len(gsm8k)} GSM8K "
          "train questions interleaved")


if __name__ == "__main__":
    main()
