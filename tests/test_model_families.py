"""The family matrix (``r2r_hf/testing/matrix.py``): every decoder family of ``r2r_hf/testing/families.py``, and mixed
pairs, on every path, against the models' own ``generate``; each outcome exact or refused in one sentence, and as
docs/model_families.md shows it (regenerate the page with ``python -m r2r_hf.testing.table``).

About 75 s of CPU in all (tiny shapes: 2 layers, hidden 32). The served answers on captured steps run for one pair of
each kind here and for every pair under ``-m families_full`` (15 s more).
"""

import logging

import pytest
import torch

from r2r_hf.testing import table
from r2r_hf.testing.families import FAMILIES, PAIRS
from r2r_hf.testing.matrix import CELLS, run_cell
from r2r_hf.testing.pairs import Pair, row

DOC = table.documented()
# One pair of each kind serves on captured steps in every run; the others under the marker.
SERVED_CAPTURED = {"llama", "gpt2", "mistral", "gemma3", "llama4", "bloom", "falcon", "phi3-longrope", "mamba",
                   "qwen2+llama"}
CELLS_HERE = [name for name in CELLS if name != "served_captured"]


def _check(p: Pair, outcomes: dict) -> None:
    """Every outcome exact or refused in one sentence naming the family, and as the docs page shows it."""
    pair = p.name
    failed = {name: f"{o.status}: {o.detail}" for name, o in outcomes.items() if o.status in ("wrong", "crash")}
    assert not failed, f"{pair}: {failed}"
    for name, outcome in outcomes.items():
        if outcome.status == "refused":
            sentence = outcome.detail
            assert "\n" not in sentence and sentence.endswith(".") and sentence.count(". ") == 0, sentence
            assert any(type(model).__name__ in sentence for model in (p.slm, p.llm)), sentence
        shown = DOC[pair][table.HEADINGS[name]]
        assert table.cell_text(name, outcome) == shown, (
            f"docs/model_families.md shows {shown!r} for {pair}'s {name}, the matrix gives "
            f"{table.cell_text(name, outcome)!r} ({outcome}): run python -m r2r_hf.testing.table")
        for said in table.notes({name: outcome}):
            assert f"{said.rstrip('.')}." in DOC[pair]["what R2R says"], (
                f"R2R says {said!r} for {pair}'s {name}; docs/model_families.md does not: run "
                "python -m r2r_hf.testing.table")


@pytest.mark.parametrize("pair", list(PAIRS))
def test_every_path_of_a_family_is_exact_or_refused_as_the_docs_say(pair):
    p = Pair(pair)
    _check(p, {name: run_cell(p, name) for name in CELLS_HERE})


@pytest.mark.parametrize("pair", [pytest.param(pair, marks=() if pair in SERVED_CAPTURED else pytest.mark.families_full)
                                  for pair in PAIRS])
def test_served_answers_on_captured_steps_are_exact_or_said_slower_as_the_docs_say(pair):
    p = Pair(pair)
    _check(p, {"served_captured": run_cell(p, "served_captured")})


def test_the_docs_page_is_the_matrix_of_every_pair():
    assert list(DOC) == list(PAIRS), "docs/model_families.md lists other pairs: run python -m r2r_hf.testing.table"
    for pair, cells in DOC.items():
        assert list(cells)[2:-1] == list(table.HEADINGS.values()), pair
    kinds = {family.kind for family in FAMILIES.values()}
    assert kinds == {"dense", "absolute", "window", "chunked", "alibi", "mqa", "longrope", "recurrent"}


def test_the_matrix_tells_positions_counted_from_the_first_column_apart(monkeypatch):
    """Issue 48, item 1: a left-padded row's positions counted from the batch's first column, not its first real token
    (what R2R did): GPT-2 answers other tokens in fp32, and a rotary family's bf16 logits depart from its own
    generate's."""
    from r2r_hf.core.layouts.rectangle import Committed

    real = Committed.from_prompt.__func__

    def from_first_column(cls, input_ids, mask, positions, capacity):
        return real(cls, input_ids, mask, torch.arange(input_ids.shape[1]).expand_as(input_ids), capacity)

    monkeypatch.setattr(Committed, "from_prompt", classmethod(from_first_column))
    assert run_cell(Pair("gpt2"), "generate").status == "wrong"
    assert run_cell(Pair("llama"), "bf16").status == "wrong"


def test_speculation_off_for_a_recurrent_model_is_said_once_and_answers_the_same(monkeypatch, caplog):
    from r2r_hf.core import policy

    monkeypatch.setattr(policy, "_said", set())
    p = Pair("mamba")
    batch = row(p.batch, 2)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2, threshold=p.threshold)
    with caplog.at_level(logging.WARNING, logger="r2r_hf"):
        first = p.model.generate(**batch, **options, speculate=4)
        again = p.model.generate(**batch, **options, speculate=4)
    said = [r.getMessage() for r in caplog.records if "speculation is off" in r.getMessage()]
    assert said == [p.model.routed_pair().abilities.speculation()] and "MambaForCausalLM" in said[0]
    assert torch.equal(first, p.model.generate(**batch, **options)) and torch.equal(first, again)
