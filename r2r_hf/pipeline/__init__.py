"""The R2R labeling pipeline: which SLM/LLM differences change the reasoning.

Steps (each resumable, shard by shard): 0 ``responses`` (LLM reference answers),
1 ``features`` (SLM prefill: the router's inputs per answer token), 2 ``continuations``
(LLM continues each mismatch to its sentence end), 3 ``verdicts`` (a chain of verifiers judges
neutral or divergent; ``verifiers/``), 4 ``labels`` (one label set per chain, with its summary).
"""

from .dataset import LabelData, load_labels
from .prompts import Prompt, read_prompts
from .runner import LabelSettings, label

__all__ = ["LabelData", "LabelSettings", "Prompt", "label", "load_labels", "read_prompts"]
