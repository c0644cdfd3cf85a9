"""The family matrix: every pair of ``families.py`` through R2R's public API, each path against the models' own
``generate``.

A *cell* is one path of one pair: a function that runs it and raises ``Mismatch`` where R2R's answer departs from
what it must equal (never-route = ``slm.generate``, always-route = ``llm.generate``, mixed = a cache-free
recompute, a padded batch = each row alone, a speculating, static, captured or served answer = the eager one, a
reloaded router = the saved one). ``run_cell`` classifies what happened:

* ``ok``       the answers are exact (and where R2R ran a slower path than asked, ``note`` says which, as it logged);
* ``refused``  R2R turned the path's feature off for the pair, in one sentence (speculation, for a model whose
               cache cannot be cut back), and the answers are exact without it;
* ``wrong``    an answer differs (a silent error);
* ``crash``    any other exception (a traceback from inside R2R or transformers).

``tests/test_model_families.py`` runs the cells (0 wrong, 0 crash); ``table.py`` renders the docs table from the same
outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .models import EOS_ID, PAD_ID
from .pairs import LOGITS, NEW, PROMPTS, SPECULATE, Mismatch, Pair, Refused, greedy, row, rows_alone, same
from .pairs import same_as_alone, same_logits


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
        same_as_alone(p.mixed, rows_alone(p.model, p.batch, **greedy(), threshold=p.threshold), width, "mixed")
    recompute(p)


def recompute(p: Pair) -> None:
    """Every token of the padded batch's mixed answers is the argmax of the model that wrote it over the sequence
    before it, read without a cache: one forward over the whole sequence (causal: each position sees what came
    before it), or one per length for a long-RoPE model (its factors follow the length, as in its own generate)."""
    from ..core.features import lm_forward, positions_from_mask
    from ..core.layouts.model_calls import long_rope_switch

    out = p.model.generate(**p.batch, **greedy(), threshold=p.threshold, return_dict_in_generate=True)
    seq, start = out.sequences, p.batch["input_ids"].shape[1]
    mask = torch.cat([p.batch["attention_mask"], torch.ones_like(seq[:, start:])], 1)
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
                raise Mismatch(f"mixed: row {r}'s answer token {i} ({who}) is {seq[r, start + i].item()}, a cache-free "
                               f"forward gives {want[who][r, i].item()}")
        live &= seq[:, start + i] != EOS_ID


def cell_sampled(p: Pair) -> None:
    """fp32, seeded sampling, one row: never-route = slm.generate, always-route = llm.generate (same seed)."""
    alone = row(p.batch, 1)
    options = dict(max_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, pad_token_id=PAD_ID,
                   eos_token_id=EOS_ID)
    for threshold, hf in ((float("inf"), p.slm), (0.0, p.llm)):
        torch.manual_seed(7)
        want = hf.generate(**alone, **options)
        same(p.model.generate(**alone, **options, seed=7, threshold=threshold), want, "seeded sampling")


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


def refused_speculation(p: Pair, slots: bool = False) -> None:
    """Where R2R does not speculate for the pair (in the server's ``slots``, or on HF's caches), the sentence it says
    (once) is the cell's refusal."""
    problem = p.model.routed_pair().abilities.speculation(slots)
    if problem is not None:
        raise Refused(problem)


def cell_speculation(p: Pair) -> None:
    """Speculating (greedy, mixed threshold): the padded batch and one row = without speculation."""
    same(p.model.generate(**p.batch, **greedy(**SPECULATE), threshold=p.threshold), p.mixed, "speculating batch")
    alone = row(p.batch, 2)
    want = p.model.generate(**alone, **greedy(), threshold=p.threshold)
    same(p.model.generate(**alone, **greedy(**SPECULATE), threshold=p.threshold), want, "speculating row")
    refused_speculation(p)


def cell_static(p: Pair) -> None:
    """``cache_implementation="static"`` (eager on a CPU), with and without speculation = the dynamic cache."""
    static = greedy(cache_implementation="static")
    same(p.model.generate(**p.batch, **static, threshold=p.threshold), p.mixed, "static cache")
    same(p.model.generate(**p.batch, **static, **SPECULATE, threshold=p.threshold), p.mixed, "static, speculating")


def cell_captured(p: Pair) -> None:
    """The fast path (static caches, CUDA graphs emulated on the CPU), with and without speculation = eager."""
    from .graphs import emulated_store

    store, p.model.capture_store = p.model.capture_store, emulated_store()
    try:
        static = greedy(cache_implementation="static")
        same(p.model.generate(**p.batch, **static, threshold=p.threshold), p.mixed, "captured")
        speculating = p.model.generate(**p.batch, **static, **SPECULATE, threshold=p.threshold)
        same(speculating, p.mixed, "captured, speculating")
    finally:
        p.model.capture_store = store


def cell_served(p: Pair, **settings) -> None:
    """The server's engine (in-process, every prompt at once, greedy and seeded) = ``generate`` alone."""
    from ..model.row_settings import resolve_row
    from ..serve.engine import Engine, Request
    from ..serve.rows import Choice
    from ..serve.settings import ServeSettings

    jobs = [(list(prompt), {"threshold": p.threshold, "do_sample": False} if i != 1 else
             {"threshold": p.threshold, "do_sample": True, "temperature": 1.0, "top_k": 20, "seed": 3})
            for i, prompt in enumerate(PROMPTS)]
    settings = {"capture": "off", **settings}
    engine = Engine(p.model, p.tok, ServeSettings(max_batch_size=4, batch_wait_ms=20, **settings))
    texts, done = {i: [] for i in range(len(jobs))}, threading.Semaphore(0)

    def sink(i):
        def emit(event):
            texts[i].append(event)
            if event[0] in ("end", "error"):
                done.release()
        return emit

    report = engine.capture_report
    if settings["capture"] != "off" and report["path"] == "eager" and not report.get("why"):
        raise Mismatch(f"served: the steps were not captured and the server did not say why ({report})")
    engine.start()
    try:
        for i, (prompt, options) in enumerate(jobs):
            engine.submit(Request([prompt], [Choice(resolve_row(p.model, prompt, max_new_tokens=NEW, **options))],
                                  sink(i)))
        for _ in jobs:
            if not done.acquire(timeout=120):
                raise Mismatch("served: an answer did not end within 120 s")
    finally:
        engine.stop(30)
    for i, (prompt, options) in enumerate(jobs):
        errors = [e for e in texts[i] if e[0] == "error"]
        if errors:
            raise RuntimeError(f"served: {errors[0][1].message}")
        got = "".join(e[2] for e in texts[i] if e[0] == "text")
        ids = torch.tensor([prompt])
        out = p.model.generate(input_ids=ids, max_new_tokens=NEW, pad_token_id=PAD_ID, eos_token_id=EOS_ID, **options)
        want = p.tok.decode(out[0, len(prompt):], skip_special_tokens=True)
        if got != want:
            raise Mismatch(f"served answer {i} ({'sampled' if options['do_sample'] else 'greedy'}) differs from "
                           f"generate alone: {got!r} != {want!r}")


def cell_served_speculation(p: Pair) -> None:
    """The same with ``--speculate 4``."""
    cell_served(p, speculate=4)
    refused_speculation(p, slots=True)


def cell_served_captured(p: Pair) -> None:
    """The same on captured steps (``--capture auto``: CUDA graphs, emulated on the CPU), where the models can be
    captured (else the server says why, once, and runs eagerly); fused where a model can be fused (its regions run
    plain here: the LLM's reads packed, the router folded into the SLM's reads), HF's forward elsewhere."""
    from .graphs import emulated_store

    store, p.model.capture_store = p.model.capture_store, emulated_store(fuse="plain")
    try:
        cell_served(p, capture="auto", max_context=48)
    finally:
        p.model.capture_store = store


def cell_save_load(p: Pair) -> None:
    """A router saved and loaded back beside the same models answers as before."""
    from r2r_hf import R2RForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        p.model.save_pretrained(folder)
        again = R2RForCausalLM.from_pretrained(folder, slm=p.slm, llm=p.llm)
    same(again.generate(**p.batch, **greedy(), threshold=p.threshold), p.mixed, "reloaded router")


CELLS: dict[str, Callable[[Pair], None]] = {
    "generate": cell_generate, "sampled": cell_sampled, "bf16": cell_bf16, "speculation": cell_speculation,
    "static": cell_static, "captured": cell_captured, "served": cell_served,
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
