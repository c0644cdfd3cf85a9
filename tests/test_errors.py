"""Bad inputs get one clear sentence that says what is wrong and what to do."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from r2r_hf import R2RConfig, R2RForCausalLM
from r2r_hf.testing import make_tiny_llm, make_tiny_slm

from conftest import SMALL_ROUTER


def test_router_sized_for_another_slm_names_both_sizes(slm, llm):
    model = R2RForCausalLM(R2RConfig(slm_hidden_size=96, slm_name_or_path="org/other-slm", **SMALL_ROUTER))
    with pytest.raises(ValueError, match=r"size 96.*hidden size 64"):
        model.set_models(slm, llm)


def test_embedding_width_mismatch_names_both_sizes(slm, llm):
    model = R2RForCausalLM(R2RConfig(slm_hidden_size=64, slm_embedding_size=32, **SMALL_ROUTER))
    with pytest.raises(ValueError, match=r"size 32.*embedding size 64"):
        model.set_models(slm, llm)


def test_vocabularies_too_different_to_share_a_tokenizer(slm):
    other = make_tiny_llm(vocab_size=4000)
    with pytest.raises(ValueError, match="one tokenizer"):
        R2RForCausalLM.from_models(slm, other, **SMALL_ROUTER)


def test_different_local_tokenizers_are_refused(pair_dir, tmp_path):
    from r2r_hf.testing import make_tokenizer

    slm = AutoModelForCausalLM.from_pretrained(pair_dir[0])
    other_dir = tmp_path / "other-llm"
    make_tiny_llm().save_pretrained(other_dir)
    tok = make_tokenizer()
    tok.add_tokens(["<extra_token_for_test>"])
    tok.save_pretrained(other_dir)
    llm = AutoModelForCausalLM.from_pretrained(other_dir)
    with pytest.raises(ValueError, match="tokenizers of .* differ"):
        R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)


def test_generate_without_models_says_how_to_attach(single):
    model = R2RForCausalLM(R2RConfig(slm_hidden_size=64, **SMALL_ROUTER))
    with pytest.raises(ValueError, match="from_pretrained|set_models"):
        model.generate(**single, max_new_tokens=2)


def test_missing_slm_says_which_and_how_to_pass_a_folder(slm, llm, tmp_path):
    model = R2RForCausalLM.from_models(
        slm, llm, slm_name_or_path=str(tmp_path / "does-not-exist"), llm_name_or_path="nor/this", **SMALL_ROUTER
    )
    model.save_pretrained(tmp_path / "router")
    with pytest.raises(OSError, match=r"Could not load the SLM .*does-not-exist.*no such folder.*pass slm="):
        R2RForCausalLM.from_pretrained(tmp_path / "router")


def test_router_without_pair_names_asks_for_models(slm, llm, tmp_path):
    R2RForCausalLM(R2RConfig(slm_hidden_size=64, **SMALL_ROUTER)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="names no SLM"):
        R2RForCausalLM.from_pretrained(tmp_path)
    assert isinstance(R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm), R2RForCausalLM)


def test_quantization_config_at_top_level_is_refused(model, slm, llm, tmp_path):
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llm_kwargs"):
        R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm, quantization_config=object())


def test_not_a_causal_lm_is_refused(slm):
    model = R2RForCausalLM(R2RConfig(slm_hidden_size=64, **SMALL_ROUTER))
    with pytest.raises(ValueError, match="causal LM"):
        model.set_models(slm, torch.nn.Linear(2, 2))


def test_topk_larger_than_vocabulary_is_refused():
    slm = make_tiny_slm(vocab_size=64)
    llm = make_tiny_llm(vocab_size=64)
    with pytest.raises(ValueError, match="top 100 logits"):
        R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
