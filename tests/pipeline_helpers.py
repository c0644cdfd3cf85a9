"""Shared helpers of the labeling tests: a tiny related pair, a prompts file, a fast settings set."""

import json

from r2r_hf.pipeline import LabelSettings
from r2r_hf.testing import WORDS, save_tiny_pair, save_tiny_verifier


def write_prompts(path, count, start=0):
    with open(path, "w") as f:
        for i in range(start, start + count):
            words = " ".join(WORDS[(7 * i) % 150 : (7 * i) % 150 + 3 + i % 4])
            if i % 2:
                f.write(json.dumps({"id": f"p{i}", "prompt": f"{words} the old man said that"}) + "\n")
            else:
                f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"write {words}"}]}) + "\n")
    return str(path)


def make_models(root):
    slm, llm = save_tiny_pair(root, related=True)
    return slm, llm, save_tiny_verifier(root)


def fast_settings(slm, llm, judge, **overrides):
    values = dict(slm=slm, llm=llm, judge=judge, dtype="float32", max_new_tokens=20, batch_size=3,
                  continuation_max_tokens=8, context_tokens=32)
    values.update(overrides)
    return LabelSettings(**values)
