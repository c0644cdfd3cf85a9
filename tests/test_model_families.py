"""The family matrix (``r2r_hf/testing/matrix.py``): every decoder family of ``r2r_hf/testing/families.py``, variants and
mixed pairs, on every path, against the models' own ``generate``; each outcome exact, on a slower path or refused in
one sentence (never wrong, never a crash), and, on the release docs/model_families.md was generated on, as the page
shows it (regenerate it with ``python -m r2r_hf.testing.table``).

Every run takes a representative pair of each kind (``DEFAULT``: about 4 minutes of CPU); the other pairs run under
``-m families_full`` (about 13 minutes of CPU more; CI runs them in a phase of their own). A family the installed
transformers lacks is skipped, saying which release has it.
"""

import logging
from pathlib import Path

import pytest
import torch
import transformers

from r2r_hf.testing import table
from r2r_hf.testing.families import FAMILIES, PAIRS, missing
from r2r_hf.testing.matrix import CELLS, run_cell
from r2r_hf.testing.pairs import Pair, row

# The page beside the tests (CI's run of the installed wheel has no source tree around the package).
PAGE = (Path(__file__).resolve().parents[1] / "docs" / "model_families.md").read_text(encoding="utf-8")
DOC = table.documented(PAGE)
ON_PAGE_RELEASE = transformers.__version__ == table.page_release(PAGE)
# One pair of each kind runs in every run; the others under the marker.
DEFAULT = {"llama", "qwen2+llama", "gpt2", "mistral", "llama4", "bloom", "falcon", "falcon-40b", "phi3-longrope",
           "lfm2", "mamba", "recurrent_gemma", "qwen3_5", "gemma4"}
HTTP = ("llama", "qwen3_5")  # the server as a process over HTTP: a transformer pair and a hybrid one


def _pairs(names):
    return [pytest.param(name, marks=() if name in DEFAULT else pytest.mark.families_full) for name in names]


def _pair(name: str) -> Pair:
    why = missing(name)
    if why:
        pytest.skip(why)
    return Pair(name)


def _check(p: Pair, outcomes: dict) -> None:
    """Every outcome exact, slower or refused in one sentence naming the family, and as the docs page shows it."""
    pair = p.name
    failed = {name: f"{o.status}: {o.detail}" for name, o in outcomes.items() if o.status in ("wrong", "crash")}
    assert not failed, f"{pair}: {failed}"
    for name, outcome in outcomes.items():
        if outcome.status == "refused":
            sentence = outcome.detail
            assert "\n" not in sentence and sentence.endswith(".") and sentence.count(". ") == 0, sentence
            assert any(type(model).__name__ in sentence for model in (p.slm, p.llm)) or "this call" in sentence, \
                sentence
        if not ON_PAGE_RELEASE:
            continue  # (the page holds one release's outcomes; the others are held to exactness)
        shown = DOC[pair][table.HEADINGS[name]]
        assert table.cell_text(name, outcome) == shown, (
            f"docs/model_families.md shows {shown!r} for {pair}'s {name}, the matrix gives "
            f"{table.cell_text(name, outcome)!r} ({outcome}): run python -m r2r_hf.testing.table")
        for said in table.notes({name: outcome}):
            assert f"{said.rstrip('.')}." in DOC[pair]["what R2R says"], (
                f"R2R says {said!r} for {pair}'s {name}; docs/model_families.md does not: run "
                "python -m r2r_hf.testing.table")


@pytest.mark.parametrize("pair", _pairs(PAIRS))
def test_every_path_of_a_family_is_exact_or_refused_as_the_docs_say(pair):
    p = _pair(pair)
    _check(p, {name: run_cell(p, name) for name in CELLS})


@pytest.mark.parametrize("pair", _pairs(HTTP))
def test_the_server_as_a_process_answers_concurrent_requests_over_http_as_generate_does(pair):
    """``r2r-hf serve`` over the pair, three requests at once, routed answers waiting for a shared LLM forward."""
    from r2r_hf.testing.served_cells import serve_over_http

    p = _pair(pair)
    with torch.inference_mode():
        serve_over_http(p)


@pytest.mark.compile
@pytest.mark.families_full
@pytest.mark.parametrize("pair", ["qwen3", "qwen2+llama"])  # (fusable families, the LLM wider or of another family)
def test_fused_regions_compiled_by_inductor_answer_as_eager_generate(pair):
    """The captured cells run the fused regions plain; here inductor compiles them (tens of seconds a model)."""
    from r2r_hf.core.fast import fused_reads
    from r2r_hf.testing.graphs import emulated_store
    from r2r_hf.testing.pairs import greedy, same

    p = _pair(pair)
    p.model.capture_store = emulated_store(fuse=True)
    with torch.inference_mode():
        fast = p.model.generate(**p.batch, **greedy(cache_implementation="static"), threshold=p.threshold)
    same(fast, p.mixed, "fused, compiled")
    assert all(regions is not None for regions in p.model.capture_store.state.fused.values()), "both models fused"
    for model in (p.slm, p.llm):
        layer = fused_reads.compiled_regions(model).functions["static_layer"]
        assert torch._dynamo.eval_frame._debug_get_cache_entry_list(layer.__code__), "the region was compiled"


def test_the_docs_page_is_the_matrix_of_every_pair():
    assert list(DOC) == list(PAIRS), "docs/model_families.md lists other pairs: run python -m r2r_hf.testing.table"
    for pair, cells in DOC.items():
        assert list(cells)[2:-1] == [*table.HEADINGS.values(), *table.ABILITIES], pair
    kinds = {family.kind for family in FAMILIES.values()}
    assert kinds == {"dense", "absolute", "window", "chunked", "alibi", "mqa", "longrope", "recurrent", "shared-kv"}


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


def test_speculation_off_for_a_model_that_cannot_cut_back_is_said_and_answers_the_same(monkeypatch, caplog):
    from r2r_hf.core import policy

    monkeypatch.setattr(policy, "_said", set())
    p = Pair("recurrent_gemma")  # (its state lives on its modules: no release can cut it back)
    batch = row(p.batch, 2)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=2, threshold=p.threshold)
    with caplog.at_level(logging.WARNING, logger="r2r_hf"):
        first = p.model.generate(**batch, **options, speculate=4)
        again = p.model.generate(**batch, **options, speculate=4)
    said = [r.getMessage() for r in caplog.records if "speculation is off" in r.getMessage()]
    assert said == [p.model.routed_pair().abilities.speculation()] and "RecurrentGemmaForCausalLM" in said[0]
    assert torch.equal(first, p.model.generate(**batch, **options)) and torch.equal(first, again)
