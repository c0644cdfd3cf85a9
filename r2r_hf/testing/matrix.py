"""The family matrix: every pair of ``families.py`` through R2R's public API, each path against the models' own
``generate``.

A *cell* is one path of one pair: a function that runs it and raises ``Mismatch`` where R2R's answer departs from
what it must equal (never-route = ``slm.generate``, always-route = ``llm.generate``, mixed = a cache-free
recompute, on a padded batch and on each prompt alone, a speculating, static, captured or served answer = the eager
one, a reloaded router = the saved one). The served cells are in ``served_cells.py``. ``run_cell`` classifies what
happened:

* ``ok``       the answers are exact (and where R2R ran a slower path than asked, ``note`` says which, as it logged);
* ``refused``  R2R turned the path's feature off for the pair, in one sentence (speculation, for a model whose
               cache cannot be cut back), and the answers are exact without it: a refusal, never a pass;
* ``wrong``    an answer differs (a silent error);
* ``crash``    any other exception (a traceback from inside R2R or transformers).

``tests/test_model_families.py`` runs the cells (0 wrong, 0 crash); ``table.py`` renders the docs table from the same
outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .models import EOS_ID, PAD_ID
from .pairs import LOGITS, NEW, PROMPTS, SPECULATE, Mismatch, Pair, Refused, greedy, row, same
from .pairs import same_as_alone, same_logits
from .served_cells import cell_served, cell_served_captured, cell_served_speculation, refused_speculation


@dataclass(frozen=True)
class Outcome:
    status: str  # ok, refused, wrong, crash
    detail: str = ""  # the refusal's sentence, the mismatch, or the exception
    note: str = ""  # where R2R ran a slower path than asked: what it logged (one line per sentence)


# ------------------------------------------------------------------------------------------------- the cells
def cell_generate(p: Pair) -> None:
    """fp32, greedy: never-route = slm.generate, always-route = llm.generate (a padded batch and each row alone);
    a mixed batch's rows = each row alone (where HF's own padded batch equals its rows alone); a mixed row = the
    cache-free recompute of its routed positions."""
    width, consistent = p.batch["input_ids"].shape[1], True
    for threshold, hf in ((float("inf"), p.slm), (0.0, p.llm)):
        who = "never-route" if hf is p.slm else "always-route"
        full = hf.generate(**p.batch, **greedy(**LOGITS))
        same_logits(p.model.generate(**p.batch, **greedy(**LOGITS), threshold=threshold), full, width, who)
        want = full.sequences
        for r in range(len(PROMPTS)):
            alone = row(p.batch, r)
            hf_alone = hf.generate(**alone, **greedy())
            same(p.model.generate(**alone, **greedy(), threshold=threshold), hf_alone,
                 f"{who}, row {r} alone against the model's own generate")
            consistent &= torch.equal(want[r, width : width + hf_alone.shape[1] - alone["input_ids"].shape[1]],
                                      hf_alone[0, alone["input_ids"].shape[1]:])
    if consistent:
        alone = [p.mixed_alone(r).sequences[0, len(row(p.batch, r)["input_ids"][0]):] for r in range(len(PROMPTS))]
        same_as_alone(p.mixed, alone, width, "mixed")
    recompute(p, p.batch, p.mixed_out)


def cell_mixed_alone(p: Pair) -> None:
    """Mixed routing on each prompt alone (no padding): every token = a cache-free recompute of its writer."""
    for r in range(len(PROMPTS)):
        recompute(p, row(p.batch, r), p.mixed_alone(r), f"prompt {r} alone")


def recompute(p: Pair, batch: dict, out, where: str = "the padded batch") -> None:
    """Every token of ``out``, ``batch``'s mixed answers, is the argmax of the model that wrote it over the sequence
    before it, read without a cache: one forward over the whole sequence (causal: each position sees what came before
    it), or one per length for a long-RoPE model (its factors follow the length, as in its own generate)."""
    from ..core.features import lm_forward, positions_from_mask
    from ..core.layouts.model_calls import long_rope_switch

    seq, start = out.sequences, batch["input_ids"].shape[1]
    mask = torch.cat([batch["attention_mask"], torch.ones_like(seq[:, start:])], 1)
    vocab, new = p.model.shared_vocab_size, seq.shape[1] - start
    def read(model, end: int, keep: int) -> torch.Tensor:  # the logits after the last ``keep`` of ``end`` columns
        return lm_forward(model, seq[:, :end], mask[:, :end], positions_from_mask(mask[:, :end]), None, keep)

    want = {}  # [B, new]: each model's token after each of the answer's prefixes
    for name, model in (("SLM", p.slm), ("LLM", p.llm)):
        if long_rope_switch(model) is None:
            logits = read(model, start + new - 1, new)
        else:
            logits = torch.cat([read(model, end, 1) for end in range(start, start + new)], 1)
        want[name] = logits[..., :vocab].argmax(-1)
    live = torch.ones(len(seq), dtype=torch.bool)
    for i in range(new):
        for r in range(len(seq)):
            who = "LLM" if out.routed[r, i] else "SLM"
            if live[r] and seq[r, start + i] != want[who][r, i]:
                raise Mismatch(f"mixed, {where}: row {r}'s answer token {i} ({who}) is {seq[r, start + i].item()}, a cache-free "
                               f"forward gives {want[who][r, i].item()}")
        live &= seq[:, start + i] != EOS_ID


def cell_sampled(p: Pair) -> None:
    """fp32, seeded sampling, one row and the padded batch: never-route = slm.generate, always-route = llm.generate
    (same seed)."""
    options = dict(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, pad_token_id=PAD_ID,
                   eos_token_id=EOS_ID)
    for batch, where in ((row(p.batch, 1), "one prompt"), (p.batch, "the padded batch")):
        for threshold, hf in ((float("inf"), p.slm), (0.0, p.llm)):
            torch.manual_seed(7)
            want = hf.generate(**batch, **options)
            same(p.model.generate(**batch, **options, seed=7, threshold=threshold), want, f"seeded sampling, {where}")


def cell_bf16(p: Pair) -> None:
    """bfloat16, greedy: never- and always-route over a padded batch = the model's own generate over it, to the bit
    of every logit a running row gets (rounding tells positions apart where tokens may not), and each row alone =
    the model's own generate alone (where HF's padded batch equals its rows alone, so does R2R's)."""
    q = p.bf16
    width = q.batch["input_ids"].shape[1]
    for threshold, hf in ((float("inf"), q.slm), (0.0, q.llm)):
        who = "bf16 never-route" if hf is q.slm else "bf16 always-route"
        same_logits(q.model.generate(**q.batch, **greedy(**LOGITS), threshold=threshold),
                    hf.generate(**q.batch, **greedy(**LOGITS)), width, who)
        for r in range(len(q.batch["input_ids"])):
            alone = row(q.batch, r)
            same(q.model.generate(**alone, **greedy(), threshold=threshold), hf.generate(**alone, **greedy()),
                 f"{who}, row {r} alone against the model's own generate")


def cell_speculation(p: Pair) -> None:
    """Speculating (greedy, mixed threshold): the padded batch and one row = without speculation."""
    same(p.model.generate(**p.batch, **greedy(**SPECULATE), threshold=p.threshold), p.mixed, "speculating batch")
    same(p.model.generate(**row(p.batch, 2), **greedy(**SPECULATE), threshold=p.threshold),
         p.mixed_alone(2).sequences, "speculating row")
    refused_speculation(p.slm, p.llm)


def cell_unrelated(p: Pair) -> None:
    """Speculating with an LLM that agrees with the SLM on almost no token (every routed position rejected, every
    tail cut back): = without speculation, the padded batch."""
    q = p.unrelated
    want = q.model.generate(**q.batch, **greedy(), threshold=q.threshold)
    same(q.model.generate(**q.batch, **greedy(**SPECULATE), threshold=q.threshold), want, "unrelated LLM, speculating")
    refused_speculation(q.slm, q.llm)


def cell_static(p: Pair) -> None:
    """``cache_implementation="static"`` (eager on a CPU) = the dynamic cache: the padded batch and each prompt alone
    (no padding: HF's masks take other paths)."""
    static = greedy(cache_implementation="static")
    same(p.model.generate(**p.batch, **static, threshold=p.threshold), p.mixed, "static cache")
    for r in range(len(PROMPTS)):
        alone = row(p.batch, r)
        same(p.model.generate(**alone, **static, threshold=p.threshold), p.mixed_alone(r).sequences,
             f"static cache, prompt {r} alone")


def cell_static_speculation(p: Pair) -> None:
    """The static cache, speculating = the dynamic cache without speculation: the padded batch, and each prompt
    alone (no padding: HF's masks take other paths)."""
    static = greedy(cache_implementation="static", **SPECULATE)
    same(p.model.generate(**p.batch, **static, threshold=p.threshold), p.mixed, "static, speculating")
    for r in range(len(PROMPTS)):
        alone = row(p.batch, r)
        same(p.model.generate(**alone, **static, threshold=p.threshold), p.mixed_alone(r).sequences,
             f"static, speculating, prompt {r} alone")
    refused_speculation(p.slm, p.llm)


def cell_captured(p: Pair, **speculate) -> None:
    """The fast path (static caches, CUDA graphs emulated on the CPU) = eager."""
    from .graphs import emulated_store

    store, p.model.capture_store = p.model.capture_store, emulated_store()
    try:
        captured = p.model.generate(**p.batch, **greedy(cache_implementation="static", **speculate),
                                    threshold=p.threshold)
        same(captured, p.mixed, "captured, speculating" if speculate else "captured")
    finally:
        p.model.capture_store = store


def cell_captured_speculation(p: Pair) -> None:
    """The same, speculating."""
    cell_captured(p, **SPECULATE)
    refused_speculation(p.slm, p.llm)


def cell_save_load(p: Pair) -> None:
    """A router saved and loaded back beside the same models answers as before."""
    from r2r_hf import R2RForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        p.model.save_pretrained(folder)
        again = R2RForCausalLM.from_pretrained(folder, slm=p.slm, llm=p.llm)
    same(again.generate(**p.batch, **greedy(), threshold=p.threshold), p.mixed, "reloaded router")


CELLS: dict[str, Callable[[Pair], None]] = {
    "generate": cell_generate, "mixed_alone": cell_mixed_alone, "sampled": cell_sampled, "bf16": cell_bf16,
    "speculation": cell_speculation, "unrelated": cell_unrelated, "static": cell_static,
    "static_speculation": cell_static_speculation, "captured": cell_captured,
    "captured_speculation": cell_captured_speculation, "served": cell_served,
    "served_speculation": cell_served_speculation, "served_captured": cell_served_captured,
    "save_load": cell_save_load,
}


# ------------------------------------------------------------------------------------------------- running
# What R2R says of the matrix's own settings (a served cell without capture) or once per process (speculation turned
# off, which the cell's refusal carries): not the pair's.
OWN_SETTINGS = ("the server's steps run eagerly: capture is off", "speculation is off")


class _Said(logging.Handler):
    """The warnings r2r_hf logs while a cell runs (what it says where it runs a slower path or turns a feature off)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def said() -> list[str]:
    handler, logger = _Said(), logging.getLogger("r2r_hf")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def run_cell(p: Pair, name: str) -> Outcome:
    """Run cell ``name`` on pair ``p`` and classify what happened (see the module docstring)."""
    with said() as lines:
        try:
            with torch.inference_mode():
                CELLS[name](p)
        except Mismatch as err:
            return Outcome("wrong", str(err))
        except Refused as err:
            return Outcome("refused", str(err))
        except Exception as err:  # noqa: BLE001 - a crash is an outcome of the matrix
            where = traceback.extract_tb(err.__traceback__)[-1]
            place = f"{where.filename.split('/site-packages/')[-1]}:{where.lineno}"
            return Outcome("crash", f"{type(err).__name__}: {str(err)[:300]} ({place})")
    kept = [line for line in lines if not line.startswith(OWN_SETTINGS)]
    return Outcome("ok", note="\n".join(dict.fromkeys(kept)))
