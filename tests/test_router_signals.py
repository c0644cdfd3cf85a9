"""A router that starts from entropy: the SLM's entropy and top-2 margin among its inputs, and straight to its
logit, initialised to the entropy baseline's ranking; it saves, loads and routes in generate like any router."""

import pytest
import torch

from conftest import SMALL_ROUTER
from r2r_hf import EntropyRouter, MLPRouter, R2RConfig, R2RForCausalLM
from r2r_hf.config import router_parameters
from r2r_hf.router import signals

CONFIG = dict(slm_hidden_size=16, router_hidden_dims=[8, 8], num_topk_logits=10)


def features(n=64, seed=0, k=10, width=16):
    g = torch.Generator().manual_seed(seed)
    topk = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 6).sort(descending=True).values
    return topk, torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def test_signals_are_entropy_and_the_top_two_gap():
    topk = torch.tensor([[5.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    got = signals(topk, ["margin", "entropy"])
    assert got[:, 0].tolist() == [3.0, 0.0]
    torch.testing.assert_close(got[:, 1], EntropyRouter().scores(topk, None, None))
    assert signals(topk, []).shape == (2, 0)


def test_a_fresh_router_ranks_as_the_entropy_baseline_and_the_paper_router_is_unchanged():
    model = R2RForCausalLM(R2RConfig(**CONFIG, router_signals=["entropy", "margin"])).eval()
    scores = model.router.scores(*features())
    entropy = EntropyRouter().scores(features()[0], None, None)
    assert torch.equal(scores.argsort(), entropy.argsort())
    plain = R2RForCausalLM(R2RConfig(**CONFIG)).eval().router.scores(*features())
    assert not torch.equal(plain.argsort(), entropy.argsort())
    for names in ([], ["margin"], ["entropy", "margin"]):
        config = R2RConfig(**CONFIG, router_signals=names)
        assert sum(p.numel() for p in MLPRouter(config).parameters()) == router_parameters(config)
    assert "signal_head.weight" not in MLPRouter(R2RConfig(**CONFIG)).state_dict()  # official layout kept


def test_signals_are_refused_unless_known_once():
    with pytest.raises(ValueError, match="entropy, margin"):
        R2RConfig(**CONFIG, router_signals=["perplexity"])
    with pytest.raises(ValueError, match="at most once"):
        R2RConfig(**CONFIG, router_signals=["entropy", "entropy"])


def test_a_router_with_signals_learns_saves_and_routes(slm, llm, tmp_path):
    model = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER, router_signals=["entropy", "margin"])
    optimizer = torch.optim.AdamW(model.router.parameters(), lr=1e-2)
    topk, emb, hidden = features(256, seed=1, k=100, width=slm.config.hidden_size)
    target = (hidden[:, 0] > 0).float()  # something entropy cannot tell: the backbone must learn it
    for _ in range(60):
        optimizer.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(model.router(topk, emb, hidden), target).backward()
        optimizer.step()
    assert model.router.backbone.output_layer[1].weight.abs().sum() > 0
    model.save_pretrained(tmp_path / "router")
    loaded = R2RForCausalLM.from_pretrained(tmp_path / "router", slm=slm, llm=llm).eval()
    assert loaded.config.router_signals == ["entropy", "margin"]
    torch.testing.assert_close(loaded.router.scores(topk, emb, hidden), model.eval().router.scores(topk, emb, hidden))
    ids = torch.tensor([[5, 9, 14, 22]])
    out = loaded.generate(ids, max_new_tokens=12, threshold=0.5, return_dict_in_generate=True, do_sample=False)
    assert out.sequences.shape[1] > ids.shape[1] and out.router_scores.isfinite().any()



def test_train_with_signals_from_the_command_line(tmp_path):
    from synthetic_labels import write_synthetic_run

    from r2r_hf.cli import main as cli_main

    write_synthetic_run(tmp_path / "run")
    out = tmp_path / "router"
    assert cli_main(["--quiet", "train", "--data", str(tmp_path / "run"), "--out", str(out), "--epochs", "2",
                     "--batch-size", "256", "--hidden-dims", "32", "--signals", "entropy,margin"]) == 0
    loaded = R2RForCausalLM.from_pretrained(out, load_pair=False)
    assert loaded.config.router_signals == ["entropy", "margin"]
    assert "signal_head.weight" in loaded.router.state_dict()


def test_the_model_card_names_the_signals_a_router_reads():
    """A router that reads entropy and margin says so on its card; the paper's router does not claim them."""
    from r2r_hf.model.model_card import render_model_card

    reads = R2RConfig(**CONFIG, router_signals=["entropy", "margin"])
    assert "also reads the SLM's entropy and margin" in render_model_card(reads)
    assert "also reads" not in render_model_card(R2RConfig(**CONFIG))
