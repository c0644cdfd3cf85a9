"""The labeling steps, declared once: what each writes, where, and what it reads.

The store (file names), the runner (order, dispatch), the dataset (costs) and the CLI (``--steps``) all read
these declarations. Pure data, stdlib only: the CLI builds its parser from it before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

LEGACY_SET = "legacy"  # the label set of a format-1 run
LABEL_SET_FILES = ("settings.json", "summary.json")  # what a label set's folder holds besides its shards


@dataclass(frozen=True)
class Step:
    """One labeling step.

    Args:
        name: its folder under the run, and its name in ``label(steps=...)``.
        suffix: the file type of its shards.
        reads: the steps whose shards it reads.
        subsets: ``None``, or what its subfolders are (``"verifier"``: one per verifier key, ``"label set"``).
        shape: the JSON fields its readers rely on (``store.read_json``).
        costed: its shards record ``tokens``/``seconds``, summed into a label set's cost.
    """

    name: str
    suffix: str
    reads: tuple[str, ...] = ()
    subsets: str | None = None
    shape: tuple[tuple[str, type], ...] = ()
    costed: bool = False

    def __str__(self) -> str:
        return self.name


RESPONSES = Step("responses", ".json", shape=(("samples", list),), costed=True)
FEATURES = Step("features", ".safetensors", reads=("responses",), costed=True)
CONTINUATIONS = Step("continuations", ".json", reads=("responses", "features"), shape=(("mismatches", list),),
                     costed=True)
VERDICTS = Step("verdicts", ".json", reads=("responses", "continuations"), subsets="verifier",
                shape=(("verdicts", dict),))
LABELS = Step("labels", ".safetensors", reads=("features", "continuations", "verdicts"), subsets="label set")

STEPS: tuple[Step, ...] = (RESPONSES, FEATURES, CONTINUATIONS, VERDICTS, LABELS)  # in the order a run takes them
NAMES: tuple[str, ...] = tuple(s.name for s in STEPS)
BY_NAME: dict[str, Step] = {s.name: s for s in STEPS}


def step(name: str | Step) -> Step:
    """The declaration of a step given by name (or the step itself)."""
    if isinstance(name, Step):
        return name
    if name not in BY_NAME:
        raise ValueError(f"Unknown step {name!r}; choose from {', '.join(NAMES)}.")
    return BY_NAME[name]
