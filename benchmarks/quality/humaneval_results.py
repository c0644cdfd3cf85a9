"""Where HumanEval answers are kept and how they are read: shared by the harness and its report (no torch).

``benchmarks/quality/humaneval.py`` writes one JSON line per task and system; ``benchmarks/quality/humaneval_report.py``
reads them. Both import these helpers from here, so neither imports the other's module.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

RESULTS = Path("benchmarks/results")
ROUTERS = ("r2r", "entropy", "random", "budget")


def parse_system(name: str) -> tuple[str, float | None]:
    """``"entropy@0.08"`` -> ``("entropy", 0.08)``; ``"slm"`` -> ``("slm", None)``."""
    kind, at, rate = name.partition("@")
    try:
        value = float(rate) if at else None
    except ValueError:
        value = -1.0
    plain = kind in ("slm", "llm", "r2r") and not at
    if not plain and not (kind in ROUTERS and value is not None and 0 < value <= 1):
        raise ValueError(f"Unknown system {name!r}; use slm, llm, r2r, or r2r@P, entropy@P, random@P, budget@P "
                         "with 0 < P <= 1.")
    return kind, value


def bootstrap_ci(values: list[float], samples: int = 2000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of the mean (tasks resampled with replacement)."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(samples))
    return [means[int(0.025 * samples)], means[int(0.975 * samples) - 1]]


def read_rows(path: Path) -> dict[str, dict]:
    """A system's answers by task id (none yet: empty)."""
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["task_id"]] = row
    return rows


def system_path(system: str, tag: str) -> Path:
    """Where a system's per-task answers are kept: slm/llm once, router systems per router tag."""
    folder = RESULTS / "humaneval"
    return folder / f"{system}.jsonl" if parse_system(system)[0] in ("slm", "llm") else folder / tag / f"{system}.jsonl"
