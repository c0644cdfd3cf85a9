"""Recurrent and hybrid caches across the supported releases (issue 56): how R2R reads, cuts back and names them.

The family matrix (tests/test_model_families.py) checks every path's answers; these pin the mechanisms under them on
the installed release: a read of several tokens where a model's own forward cannot continue its state, 5.25's
recurrent history (asked for, bounded, refused past its horizon), and the cache's argument name per model.
"""

import pytest
import torch
from transformers import DynamicCache

from r2r_hf import compat
from r2r_hf.core.features import lm_forward
from r2r_hf.core.layouts.model_calls import cached_forward, continuation_problem, rollback_problem
from r2r_hf.testing.builds import build

IDS = (torch.arange(12)[None] * 37 + 3) % 400
POSITIONS = torch.arange(12)[None]


def _read(model, cache, start: int, end: int) -> torch.Tensor:
    return cached_forward(model, IDS[:, start:end], POSITIONS[:, start:end], cache, 0, lambda i, j: None)[0]


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "recurrent_gemma", "mamba2", "lfm2", "qwen3_5"])
def test_reads_of_several_tokens_continue_the_cache_as_one_forward_does(family):
    """Mamba's and FalconMamba's scans (RecurrentGemma's convolution) start a read of several tokens from a zero
    state whatever the cache holds: R2R finds it per model and reads those one token at a time past the first read."""
    model = build(family, 0)
    expected = family in ("mamba", "falcon_mamba", "recurrent_gemma")
    assert (continuation_problem(model) is not None) == expected, continuation_problem(model)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        got = torch.cat([_read(model, cache, 0, 4), _read(model, cache, 4, 9), _read(model, cache, 9, 12)])
        want = lm_forward(model, IDS, None, POSITIONS, None, 0)[0]
    assert (got - want).abs().max() <= 2e-5 * want.abs().max(), family


@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "nemotron_h", "falcon_mamba", "mamba"])
def test_a_recurrent_model_speculates_where_its_release_can_cut_it_back(family):
    model = build(family, 0)
    if compat.RECURRENT_HISTORY:
        assert rollback_problem(model) is None, rollback_problem(model)
    else:
        assert rollback_problem(model).endswith("cannot cut back to an earlier token (5.25 can)")
    assert "on its modules" in rollback_problem(build("recurrent_gemma", 0))  # (no release reaches its state)


@pytest.mark.skipif(not compat.RECURRENT_HISTORY, reason="this transformers keeps no recurrent history (5.25 does)")
def test_the_recorded_history_stays_within_its_horizon_and_a_longer_cut_is_refused():
    model = build("qwen3_5", 0)
    cache = DynamicCache(config=model.config)
    compat.record_past(cache, 2)
    with torch.inference_mode():
        _read(model, cache, 0, 4)
        for at in range(4, 12):  # one token at a time, as a decoding step reads
            _read(model, cache, at, at + 1)
            compat.bound_past(cache, 2)
    linear = [layer for layer in cache.layers if isinstance(layer, compat.LINEAR)]
    assert linear and all(len(h) <= 2 for layer in linear for h in layer.recurrent_states_history.values())
    assert all(layer.conv_states[0].shape[-1] <= layer.conv_kernel_size[0] + 2 for layer in linear)
    with pytest.raises(RuntimeError, match="fewer than the 3 tokens"):
        compat.crop_cache(cache, 3)
    compat.crop_cache(cache, 2)  # (within the horizon: restored)
    with torch.inference_mode():
        got = _read(model, cache, 10, 12)
        want = lm_forward(model, IDS, None, POSITIONS, None, 0)[0, 10:]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


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
