"""Fail loudly when a transformers release changes the private generate() hooks R2R overrides.

R2RForCausalLM replaces ``_sample`` (where generate dispatches greedy and sampling),
``_validate_generation_mode``, ``_prepare_cache_for_generation`` and ``_get_stopping_criteria``
(to give HF's length criterion the pair's context). If any of these
moves, these tests name the hook to re-check before the pin in pyproject.toml is widened.
"""

import inspect
from pathlib import Path

import transformers
from packaging.version import Version
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GENERATION_MODES_MAPPING, GenerationMixin

from r2r_hf import R2RForCausalLM, R2RGenerateOutput


def test_the_installed_transformers_is_in_the_supported_range_and_the_declared_one():
    from r2r_hf import compat

    assert Version(compat.OLDEST) <= Version(transformers.__version__) < Version(compat.BELOW)
    compat.check_transformers()
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"transformers>={compat.OLDEST.removesuffix(".0")},<{compat.BELOW}"' in pyproject, \
        "pyproject.toml declares the range r2r_hf/compat.py names"


def test_a_release_outside_the_tested_range_is_said_once_as_a_pair_loads(monkeypatch, caplog, slm, llm):
    """Issue 56: pip keeps users inside the range; one who forces another release is told once, as a pair loads."""
    import logging

    from r2r_hf import compat

    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setattr(compat, "transformers_version", lambda: Version(compat.BELOW + ".0"))
    with caplog.at_level(logging.WARNING, logger="r2r_hf"):
        R2RForCausalLM.from_models(slm, llm)
        R2RForCausalLM.from_models(slm, llm)
    said = [r.getMessage() for r in caplog.records if "outside the releases" in r.getMessage()]
    assert said == [compat.untested_sentence(Version(compat.BELOW + ".0"))], said
    assert f"{compat.OLDEST} to {compat.NEWEST_TESTED}" in said[0] and said[0].endswith(f"<{compat.BELOW}'.")
    monkeypatch.setattr(compat, "transformers_version", lambda: Version(compat.NEWEST_TESTED))
    assert compat.untested_sentence(compat.transformers_version()) is None


def test_greedy_and_sampling_dispatch_to_sample():
    assert GENERATION_MODES_MAPPING[GenerationMode.GREEDY_SEARCH] == "_sample"
    assert GENERATION_MODES_MAPPING[GenerationMode.SAMPLE] == "_sample"


def test_sample_signature_is_what_r2r_replaces():
    params = list(inspect.signature(GenerationMixin._sample).parameters)
    assert params[:5] == ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config"]
    assert {"synced_gpus", "streamer", "model_kwargs"} <= set(params)
    ours = list(inspect.signature(R2RForCausalLM._sample).parameters)
    assert ours == params


def test_validate_generation_mode_signature():
    params = list(inspect.signature(GenerationMixin._validate_generation_mode).parameters)
    assert params == ["self", "generation_mode", "generation_config", "generation_mode_kwargs"]


def test_cache_hook_still_exists():
    assert hasattr(GenerationMixin, "_prepare_cache_for_generation")


def test_length_criterion_still_reads_the_context_from_an_attribute():
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    assert hasattr(GenerationMixin, "_get_stopping_criteria")
    assert "max_position_embeddings" in inspect.signature(MaxLengthCriteria).parameters
    assert MaxLengthCriteria(10, 5).max_position_embeddings == 5


def test_generate_reaches_the_r2r_loop(model, single):
    out = model.generate(**single, max_new_tokens=3, return_dict_in_generate=True)
    assert isinstance(out, R2RGenerateOutput) and out.routed is not None


def test_generation_config_hook_makes_the_calls_copy():
    # R2R puts the call's threshold into the copy _prepare_generation_config returns.
    params = list(inspect.signature(GenerationMixin._prepare_generation_config).parameters)
    assert params[:2] == ["self", "generation_config"]


def test_static_cache_shape_hook_still_exists():
    # The fast path allocates its static caches up front with the shape HF would use.
    from r2r_hf.testing import make_tiny_llm

    assert make_tiny_llm()._get_static_cache_init_shape() == (2, 32)


def test_the_forward_takes_its_cache_under_the_name_compat_uses():
    # 5.24 renamed past_key_values to cache (r2r_hf/compat.py); a release that renames it again fails here.
    import inspect

    from r2r_hf.compat import CACHE_ARGUMENT
    from r2r_hf.testing import make_tiny_llm, make_tiny_slm

    for model in (make_tiny_slm(), make_tiny_llm()):
        assert CACHE_ARGUMENT in inspect.signature(model.forward).parameters, type(model).__name__


def test_a_served_answer_gets_the_processors_generate_builds(model, tok):
    """``model/row_settings.py`` calls ``_prepare_generation_config``, ``_prepare_special_tokens`` and
    ``_get_logits_processor`` as generate does: a served answer's processors must be generate's."""
    import torch

    from r2r_hf.model.row_settings import resolve_row

    for name in ("_prepare_special_tokens", "_get_logits_processor"):
        assert callable(getattr(GenerationMixin, name, None)), f"GenerationMixin.{name} moved"
    params = list(inspect.signature(GenerationMixin._get_logits_processor).parameters)
    assert params[:4] == ["self", "generation_config", "input_ids_seq_length", "encoder_input_ids"]
    assert {"device", "model_kwargs"} <= set(params)
    prompt = tok("the old man")["input_ids"]
    options = dict(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.2, min_new_tokens=2)
    served = resolve_row(model, prompt, **options)
    seen = {}

    def spy(self, input_ids, logits_processor, *args, **kwargs):
        seen["processors"] = logits_processor
        return input_ids

    original = R2RForCausalLM._sample
    R2RForCausalLM._sample = spy
    try:
        model.generate(torch.tensor([prompt]), **options)
    finally:
        R2RForCausalLM._sample = original
    described = lambda processors: [(type(p).__name__, repr(sorted(vars(p).items()))) for p in processors]  # noqa: E731
    assert described(served.processors) == described(seen["processors"])


def test_decoders_take_a_prepared_mask_and_a_slot_cache(slm, llm):
    """Slots (``core/layouts/slot_cache.py``) hand the decoder a 4-D mask and a cache of their own; the self-check reads a
    sequence in two slots and in pieces and compares the logits with a plain forward."""
    from r2r_hf.core.probes import slot_problem

    for model in (slm, llm):
        assert slot_problem(model, {}) is None, type(model).__name__  # the probe itself: no kept verdict
