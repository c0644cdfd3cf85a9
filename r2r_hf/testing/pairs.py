"""A pair under the family matrix's test (``matrix.py``) and how its answers are compared.

``Pair`` holds one pair of ``families.py`` with its R2R model, the prompts (a left-padded batch of three rows) and
what several cells compare against; the helpers generate rows alone and say where two answers first differ
(``Mismatch``).
"""

from __future__ import annotations

import copy
import functools

import torch

from .builds import build_pair
from .models import EOS_ID, PAD_ID, make_tokenizer

PROMPTS = ((17, 41, 99), (23, 8, 150, 61, 7, 230, 12), (5, 77, 310, 9, 44, 120, 33, 260, 18, 71, 140))
NEW = 40  # answer tokens: every prompt runs past a 16-token window and the long-RoPE pair past its 16-token context
SPECULATE = dict(speculate=4, llm_max_wait=16)
ROUTER = dict(router_hidden_dims=[16], router_expansion=1)
LOGITS = dict(return_dict_in_generate=True, output_logits=True)


class Mismatch(AssertionError):
    """An answer of R2R differs from what it must equal."""


class Refused(Exception):
    """The answers were exact, with a feature R2R turned off for the pair (its sentence)."""


class Pair:
    """One pair under test: the models, the R2R model, prompts and what is computed once for several cells."""

    def __init__(self, name: str) -> None:
        from r2r_hf import R2RForCausalLM

        self.name = name
        self.slm, self.llm = build_pair(name)
        self.model = R2RForCausalLM.from_models(self.slm, self.llm, **ROUTER)
        self.tok = make_tokenizer()
        self.batch = padded(PROMPTS)
        self._threshold: float | None = None
        self._alone: dict[int, object] = {}

    @property
    def threshold(self) -> float:
        """A threshold that routes about 40 % of the never-routed answers' tokens, in the widest gap between router
        scores there (no score sits on it: a rounding cannot flip a decision)."""
        if self._threshold is None:
            out = self.model.generate(**self.batch, **greedy(), threshold=float("inf"), return_dict_in_generate=True)
            scores = out.router_scores[out.generated_mask].sort().values
            gaps = scores[1:] - scores[:-1]
            lo, hi = int(len(gaps) * 0.45), int(len(gaps) * 0.75)
            i = lo + int(gaps[lo:hi].argmax())
            self._threshold = float((scores[i] + scores[i + 1]) / 2)
        return self._threshold

    @functools.cached_property
    def mixed_out(self):
        """The eager, dynamic-cache mixed answers of the padded batch, with who wrote each token (``routed``)."""
        return self.model.generate(**self.batch, **greedy(), threshold=self.threshold, return_dict_in_generate=True)

    @property
    def mixed(self) -> torch.Tensor:
        """The eager mixed answers of the padded batch (what the other paths must equal)."""
        return self.mixed_out.sequences

    def mixed_alone(self, r: int):
        """Prompt ``r``'s eager mixed answer alone, as ``mixed_out`` (computed once: several cells compare with it)."""
        if r not in self._alone:
            alone = row(self.batch, r)
            self._alone[r] = self.model.generate(**alone, **greedy(), threshold=self.threshold,
                                                 return_dict_in_generate=True)
        return self._alone[r]

    @functools.cached_property
    def unrelated(self) -> Pair:
        """The same SLM with an LLM that agrees with it on almost no token (``builds.unrelated_llm``)."""
        from r2r_hf import R2RForCausalLM

        from .builds import unrelated_llm

        other = object.__new__(Pair)
        other.name, other.tok, other.batch, other._threshold, other._alone = self.name, self.tok, self.batch, None, {}
        other.slm, other.llm = self.slm, unrelated_llm(self.name)
        other.model = R2RForCausalLM(self.model.config).eval()
        other.model.router.load_state_dict(self.model.router.state_dict())
        other.model.set_models(other.slm, other.llm)
        return other

    @functools.cached_property
    def bf16(self) -> Pair:
        """The same pair in bfloat16 (the router stays fp32)."""
        from r2r_hf import R2RForCausalLM

        other = object.__new__(Pair)
        other.name, other.tok, other.batch, other._threshold = self.name, self.tok, self.batch, self._threshold
        other._alone = {}
        other.slm, other.llm = (copy.deepcopy(m).to(torch.bfloat16) for m in (self.slm, self.llm))
        other.model = R2RForCausalLM(self.model.config).eval()
        other.model.router.load_state_dict(self.model.router.state_dict())
        other.model.set_models(other.slm, other.llm)
        return other


def padded(prompts) -> dict[str, torch.Tensor]:
    """A left-padded batch of ``prompts`` (token id lists), with its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return {"input_ids": ids, "attention_mask": mask}


def row(batch: dict, r: int) -> dict[str, torch.Tensor]:
    """Row ``r`` of a padded batch alone (its padding dropped)."""
    keep = batch["attention_mask"][r].bool()
    return {k: v[r : r + 1, keep] for k, v in batch.items()}


def greedy(**extra) -> dict:
    return dict(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD_ID, eos_token_id=EOS_ID, **extra)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` and ``want`` (token ids) are equal, or ``Mismatch`` says where they first differ."""
    if got.shape == want.shape and torch.equal(got, want):
        return
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    r, c = (got != want).nonzero()[0].tolist()
    raise Mismatch(f"{what}: row {r} differs at column {c} ({got[r, c].item()} != {want[r, c].item()})")


def same_logits(got, want, width: int, who: str) -> None:
    """Two ``generate`` outputs with ``LOGITS``: the same sequences, and every logit of a running row the same to the
    bit (rounding tells positions and rotary factors apart where tokens may not)."""
    same(got.sequences, want.sequences, f"{who} against the model's own generate")
    ended = torch.zeros(len(got.sequences), dtype=torch.bool)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        a, b = a[~ended], b[~ended, : a.shape[1]]  # (a finished row's logits are no answer's)
        if not torch.equal(a, b):
            raise Mismatch(f"{who}: the logits of step {step} differ from the model's own generate (by "
                           f"{(a - b).abs().max().item():.3g})")
        ended |= got.sequences[:, width + step] == EOS_ID


def same_as_alone(batched: torch.Tensor, alone: list[torch.Tensor], width: int, what: str) -> None:
    """Each row of a batch's answers (after ``width`` prompt columns) equals the row's answer alone (up to its
    end: a row alone stops at its EOS where the batch pads after it)."""
    for r, answer in enumerate(alone):
        got = batched[r, width : width + len(answer)]
        same(got[None], answer[None], f"{what}, row {r} of the padded batch against the row alone")
