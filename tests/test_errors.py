"""Bad inputs get one clear sentence that says what is wrong and what to do: a router and models that do not fit
together, tokenizers that differ on ids both models can write, and prompts that are empty, embeddings, or longer
than the context (which warns as ``slm.generate`` does).

The tokenizer and prompt cases come from issue 15's hostile probe (items 6 and 8) and issue 19's second review."""

from unittest import mock

import pytest
import torch
from transformers import AutoModelForCausalLM

from r2r_hf import R2RConfig, R2RForCausalLM
from r2r_hf.cli import main as cli_main
from r2r_hf.testing import make_tiny_llm, make_tiny_slm, make_tokenizer

from conftest import SMALL_ROUTER, one_line_error


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


# -------------------------------------------------------- tokenizers compared where it matters (issue 15, item 6)
def _save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("vocab, accepted", [(400, True), (416, False)])
def test_tokenizers_are_compared_on_the_ids_both_models_can_write(tmp_path, vocab, accepted):
    extra = make_tokenizer()
    extra.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    assert extra.convert_tokens_to_ids("<|extra|>") == 400
    slm = _save(make_tiny_slm(vocab_size=vocab), make_tokenizer(), tmp_path / "slm")
    llm = _save(make_tiny_llm(vocab_size=vocab), extra, tmp_path / "llm")
    if accepted:  # id 400 is past both vocabularies: neither model can write it
        assert R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER).shared_vocab_size == 400
    else:
        with pytest.raises(ValueError, match="differ in 1 of the 416 ids"):
            R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)


# ------------------------------------------------ prompts: empty, embeddings, past the context (issues 15 and 19)
def test_an_empty_prompt_is_refused(model, router_dir, capsys):
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    one_line_error(capsys, cli_main(["generate", "--router", str(router_dir), " "]), "The prompt is empty")


def test_embeddings_as_the_positional_prompt_are_one_sentence(model, single):
    embeddings = model.slm.get_input_embeddings()(single["input_ids"])
    with pytest.raises(ValueError, match=r"takes token ids.*float32 tensor of shape \[1, 12, 64\]; prompts as emb"):
        model.generate(embeddings, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"got a int64 tensor of shape \[12\]"):
        model.generate(input_ids=single["input_ids"][0], max_new_tokens=2)


def test_a_prompt_past_the_context_warns_as_slm_generate_does(model, slm):
    from transformers.generation import stopping_criteria

    prompt = torch.randint(3, 300, (1, 1030))
    with mock.patch.object(stopping_criteria.logger, "warning_once") as warn:
        slm.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        expected = warn.call_args
        warn.reset_mock()
        model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert expected is not None and "maximum length (1024)" in expected.args[0]
    assert warn.call_args == expected
