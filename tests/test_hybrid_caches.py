"""Recurrent and hybrid caches across the supported releases (issue 56): how R2R reads, cuts back and names them.

The family matrix (tests/test_model_families.py) checks every path's answers; these pin the mechanisms under them on
the installed release: a read of several tokens where a model's own forward cannot continue its state, a rollback
of a recurrent state to R2R's checkpoint (``compat.hold_states``: every release, no per-token history), and the
cache's argument name per model.
"""

import pytest
import torch
from transformers import DynamicCache

from r2r_hf import compat
from r2r_hf.core.features import lm_forward
from r2r_hf.core.abilities import abilities
from r2r_hf.core.layouts.model_calls import cached_forward
from r2r_hf.core.probes import continues_problem
from r2r_hf.testing.builds import build

IDS = (torch.arange(12)[None] * 37 + 3) % 400
POSITIONS = torch.arange(12)[None]


def _read(model, cache, start: int, end: int) -> torch.Tensor:
    return cached_forward(model, IDS[:, start:end], POSITIONS[:, start:end], cache, 0, lambda i, j: None,
                          abilities(model).continues)[0]  # (probed once: a probe between reads would run the model)


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "recurrent_gemma", "mamba2", "lfm2", "qwen3_5"])
def test_reads_of_several_tokens_continue_the_cache_as_one_forward_does(family):
    """Mamba's and FalconMamba's scans (RecurrentGemma's convolution) start a read of several tokens from a zero
    state whatever the cache holds: R2R finds it per model and reads those one token at a time past the first read."""
    model = build(family, 0)
    expected = family in ("mamba", "falcon_mamba", "recurrent_gemma")
    assert (continues_problem(model) is not None) == expected, continues_problem(model)
    assert abilities(model).continues == continues_problem(model)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        got = torch.cat([_read(model, cache, 0, 4), _read(model, cache, 4, 9), _read(model, cache, 9, 12)])
        want = lm_forward(model, IDS, None, POSITIONS, None, 0)[0]
    assert (got - want).abs().max() <= 2e-5 * want.abs().max(), family


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "nemotron_h", "falcon_mamba", "mamba", "lfm2"])
def test_a_recurrent_model_is_cut_back_to_its_checkpoint_on_every_release(family):
    """A rollback crops the attention layers and puts every recurrent and convolution layer back to a checkpoint
    (``compat.hold_states``), then reads again from there: exact whatever the release keeps of its own past."""
    model = build(family, 0)
    assert abilities(model).rollback is None, abilities(model).rollback
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        _read(model, cache, 0, 6)
        held = compat.hold_states(cache)
        _read(model, cache, 6, 9)  # three tokens a rollback then throws away
        compat.crop_cache(cache, 3)
        compat.restore_states(cache, held)
        got = _read(model, cache, 6, 12)
        want = lm_forward(model, IDS, None, POSITIONS, None, 0)[0, 6:]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), family
    assert "on its modules" in abilities(build("recurrent_gemma", 0)).rollback  # (no release reaches its state)


def test_the_cache_goes_under_the_name_each_forward_takes():
    """5.17-5.23's Mamba, Mamba-2 and FalconMamba take their cache as ``cache_params``: under the release's name it
    fell into ``**kwargs`` unread, and every read started afresh."""
    from transformers import LlamaForCausalLM, MambaForCausalLM

    old = compat.CACHE_ARGUMENT == "past_key_values"
    assert compat.cache_name(MambaForCausalLM) == ("cache_params" if old else "cache")
    assert compat.cache_name(LlamaForCausalLM) == compat.CACHE_ARGUMENT
    model = build("mamba", 0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        lm_forward(model, IDS[:, :4], None, POSITIONS[:, :4], cache)
    assert not compat.cache_is_empty(cache), "the forward read into the cache R2R passed"
