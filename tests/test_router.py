"""The router's shape matches the paper and the official checkpoints; the baselines share its interface."""

import math

import pytest
import torch

from r2r_hf import EntropyRouter, MLPRouter, R2RConfig, RandomRouter, build_router


def _count(module):
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("hidden, expected", [(1536, 56_302_081), (896, 54_271_361)])
def test_paper_sized_router_parameter_count(hidden, expected):
    router = MLPRouter(R2RConfig(slm_hidden_size=hidden))
    assert _count(router) == expected


def test_state_dict_names_match_the_official_layout():
    router = MLPRouter(R2RConfig(slm_hidden_size=16, router_hidden_dims=[8, 8], num_topk_logits=5))
    shapes = {k: tuple(v.shape) for k, v in router.state_dict().items()}
    assert shapes["logits_projection.weight"] == (16, 5)
    assert shapes["combined_projection.weight"] == (8, 48)
    assert shapes["backbone.input_projection.weight"] == (8, 8)
    assert shapes["backbone.blocks.1.layer_norm.weight"] == (8,)
    assert shapes["backbone.blocks.1.mlp.0.weight"] == (32, 8)
    assert shapes["backbone.blocks.1.mlp.3.weight"] == (8, 32)
    assert shapes["backbone.output_layer.0.weight"] == (8,)
    assert shapes["backbone.output_layer.1.weight"] == (1, 8)
    assert not any("dim_change" in k or "token_embeddings" in k for k in shapes)


def test_changing_block_widths_adds_dim_change():
    router = MLPRouter(R2RConfig(slm_hidden_size=16, router_hidden_dims=[8, 4], num_topk_logits=5))
    keys = router.state_dict().keys()
    assert "backbone.blocks.0.dim_change.weight" in keys and "backbone.blocks.1.dim_change.weight" not in keys


def test_scores_are_probabilities_and_eval_is_deterministic():
    router = MLPRouter(R2RConfig(slm_hidden_size=16, router_hidden_dims=[8], num_topk_logits=5)).eval()
    args = torch.randn(4, 5), torch.randn(4, 16), torch.randn(4, 16)
    scores = router.scores(*args)
    assert scores.shape == (4,) and ((scores > 0) & (scores < 1)).all()
    assert torch.equal(scores, router.scores(*args))


def test_entropy_router_is_normalised_entropy():
    router = EntropyRouter()
    flat = torch.zeros(1, 10)
    peaked = torch.tensor([[100.0] + [0.0] * 9])
    assert router.scores(flat, None, None).item() == pytest.approx(1.0)
    assert router.scores(peaked, None, None).item() == pytest.approx(0.0, abs=1e-6)
    probs = torch.tensor([0.5, 0.25, 0.25])
    expected = -(probs * probs.log()).sum() / math.log(3)
    assert router.scores(probs.log()[None], None, None).item() == pytest.approx(expected.item(), rel=1e-5)


def test_random_router_is_private_seeded_and_hits_its_rate():
    router = RandomRouter(seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = router.scores(torch.zeros(20_000, 2), None, None)
    assert torch.equal(torch.get_rng_state(), before), "the global random stream is untouched"
    router.reset()
    assert torch.equal(first, router.scores(torch.zeros(20_000, 2), None, None))
    assert (first >= 0.9).float().mean().item() == pytest.approx(0.1, abs=0.01)


def test_build_router_follows_config():
    assert isinstance(build_router(R2RConfig(slm_hidden_size=8, router_hidden_dims=[4])), MLPRouter)
    assert isinstance(build_router(R2RConfig(router_type="entropy")), EntropyRouter)
    assert isinstance(build_router(R2RConfig(router_type="random")), RandomRouter)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="router_type"):
        R2RConfig(router_type="oracle")
    with pytest.raises(ValueError, match="threshold"):
        R2RConfig(threshold="high")
    with pytest.raises(ValueError, match="num_topk_logits"):
        R2RConfig(num_topk_logits=0)
    with pytest.raises(ValueError, match="slm_hidden_size"):
        MLPRouter(R2RConfig())
