"""Hand-checked mismatches of the router's labeling run, and the verifiers measured and calibrated on them.

    python -m benchmarks.router.calibrate_verifiers sample --run RUN --out RUN/to_check.jsonl --n 60 --ids gsm8k
        # mismatches to read (fixed seed), with what code and maths say; a person adds "label": 0 (neutral) or
        # 1 (divergent) and a "note" to each line, and keeps the lines in RUN/checked.jsonl
    python -m benchmarks.router.calibrate_verifiers match --run RUN --checked benchmarks/data/judge_checked.jsonl
        # the first run's hand-checked mismatches found again in RUN (the same two sentences and context): appended
        # to RUN/checked.jsonl with their new ids
    python -m benchmarks.router.calibrate_verifiers calibrate --run RUN
        # each verifier against the reader; the logprob verifier's ROC AUC and threshold
        # -> benchmarks/results/verifier_calibration.json

The logprob threshold is the one with the best balanced accuracy (ties: the higher, calling fewer neutral) on the
checked mismatches that reach it in the chain ``code,maths,logprob,divergent`` (those code and maths pass on).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.quality.router_quality import roc_auc
from benchmarks.router.calibrate_judge import balanced_accuracy

RESULT = Path("benchmarks/results/verifier_calibration.json")
GRID = [round(-0.05 * i, 2) for i in range(1, 161)]  # log-probabilities from -0.05 to -8


def mismatches(run: str) -> list[dict]:
    """Every mismatch of ``run`` whose sentences differ, as a reader sees it, with what each cheap verifier says."""
    from transformers import AutoTokenizer

    from r2r_hf.model.sources import resolve
    from r2r_hf.pipeline.runner import answer_ids, shard_mismatches
    from r2r_hf.pipeline.sentences import sentence_end_ids
    from r2r_hf.pipeline.store import WorkDir
    from r2r_hf.pipeline.verifiers import CodeVerifier, MathsVerifier

    work = WorkDir(run)
    manifest = work.manifest()
    found, hub = resolve(manifest["llm"], "the LLM", {})  # a folder, the cache or a registered copy, as label reads it
    tok = AutoTokenizer.from_pretrained(str(found), **hub)
    ends, (_, eos) = sentence_end_ids(tok), answer_ids(tok, manifest["llm"])
    code, maths, out = CodeVerifier(), MathsVerifier(), []
    for k in work.shards("continuations"):
        samples = work.read("responses", k)["samples"]
        records = work.read("continuations", k)["mismatches"]
        for item, m in zip(shard_mismatches(work, k, samples, tok, ends, eos, manifest["context_tokens"]), records):
            if m["identical"]:
                continue
            out.append({"id": f"{k}:{item.index}", "prompt_id": samples[m["sample"]]["id"],
                        "context": item.context[-400:], "slm_sentence": item.slm_sentence,
                        "llm_sentence": item.llm_sentence, "code": code.judge_one(item).verdict,
                        "maths": maths.judge_one(item).verdict, "logprob": m["llm_logprob"]})
    return out


def sample(run: str, n: int, ids: str | None, seed: int = 0) -> list[dict]:
    """``n`` mismatches to read, drawn with ``seed`` from those whose prompt id starts with ``ids``."""
    pool = [m for m in mismatches(run) if ids is None or m["prompt_id"].startswith(ids)]
    return random.Random(seed).sample(pool, min(n, len(pool)))


def match(run: str, checked: Path) -> list[dict]:
    """The lines of ``checked`` found again in ``run`` (same sentences, context ending alike), with their new ids."""
    found = {(m["slm_sentence"], m["llm_sentence"]): m for m in mismatches(run)}
    out = []
    for line in checked.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        again = found.get((row["slm_sentence"], row["llm_sentence"]))
        if again and again["context"][-100:] == row["context"][-100:]:
            out.append({**again, "label": row["label"], "note": row["note"], "checked_as": f"first run {row['id']}"})
    return out


def append_new(checked: Path, rows: list[dict]) -> int:
    """Append to ``checked`` the rows whose mismatch (``id``) it does not hold yet, so that matching twice adds
    nothing; how many were appended."""
    have = set()
    if checked.exists():
        have = {json.loads(line)["id"] for line in checked.read_text(encoding="utf-8").splitlines() if line.strip()}
    new = [r for r in rows if r["id"] not in have]
    with open(checked, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
    return len(new)


def calibrate(rows: list[dict]) -> dict:
    """Each verifier against the reader's labels; the logprob verifier's AUC and threshold (module docstring)."""
    labels = [r["label"] for r in rows]

    def agreement(name: str) -> dict:
        said = [r for r in rows if r[name] == 0]
        return {"called_neutral": len(said), "neutral_by_hand": sum(r["label"] == 0 for r in said)}

    reach = [r for r in rows if r["code"] is None and r["maths"] is None]  # what logprob is asked in the chain
    scores, truth = [-r["logprob"] for r in reach], [r["label"] for r in reach]  # higher: more likely divergent
    best = max(GRID, key=lambda t: (balanced_accuracy(scores, truth, -t), t)) if reach else None
    neutral = [r for r in reach if r["logprob"] >= best] if best is not None else []
    return {
        "checked": len(rows), "neutral_by_hand": labels.count(0),
        "by_kind": {kind: sum(r["prompt_id"].startswith("gsm8k") == (kind == "maths") for r in rows)
                    for kind in ("code", "maths")},
        "code": agreement("code"), "maths": agreement("maths"),
        "logprob": {"asked": len(reach), "neutral_by_hand": truth.count(0),
                    "roc_auc_all": roc_auc([-r["logprob"] for r in rows], labels),
                    "roc_auc_asked": roc_auc(scores, truth), "threshold": best,
                    "balanced_accuracy": balanced_accuracy(scores, truth, -best) if reach else None,
                    "called_neutral": len(neutral), "of_them_neutral_by_hand": sum(r["label"] == 0 for r in neutral)},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--run", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--n", type=int, default=60)
    s.add_argument("--ids", help="only prompts whose id starts with this (e.g. gsm8k)")
    m = sub.add_parser("match")
    m.add_argument("--run", required=True)
    m.add_argument("--checked", default="benchmarks/data/judge_checked.jsonl")
    c = sub.add_parser("calibrate")
    c.add_argument("--run", required=True)
    args = parser.parse_args(argv)
    checked = Path(args.run) / "checked.jsonl"
    if args.command == "sample":
        rows = sample(args.run, args.n, args.ids)
        Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {len(rows)} mismatches to read to {args.out}")
    elif args.command == "match":
        rows = match(args.run, Path(args.checked))
        added = append_new(checked, rows)
        print(f"found {len(rows)} of the checked mismatches again; appended the {added} not yet in {checked}")
    else:
        rows = [json.loads(line) for line in checked.read_text(encoding="utf-8").splitlines() if line.strip()]
        result = calibrate([r for r in rows if r.get("label") in (0, 1)])
        RESULT.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
