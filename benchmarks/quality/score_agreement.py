"""Where the LLM keeps the SLM's token, by the router's score: what a router's ``speculate_below`` is chosen from.

    python -m benchmarks.quality.score_agreement --router DIR --answers benchmarks/results/humaneval/TAG/r2r.jsonl
        [--tasks N] [--out benchmarks/results/score_agreement-TAG.json] [--threads 1]

Over a router's own HumanEval answers (its default run, ``benchmarks.quality.humaneval --systems r2r``), teacher-forced
in bf16: the SLM reads prompt + answer (the router's score and the SLM's argmax at every answer token) and so does the
LLM (its argmax). At the positions the router routes at its threshold, the share where the LLM's argmax is the SLM's,
by score band. A speculating row goes on with the SLM's token at a routed position and throws its draft where the LLM
disagrees, so a band where the LLM seldom keeps the token is where a row should wait instead. The rule this prints
(``speculate_below``) writes down the one the previous shipped router's 0.95 was chosen by (its bands then: 58-60 %
kept above, 91-96 % below): the lowest band edge, the threshold included, at and above which the LLM keeps fewer
than two in three of the SLM's tokens (none: the router is saved without it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.quality.humaneval import Runner, _problems
from r2r_hf.core.features import Features, score
from r2r_hf.pipeline.prefill import slm_features
from benchmarks.quality.humaneval_results import read_rows

EDGES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)  # band edges above the threshold (scores lie in [0, 1])
# Below this share kept, a routed position waits: a draft of depth d at a position kept with probability p throws
# (1 - p) of its d tokens, so below 2/3 a row throws away more than half of what it keeps there.
KEEPS = 2 / 3


@torch.no_grad()
def positions(runner: Runner, answers: dict[str, dict], tasks: int | None = None) -> dict[str, torch.Tensor]:
    """Every answer token's router score and whether the LLM's argmax there is the SLM's (teacher-forced), over the
    first ``tasks`` of HumanEval's order that ``answers`` holds."""
    scores, kept, model = [], [], runner.r2r  # (the SLM's read gives the router's inputs and its proposals)
    for problem in [p for p in _problems() if p["task_id"] in answers][:tasks]:
        row = answers[problem["task_id"]]
        prompt = runner.tok(runner.chat_text(problem), add_special_tokens=False)["input_ids"]
        answer = runner.tok(row["answer"], add_special_tokens=False)["input_ids"]
        if not answer:
            continue
        read, _ = slm_features(model.slm, [{"id": problem["task_id"], "prompt_ids": prompt, "response_ids": answer}],
                               model.config.num_topk_logits, model.shared_vocab_size)
        scores.append(score(model.router, Features.from_dict(read)))
        ids = torch.tensor([prompt + answer])
        reads = slice(len(prompt) - 1, len(prompt) + len(answer) - 1)  # the logits that predict each answer token
        llm = runner.llm(input_ids=ids).logits[0, reads, :model.shared_vocab_size].argmax(-1)
        kept.append(read["slm_token"] == llm)
    if not scores:
        raise ValueError("no answer to read: the answers file holds none of the tasks asked for (--tasks).")
    return {"scores": torch.cat(scores), "kept": torch.cat(kept), "tasks": len(scores)}


def bands(scores: torch.Tensor, kept: torch.Tensor, threshold: float) -> dict:
    """Routed positions (score >= ``threshold``) by band: how many, and the share the LLM keeps, in each band and
    at and above each edge; the rule's ``speculate_below``."""
    edges = [threshold] + [e for e in EDGES if e > threshold]
    routed = scores >= threshold
    table = []
    for low, high in zip(edges, edges[1:] + [float("inf")]):
        inside, above = routed & (scores >= low) & (scores < high), routed & (scores >= low)
        table.append({"from": round(low, 4), "to": None if high == float("inf") else high,
                      "positions": int(inside.sum()), "kept": _share(kept, inside),
                      "positions_at_or_above": int(above.sum()), "kept_at_or_above": _share(kept, above)})
    below = next((b["from"] for b in table if b["kept_at_or_above"] is not None and b["kept_at_or_above"] < KEEPS),
                 None)  # (the threshold itself: every routed position waits)
    return {"threshold": threshold, "answer_tokens": len(scores), "routed": int(routed.sum()),
            "kept_where_routed": _share(kept, routed), "bands": table, "speculate_below": below}


def _share(kept: torch.Tensor, where: torch.Tensor) -> float | None:
    """The share of ``where``'s positions the LLM kept (none there: None)."""
    return round(kept[where].float().mean().item(), 4) if where.any() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", required=True, help="the router folder")
    parser.add_argument("--answers", required=True, help="the router's default HumanEval answers (a .jsonl)")
    parser.add_argument("--tasks", type=int, help="the first N tasks of HumanEval's order (default: all answered)")
    parser.add_argument("--out", help="where to write the table (JSON)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    answers = read_rows(Path(args.answers))
    if not answers:
        raise SystemExit(f"{args.answers} holds no answers; run benchmarks.quality.humaneval --systems r2r first.")
    runner = Runner(args.router, None, 0, torch.bfloat16)
    found = positions(runner, answers, args.tasks)
    result = {"router": args.router, "answers": args.answers, "tasks": found["tasks"],
              **bands(found["scores"], found["kept"], runner.r2r.config.threshold)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
