"""Two labeling runs of the same prompts compared: time and the labels themselves.

    python -m benchmarks.router.labeling_speed BEFORE AFTER [--label-set code+divergent] [--times B.time A.time]
        # -> benchmarks/results/labeling_speed.json

Both runs label the same prompts with the same settings but how they batch (``--batch-size``) and the code that
runs them. Time is what ``/usr/bin/time -v`` measured of each whole command (CPU seconds: user + system, and wall
clock; on a machine shared with other work CPU seconds are the comparable figure), with each run's own seconds per
step. The labels: how many answers are token for token the same, and on those, how many tokens have the same label
and the same SLM proposal (bf16 answers may differ where two logits lie within rounding of each other: rows batched
differently round differently).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from r2r_hf.pipeline.store import WorkDir, read_tensors

OUT = Path("benchmarks/results/labeling_speed.json")


def command_time(path: str | None) -> dict | None:
    """User + system CPU seconds and wall seconds from a ``/usr/bin/time -v`` report."""
    if not path:
        return None
    text = Path(path).read_text()
    value = {k: float(re.search(rf"{k} \(seconds\): ([\d.]+)", text).group(1)) for k in ("User time", "System time")}
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text).group(1).split(":")
    seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall)))
    return {"cpu_seconds": round(value["User time"] + value["System time"], 1), "wall_seconds": round(seconds, 1)}


def answers(work: WorkDir) -> dict[str, dict]:
    return {s["id"]: (k, i, s) for k in work.shards("responses") for i, s in enumerate(work.read("responses", k)["samples"])}


def labels_of(work: WorkDir, label_set: str, k: int, i: int) -> tuple[list[int], list[int]]:
    """One answer's labels and SLM proposals."""
    features, _ = read_tensors(work.shard("features", k), ["sample", "slm_token"])
    labels, _ = read_tensors(work.shard("labels", k, label_set), ["label"])
    rows = features["sample"] == i
    return labels["label"][rows].tolist(), features["slm_token"][rows].tolist()


def compare(before: str, after: str, label_set: str) -> dict:
    a, b = WorkDir(before), WorkDir(after)
    left, right = answers(a), answers(b)
    same = [p for p in left if p in right and left[p][2]["response_ids"] == right[p][2]["response_ids"]]
    tokens = agreeing = proposals = 0
    for p in same:
        la, pa = labels_of(a, label_set, *left[p][:2])
        lb, pb = labels_of(b, label_set, *right[p][:2])
        tokens += len(la)
        agreeing += sum(x == y for x, y in zip(la, lb))
        proposals += sum(x == y for x, y in zip(pa, pb))
    summaries = [json.loads((w.folder("labels", label_set) / "summary.json").read_text()) for w in (a, b)]
    return {"prompts": len(left), "identical_answers": len(same), "tokens_of_identical_answers": tokens,
            "same_label": agreeing, "same_slm_proposal": proposals,
            "counts": {"before": summaries[0]["counts"], "after": summaries[1]["counts"]},
            "step_seconds": {"before": summaries[0]["cost"], "after": summaries[1]["cost"]},
            "batch_size": {"before": a.manifest()["batch_size"], "after": b.manifest()["batch_size"]}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--label-set", default="code+divergent")
    parser.add_argument("--times", nargs=2, metavar=("BEFORE", "AFTER"), help="/usr/bin/time -v reports")
    parser.add_argument("--note", default="", help="the conditions, in words")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    result = compare(args.before, args.after, args.label_set)
    if args.times:
        result["command"] = {"before": command_time(args.times[0]), "after": command_time(args.times[1])}
        result["cpu_speedup"] = round(result["command"]["before"]["cpu_seconds"] /
                                      result["command"]["after"]["cpu_seconds"], 2)
        result["wall_speedup"] = round(result["command"]["before"]["wall_seconds"] /
                                       result["command"]["after"]["wall_seconds"], 2)
    result["note"] = args.note
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "step_seconds"}, indent=1))


if __name__ == "__main__":
    main()
