"""Teacher-forced agreement of two engines: the same tokens fed through both, their logits compared.

Generated sequences stop being comparable after the first near-tie that two paths break
differently (in bf16 a captured step and an eager one round differently), so the fast path's
numerics are checked teacher-forced: both engines read one fixed token sequence exactly as the
loop would (the SLM one token at a time, the LLM in catch-up reads of given lengths) and every
logit they produce is compared. Used by the tests (fp32: equal to rounding; bf16: within a stated
tolerance) and by the GPU check at real shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.layouts.rectangle import ModelCalls
from ..core.features import positions_from_mask
from ..core.layouts.rectangle import Committed


def teacher_forced(steps: ModelCalls, ids: torch.Tensor, prompt: int, reads: list[int]) -> dict[str, list[torch.Tensor]]:
    """Logits of the SLM at every step and of the LLM at every catch-up, reading ``ids`` [B, T].

    Args:
        steps: an engine whose ``capacity`` holds T tokens.
        ids: the prompt (first ``prompt`` columns, no padding) and the tokens committed after it.
        prompt: prompt length.
        reads: token counts of the LLM's catch-up reads, in order (the first includes the prompt); their
            sum must stay within T.
    """
    if sum(reads) > ids.shape[1]:
        raise ValueError(f"the reads cover {sum(reads)} tokens but ids holds {ids.shape[1]}.")
    mask = torch.ones_like(ids[:, :prompt])
    seq = Committed.from_prompt(ids[:, :prompt], None, positions_from_mask(mask), steps.capacity)
    read_at = set(torch.tensor(reads).cumsum(0).tolist())
    out: dict[str, list[torch.Tensor]] = {"slm": [steps.slm_read(seq, 0)[0].float()], "llm": []}
    seen = 0
    for t in range(prompt, ids.shape[1]):
        seq.append(ids[:, t])
        if seq.length in read_at:
            out["llm"].append(steps.llm_read(seq, seen).float())
            seen = seq.length
        out["slm"].append(steps.slm_read(seq, seq.length - 1)[0].float())
    return out


@dataclass(frozen=True)
class Agreement:
    """How far two engines' teacher-forced logits are apart.

    Args:
        max_abs: the largest |difference| of any logit.
        max_rel: that, divided by the largest |logit| of the reference at the same step.
        argmax: the share of (row, step) whose argmax token is the same.
        steps: logit vectors compared per row.
    """

    max_abs: float
    max_rel: float
    argmax: float
    steps: int


def agreement(reference: dict[str, list[torch.Tensor]], other: dict[str, list[torch.Tensor]]) -> dict[str, Agreement]:
    """Per model ("slm", "llm"), how ``other``'s teacher-forced logits agree with ``reference``'s."""
    found = {}
    for role in ("slm", "llm"):
        a, b = torch.stack(reference[role]), torch.stack(other[role])
        diff, same = (a - b).abs().amax(-1), a.argmax(-1) == b.argmax(-1)
        # the share counted exactly (a float mean on CUDA gave 0.99999994 for all of 418 the same: the H200 run)
        found[role] = Agreement(max_abs=diff.max().item(), max_rel=(diff / a.abs().amax(-1)).max().item(),
                                argmax=same.sum().item() / same.numel(), steps=a.shape[0])
    return found


def argmax_without_cache(model, ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] the next token ``model`` picks after ``ids`` [B, T] (left-padded by ``mask``), read in one cache-free
    forward over the whole sequence: the reference that a cached, routed loop must reproduce."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1, :vocab].argmax(-1)
