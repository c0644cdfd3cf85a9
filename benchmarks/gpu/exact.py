"""Teacher-forced agreement of the fused LLM against its own eager forward, at the device's shapes.

The first device run passed the 32B's fused self-check only once its tolerance was widened (5 % of the largest
logit, then twice what HF's own slot read departs by: 8.6 %), and compared the fused 32B with nothing else. Here
one fixed token sequence is read both ways: HF's eager forward over the whole sequence (the reference, bf16), and
the server's fused packed reads over the grid's slots of the long answers' server (``PackedSteps``, captured as the server replays them), in
pieces of ``GROUPS[-1]`` tokens per row keeping the logits at every position. At each position: whether the argmax
token is the same (what an exactness claim rests on), and the difference relative to the position's largest logit
(the tolerance check's measure, as a second opinion).
"""

from __future__ import annotations

import torch

from r2r_hf.core.layouts.packed import GROUPS, pack


@torch.no_grad()
def fused_against_eager(grid, rows: int, length: int, tolerance: float | None = None, seed: int = 3) -> dict:
    """Argmax agreement and the largest relative difference of the fused LLM's logits against its eager forward at
    ``rows`` x ``length`` positions (the first ``rows`` slots of the grid's long answers' batch are written from
    column 0)."""
    layout = grid.long.layout
    llm, reads, tokens = grid.model.llm, layout.path.llm.steps, layout.tokens
    if length + 1 > reads.cache.capacity:
        raise ValueError(f"{length} positions do not fit the grid's {reads.cache.capacity} columns")
    vocab = llm.get_output_embeddings().weight.shape[0]
    generator = torch.Generator(tokens.device).manual_seed(seed)
    ids = torch.randint(100, vocab - 100, (rows, length), device=tokens.device, generator=generator)
    tokens[:rows, :length] = ids
    fused = []
    for start in range(0, length, GROUPS[-1]):
        n = min(GROUPS[-1], length - start)
        wanted = [(r, start + j) for r in range(rows) for j in range(n)]
        plan = pack(list(range(rows)), [start] * rows, [n] * rows, wanted, len(wanted))
        fused.append(reads.read(tokens, plan).float().view(rows, n, -1))
    fused = torch.cat(fused, dim=1)
    eager = llm(input_ids=ids).logits.float()
    width = min(fused.shape[-1], eager.shape[-1])
    fused, eager = fused[..., :width], eager[..., :width]
    same = fused.argmax(-1) == eager.argmax(-1)
    relative = (fused - eager).abs().amax(-1) / eager.abs().amax(-1)
    out = {"positions": rows * length, "rows": rows, "argmax_equal": float(same.float().mean()),
           "argmax_differs_at": int((~same).sum()), "max_rel": float(relative.max()),
           "mean_rel": float(relative.mean()), "dtype": str(llm.dtype)}
    if tolerance is not None:
        out.update(tolerance=tolerance, within_tolerance=out["max_rel"] <= tolerance)
    return out
