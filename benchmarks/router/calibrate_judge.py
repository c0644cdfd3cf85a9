"""Hand-checked mismatches: draw a sample to read, then choose the llm verifier's threshold on it.

    python -m benchmarks.router.calibrate_judge sample --run work/coder --out sample.jsonl [--n 90]
        # writes mismatches to read: the two sentences, their context, the code verifier's verdict;
        # a person adds "label": 0 (neutral) or 1 (divergent) and a "note" to each line
    python -m benchmarks.router.calibrate_judge calibrate --checked benchmarks/data/judge_checked.jsonl [--judge MODEL]
        # scores every checked line with the judge; reports ROC AUC, the threshold with the best balanced
        # accuracy and how the code verifier agrees with the person; -> benchmarks/results/judge_calibration.json

The sample is drawn with a fixed seed from the run's mismatches whose sentences differ: two thirds
from those the code verifier passes on (what the judge sees in a ``code,llm`` chain) and one third
from those it calls neutral (to check it).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from benchmarks.quality.router_quality import roc_auc

CHECKED = Path("benchmarks/data/judge_checked.jsonl")
GRID = [round(0.01 * i, 2) for i in range(1, 100)]


def draw(run: str, n: int, seed: int = 0) -> list[dict]:
    """Mismatches of ``run`` to read (see the module docstring)."""
    from transformers import AutoTokenizer

    from r2r_hf.pipeline.runner import answer_ids, shard_mismatches
    from r2r_hf.pipeline.sentences import sentence_end_ids
    from r2r_hf.pipeline.store import WorkDir, read_json
    from r2r_hf.pipeline.verifiers import CodeVerifier

    work = WorkDir(run)
    llm = work.manifest()["llm"]
    tok = AutoTokenizer.from_pretrained(llm)
    ends, (_, eos) = sentence_end_ids(tok), answer_ids(tok, llm)
    code, passed, neutral = CodeVerifier(), [], []
    for k in work.shards("continuations"):
        samples = read_json(work.shard("responses", k))["samples"]
        mismatches = read_json(work.shard("continuations", k))["mismatches"]
        for item, m in zip(shard_mismatches(work, k, samples, tok, ends, eos, work.manifest()["context_tokens"]),
                           mismatches):
            if m["identical"]:
                continue
            verdict = code.judge_one(item)
            row = {"id": f"{k}:{item.index}", "context": item.context[-400:], "slm_sentence": item.slm_sentence,
                   "llm_sentence": item.llm_sentence, "code": verdict.verdict, "code_why": verdict.why}
            (passed if verdict.verdict is None else neutral).append(row)
    rng = random.Random(seed)
    picked = rng.sample(passed, min(len(passed), 2 * n // 3)) + rng.sample(neutral, min(len(neutral), n - 2 * n // 3))
    rng.shuffle(picked)
    return picked


def balanced_accuracy(scores: list[float], labels: list[int], threshold: float) -> float:
    said = [int(s >= threshold) for s in scores]
    rates = []
    for cls in (0, 1):
        members = [d for d, y in zip(said, labels) if y == cls]
        if members:
            rates.append(sum(d == cls for d in members) / len(members))
    return sum(rates) / len(rates)


@torch.no_grad()
def calibrate(checked: Path, judge: str | None, batch_size: int = 8) -> dict:
    """Judge scores on the checked lines, the threshold with the best balanced accuracy, and agreements."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.models import fetch
    from r2r_hf.pipeline.verifiers.judge import JudgeVerifier, render

    rows = [json.loads(line) for line in checked.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if r.get("label") in (0, 1)]
    name = judge or fetch("llm", quiet=True)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(name)
    verifier = JudgeVerifier(model, tok, batch_size=batch_size, model_name=name)
    scores = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        scores += verifier.scores([render(tok, r["context"], r["slm_sentence"], r["llm_sentence"]) for r in chunk])
    judged = [(s, r["label"]) for s, r in zip(scores, rows) if r["code"] is None]  # what the judge sees after code
    js, jl = [s for s, _ in judged], [y for _, y in judged]
    best = max(GRID, key=lambda t: (balanced_accuracy(js, jl, t), -abs(t - 0.5)))
    code_neutral = [r for r in rows if r["code"] == 0]
    return {
        "checked": len(rows), "neutral_by_hand": sum(r["label"] == 0 for r in rows),
        "code_verifier": {"called_neutral": len(code_neutral),
                          "agreed": sum(r["label"] == 0 for r in code_neutral),
                          "passed_on": len(judged), "passed_on_neutral_by_hand": jl.count(0)},
        "judge_on_passed_on": {"roc_auc": roc_auc(js, jl), "threshold": best,
                               "balanced_accuracy": balanced_accuracy(js, jl, best),
                               "balanced_accuracy_at_0.5": balanced_accuracy(js, jl, 0.5),
                               "divergent_share_at_threshold": sum(s >= best for s in js) / max(len(js), 1)},
        "judge_on_all": {"roc_auc": roc_auc(scores, [r["label"] for r in rows])},
        "scores": [{"id": r["id"], "label": r["label"], "code": r["code"], "score": round(s, 4)}
                   for r, s in zip(rows, scores)],
        "judge": Path(name).name if Path(name).is_dir() else str(name),  # a local copy by its folder's name
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--run", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--n", type=int, default=90)
    c = sub.add_parser("calibrate")
    c.add_argument("--checked", default=str(CHECKED))
    c.add_argument("--judge", help="judge model folder or Hub id (default: the benchmark pair's LLM)")
    c.add_argument("--out", default="benchmarks/results/judge_calibration.json")
    args = parser.parse_args(argv)
    if args.command == "sample":
        rows = draw(args.run, args.n)
        Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {len(rows)} mismatches to {args.out}")
    else:
        result = calibrate(Path(args.checked), args.judge)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "scores"}, indent=1))


if __name__ == "__main__":
    main()
