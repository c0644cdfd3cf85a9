"""Tiny random SLM/LLM pairs that share a word-level tokenizer, for tests and offline examples.

The models are randomly initialised (no download). Their lm_heads are scaled up so
logits are spread wide and greedy argmax has no float near-ties: outputs computed
in chunks and in one pass then agree token for token.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.tokenization_utils_tokenizers import TokenizersBackend

WORDS = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air well also play "
    "small end put home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build self earth "
    "father def return if else for while print x y n 0 1 2 3 + - * = ( ) : , . ! ? ; answer step so therefore"
).split()
SPECIAL = ("<pad>", "<eos>", "<bos>", "<user>", "<assistant>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' + m['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)


def make_tokenizer(words: tuple[str, ...] | list[str] = WORDS) -> TokenizersBackend:
    """A whitespace word-level tokenizer over ``words`` plus pad/eos/bos and chat-role tokens."""
    vocab: dict[str, int] = {}
    for token in list(SPECIAL) + ["<unk>"] + list(dict.fromkeys(words)):
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = TokenizersBackend(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _spread_lm_head(model: PreTrainedModel, scale: float, seed: int) -> PreTrainedModel:
    # Rows past the tokenizer's vocabulary are padding: zero them so, as in trained models,
    # no model ever prefers a token the tokenizer cannot decode.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=generator) * scale / head.shape[1] ** 0.5)
        head[len(make_tokenizer()) :] = 0.0
    return model.eval()


def make_tiny_slm(vocab_size: int = 256, hidden_size: int = 64, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with hidden size 64 and random weights."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides,
    )
    return _spread_lm_head(Qwen2ForCausalLM(config), scale=12.0, seed=seed + 100)


def make_tiny_llm(vocab_size: int = 288, hidden_size: int = 128, seed: int = 1, **overrides) -> LlamaForCausalLM:
    """A 3-layer Llama with hidden size 128 (bitsandbytes-friendly) and a padded vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides,
    )
    return _spread_lm_head(LlamaForCausalLM(config), scale=12.0, seed=seed + 100)


def save_tiny_pair(directory: str | os.PathLike) -> tuple[str, str]:
    """Save a tiny SLM and LLM, each with the shared tokenizer, under ``directory``.

    Returns:
        The two folders (slm, llm); each loads with ``from_pretrained``.
    """
    root = Path(directory)
    tokenizer = make_tokenizer()
    paths = []
    for name, model in (("tiny-slm", make_tiny_slm()), ("tiny-llm", make_tiny_llm())):
        path = root / name
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]
