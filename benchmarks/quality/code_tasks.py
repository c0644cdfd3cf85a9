"""HumanEval + MBPP+ (563 tasks): SLM and LLM alone, R2R and the SLM's entropy at equal LLM token rates.

    python -m benchmarks.quality.code_tasks plan                       # once: benchmarks/data/code563_batches.json
    python -m benchmarks.quality.code_tasks run --systems slm,llm      # the anchors (kept once for every router)
    python -m benchmarks.quality.code_tasks run --router DIR --tag NAME --systems r2r@0.04,entropy@0.04
    python -m benchmarks.quality.code_tasks report --tag NAME --systems slm,llm,r2r@0.04,entropy@0.04
    python -m benchmarks.quality.code_tasks compare --systems r2r@0.04 --tags shipped,NAME --against NAME/entropy@0.04

Greedy, chat template, bf16 weights, 384 new tokens, one torch thread. **Batches are planned once** and kept as a
file: in bf16 an answer depends on the rows it is batched with (padding, kernel shapes), so every system answers the
same batches in the same order, and a resumed run answers a batch exactly as a whole run does (a batch is answered
whole; only its missing tasks are written). Answers are appended per batch to
``benchmarks/results/code563/[TAG/]SYSTEM.jsonl``; an interrupted run resumes at its first unanswered batch, with
the threads it started with (``--threads``: in bf16 the thread count moves rounding too, so a router's threshold
placed with two threads is not the one placed with one; a resumed run that finds another threshold refuses).

Thresholds, as ``humaneval.py`` places them (no outcome is looked at): ``r2r@P`` routes a share P of the tokens of
the SLM's own answers to all 563 tasks, teacher-forced through the SLM; ``entropy@P`` routes, over ``r2r@P``'s
answers teacher-forced, the share of tokens ``r2r@P`` measured, so the two spend the same LLM tokens.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.quality.humaneval import Runner, extract_code
from benchmarks.quality.humaneval_report import mcnemar_exact
from benchmarks.quality.humaneval_results import bootstrap_ci, parse_system, read_rows
from benchmarks.quality.suites import Task, all_tasks

PLAN = Path("benchmarks/data/code563_batches.json")
RESULTS = Path("benchmarks/results/code563")


def plan_batches(tasks: list[Task], lengths: dict[str, int], size: int) -> list[list[str]]:
    """Batches of ``size`` tasks of similar prompt length (shortest first, ties by suite order): little padding."""
    order = sorted(range(len(tasks)), key=lambda i: (lengths[tasks[i].task_id], i))
    ids = [tasks[i].task_id for i in order]
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def write_plan(tokenizer, size: int = 8, path: Path = PLAN) -> dict:
    tasks = all_tasks()
    lengths = {t.task_id: len(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True,
                                                             tokenize=False)) for t in tasks}
    plan = {"batch_size": size, "order": "chat-templated prompt length in characters, then HumanEval before MBPP+ "
                                         "in each suite's order", "batches": plan_batches(tasks, lengths, size)}
    path.write_text(json.dumps(plan, indent=0))
    return plan


def read_plan(path: Path = PLAN) -> list[list[str]]:
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; write it once with `python -m benchmarks.quality.code_tasks "
                                "plan` (every system must answer the same batches).")
    return json.loads(path.read_text())["batches"]


def system_file(system: str, tag: str | None) -> Path:
    """slm and llm once for every router; router systems under their router's tag."""
    anchor = parse_system(system)[0] in ("slm", "llm")
    if not anchor and not tag:
        raise ValueError(f"{system} is a router system; name its router's results with --tag.")
    return RESULTS / f"{system}.jsonl" if anchor else RESULTS / tag / f"{system}.jsonl"


def measured_rate(rows: dict[str, dict]) -> float:
    return sum(r["routed_tokens"] for r in rows.values()) / max(sum(r["generated_tokens"] for r in rows.values()), 1)


def place_threshold(runner: Runner, system: str, tag: str | None, tasks: dict[str, Task]) -> float | None:
    """The threshold of a router system (see the module docstring); None for slm and llm."""
    from r2r_hf.training import threshold_for_rate

    kind, rate = parse_system(system)
    if kind in ("slm", "llm"):
        return None
    if kind == "r2r" and rate is None:
        return runner.r2r.config.threshold
    source = "slm" if kind == "r2r" else f"r2r@{rate}"
    answers = read_rows(system_file(source, tag))
    if len(answers) != len(tasks):
        raise ValueError(f"{system}'s threshold is placed on the answers of {source}, which has {len(answers)} of "
                         f"{len(tasks)}; run {source} to the end first.")
    model = runner.r2r if kind == "r2r" else runner.baseline(kind)
    scores = runner.transcript_scores(model, [(tasks[t], answers[t]["answer"]) for t in tasks])
    return threshold_for_rate(scores, rate if kind == "r2r" else measured_rate(answers))


def run_system(runner: Runner, system: str, tag: str | None, tasks: dict[str, Task], batches: list[list[str]]) -> None:
    """Answer and grade every planned batch the system has not answered whole, in the plan's order."""
    from tqdm.auto import tqdm

    path = system_file(system, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_rows(path)
    todo = [b for b in batches if any(t not in done for t in b)]
    if not todo:
        return
    threshold = place_threshold(runner, system, tag, tasks)
    stale = {r["threshold"] for r in done.values()} - {threshold}
    if stale:
        raise ValueError(f"{path} was answered at threshold {stale.pop()} but the threshold is now {threshold}; "
                         "delete the file to rerun that system.")
    with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc=system, unit="batch") as bar:
        for batch in todo:
            problems = [tasks[t] for t in batch]
            for task, row in zip(problems, runner.generate(system, problems, threshold)):
                if task.task_id in done:
                    continue
                outcome = task.grade(extract_code(row["answer"]))
                row.update(task_id=task.task_id, suite=task.suite, status=outcome.status, detail=outcome.detail,
                           threshold=threshold)
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(1)


def summary(rows: dict[str, dict]) -> dict:
    passed = [1.0 if r["status"] == "passed" else 0.0 for r in rows.values()]
    by_suite = {s: sum(r["status"] == "passed" for r in rows.values() if r["suite"] == s) for s in ("humaneval", "mbpp+")}
    return {"tasks": len(rows), "passed": int(sum(passed)), "by_suite": by_suite,
            "pass_at_1": sum(passed) / max(len(passed), 1), "ci95": bootstrap_ci(passed) if passed else None,
            "llm_token_rate": measured_rate(rows), "generated_tokens": sum(r["generated_tokens"] for r in rows.values()),
            "threshold": next(iter(rows.values())).get("threshold") if rows else None}


def paired(a: dict[str, dict], b: dict[str, dict]) -> dict:
    """Tasks only ``a`` passes, only ``b`` passes, and the exact two-sided McNemar p-value (on the tasks both ran)."""
    common = sorted(set(a) & set(b))
    only_a = [t for t in common if a[t]["status"] == "passed" and b[t]["status"] != "passed"]
    only_b = [t for t in common if a[t]["status"] != "passed" and b[t]["status"] == "passed"]
    return {"tasks": len(common), "only_first": len(only_a), "only_second": len(only_b),
            "p_value": mcnemar_exact(len(only_a), len(only_b)), "only_first_tasks": only_a, "only_second_tasks": only_b}


def report(systems: list[str], tag: str | None, total: int) -> dict:
    """Every system's passes (complete or not: ``tasks`` says how many it answered), and R2R against entropy."""
    rows = {s: read_rows(system_file(s, tag)) for s in systems}
    out = {"benchmark": f"HumanEval (164) + MBPP+ (399), {total} tasks", "router": tag,
           "systems": {s: summary(r) for s, r in rows.items() if r}, "pairs": {}}
    for system in systems:
        kind, rate = parse_system(system)
        other = f"entropy@{rate}"
        if kind == "r2r" and rate is not None and rows.get(other):
            out["pairs"][f"{system} vs {other}"] = paired(rows[system], rows[other])
    return out


def compare(system: str, tags: list[str], others: list[str]) -> dict:
    """One router system across routers (``tags``: the first against each other), and the first router's against
    ``others`` (``TAG/SYSTEM`` or an anchor): passes, LLM token rates, paired counts and McNemar p-values."""
    first, rest = tags[0], tags[1:]
    rows = {f"{tag}/{system}": read_rows(system_file(system, tag)) for tag in tags}
    for other in others:
        tag, _, name = other.rpartition("/")
        rows[other] = read_rows(system_file(name, tag or None))
    head = f"{first}/{system}"
    return {"benchmark": "HumanEval (164) + MBPP+ (399)", "systems": {k: summary(r) for k, r in rows.items()},
            "pairs": {f"{head} vs {k}": paired(rows[head], rows[k]) for k in rows if k != head},
            "routers": [f"{tag}/{system}" for tag in rest]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("plan", "run", "report", "compare"))
    parser.add_argument("--systems", default="slm,llm")
    parser.add_argument("--router", help="the router folder (router systems)")
    parser.add_argument("--tag", help="names the router's results (benchmarks/results/code563/TAG/)")
    parser.add_argument("--tags", help="compare: routers' tags, the first against the rest (e.g. shipped,new)")
    parser.add_argument("--against", default="", help="compare: more systems, TAG/SYSTEM or an anchor (slm, llm)")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    systems = args.systems.split(",")
    for system in systems:
        parse_system(system)
    if args.command == "report":
        result = report(systems, args.tag, len(all_tasks()))
        out = RESULTS.parent / f"code563-{args.tag or 'anchors'}.json"
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items()}, indent=1)[:4000])
        return
    if args.command == "compare":
        tags = args.tags.split(",")
        result = compare(systems[0], tags, [o for o in args.against.split(",") if o])
        out = RESULTS.parent / f"code563-compare-{'-vs-'.join(tags)}.json"
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result["pairs"].items()}, indent=1)[:3000])
        return
    if args.command == "plan":
        from transformers import AutoTokenizer

        from benchmarks.models import fetch

        print(f"planned {len(write_plan(AutoTokenizer.from_pretrained(fetch('slm', quiet=True)))['batches'])} batches "
              f"into {PLAN}")
        return
    runner = Runner(args.router or "", None, args.max_new_tokens, torch.bfloat16, messages=lambda t: list(t.messages))
    tasks = {t.task_id: t for t in all_tasks()}
    batches = read_plan()
    for system in systems:
        run_system(runner, system, args.tag, tasks, batches)


if __name__ == "__main__":
    main()
