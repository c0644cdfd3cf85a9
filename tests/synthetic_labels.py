"""A labeling run written directly in the pipeline's on-disk format, with a learnable rule.

Divergent tokens are those whose hidden state has a large first coordinate; neutral ones a
large second coordinate; a few are excluded (unparsable verdict). Everything else is identical.
"""

import torch

from r2r_hf.pipeline.dataset import summarize
from r2r_hf.pipeline.store import LEGACY_SET, WorkDir, write_json, write_tensors


def write_synthetic_run(root, slm="org/slm", llm="org/llm", samples=80, tokens=40, shard_size=8, hidden=64, seed=0,
                        divergent_share=None):
    """``divergent_share`` 0.0 or 1.0 labels every judged token neutral or divergent (one class only)."""
    work = WorkDir(root)
    write_json(work.manifest_path, {"slm": slm, "llm": llm, "format": 1})
    g = torch.Generator().manual_seed(seed)
    for shard, first in enumerate(range(0, samples, shard_size)):
        ids = [f"s{i}" for i in range(first, min(first + shard_size, samples))]
        n = len(ids) * tokens
        h = torch.randn(n, hidden, generator=g)
        divergent = h[:, 0] > 1.6 if divergent_share is None else torch.full((n,), bool(divergent_share))
        neutral = ~divergent & (h[:, 1] > 1.2) if divergent_share is None else ~divergent
        excluded = ~divergent & ~neutral & (h[:, 2] > 2.5)
        slm_token = torch.randint(3, 300, (n,), generator=g)
        real_token = torch.where(divergent | neutral | excluded, slm_token + 1, slm_token)
        features = {
            "topk_logits": torch.randn(n, 100, generator=g).sort(dim=1, descending=True).values,
            "hidden": h,
            "token_embedding": torch.randn(n, hidden, generator=g),
            "slm_token": slm_token,
            "real_token": real_token,
            "sample": torch.arange(len(ids)).repeat_interleave(tokens).int(),
            "position": torch.arange(tokens).repeat(len(ids)).int(),
        }
        write_tensors(work.shard("features", shard), features, {"ids": ids, "tokens": n, "seconds": 0.1})
        label = torch.zeros(n, dtype=torch.int8)
        label[neutral], label[divergent], label[excluded] = 1, 2, -1
        write_tensors(work.shard("labels", shard), {"label": label}, {})
        write_json(work.shard("responses", shard), {"samples": [{"id": i, "finished": True} for i in ids],
                                                    "tokens": n, "seconds": 0.1})
        write_json(work.shard("continuations", shard), {"mismatches": [], "tokens": 1, "seconds": 0.1})
        write_json(work.shard("verdicts", shard), {"verdicts": [], "tokens": 1, "seconds": 0.1})
    summary = summarize(work, LEGACY_SET)  # a format-1 run: its one label set's summary sits in the run folder
    write_json(work.summary_path(LEGACY_SET), summary)
    return summary
