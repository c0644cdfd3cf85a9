"""Tiny random SLM/LLM pairs that share a word-level tokenizer, for tests and offline examples.

The models are randomly initialised (no download). Their lm_heads are scaled up so
logits are spread wide and greedy argmax has no float near-ties: outputs computed
in chunks and in one pass then agree token for token.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Tokenizer,
)

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
    "father def return else while print answer step therefore"
).split()
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_ID, EOS_ID = 0, 2  # <|endoftext|> pads, <|im_end|> ends a turn (as in Qwen2.5-Instruct)
TOKENIZER_VOCAB = 400
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    lines = []
    for i in range(0, len(WORDS), 7):
        chunk = WORDS[i : i + 7]
        lines += [" ".join(chunk) + ".", "def " + "_".join(chunk[:2]) + "(x): return x + 1", " ".join(chunk[::-1]) + "?"]
    return lines


@functools.lru_cache(maxsize=1)
def _trained_bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer=trainer)
    state = json.loads(backend.to_str())["model"]
    merges = tuple(tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in state["merges"])
    return state["vocab"], merges


def make_tokenizer() -> PreTrainedTokenizerBase:
    """A small byte-level BPE tokenizer of the Qwen2 kind (vocabulary 400, Qwen's special tokens).

    It is trained deterministically on a fixed English and code word list, and loads
    back through ``AutoTokenizer`` as a ``Qwen2Tokenizer``, like the real Qwen pairs.
    """
    vocab, merges = _trained_bpe()
    tok = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), pad_token=SPECIAL[0], eos_token=SPECIAL[2])
    tok.padding_side = "left"
    tok.chat_template = CHAT_TEMPLATE
    return tok


@functools.lru_cache(maxsize=1)
def _unwritable_ids() -> tuple[int, ...]:
    """Token ids the tiny models never prefer: control bytes and partial UTF-8 (keeps demo text readable)."""
    tok = make_tokenizer()
    ids = []
    for i in range(len(SPECIAL), TOKENIZER_VOCAB):
        text = tok.decode([i])
        if "\ufffd" in text or any(not ch.isprintable() and ch not in " \n" for ch in text):
            ids.append(i)
    return tuple(ids)


def _spread_lm_head(model: PreTrainedModel, scale: float, seed: int) -> PreTrainedModel:
    # Rows past the tokenizer's vocabulary are padding: zero them (and the rows of control
    # bytes) so that, as in trained models, no model ever prefers a token it should not write.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=generator) * scale / head.shape[1] ** 0.5)
        head[TOKENIZER_VOCAB:] = 0.0
        head[[i for i in _unwritable_ids() if i < head.shape[0]]] = 0.0
    return model.eval()


def _tiny(config_class, model_class, vocab_size: int, hidden_size: int, layers: int, seed: int, **overrides):
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        pad_token_id=PAD_ID, eos_token_id=EOS_ID, **overrides,
    )
    return _spread_lm_head(model_class(config), scale=12.0, seed=seed + 100)


def make_tiny_slm(vocab_size: int = 416, hidden_size: int = 64, seed: int = 0, **overrides) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with hidden size 64 and random weights."""
    return _tiny(Qwen2Config, Qwen2ForCausalLM, vocab_size, hidden_size, 2, seed, **overrides)


def make_tiny_llm(vocab_size: int = 448, hidden_size: int = 128, seed: int = 1, **overrides) -> LlamaForCausalLM:
    """A 3-layer Llama with hidden size 128 (bitsandbytes-friendly) and a padded vocabulary."""
    return _tiny(LlamaConfig, LlamaForCausalLM, vocab_size, hidden_size, 3, seed, **overrides)


def make_related_llm(slm: PreTrainedModel, noise: float = 0.07, seed: int = 5) -> PreTrainedModel:
    """A copy of ``slm`` with every weight perturbed: it agrees with the SLM on most tokens (~85 %
    greedy agreement at the default noise), like a real small/large pair of one family."""
    import copy

    llm = copy.deepcopy(slm)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in llm.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * noise * param.std())
    return llm.eval()


def save_tiny_pair(directory: str | os.PathLike, related: bool = False) -> tuple[str, str]:
    """Save a tiny SLM and LLM, each with the shared tokenizer, under ``directory``.

    Args:
        directory: parent folder.
        related: make the LLM a perturbed copy of the SLM (mostly agreeing, for labeling tests)
            instead of an independent Llama (disagreeing almost everywhere).

    Returns:
        The two folders (slm, llm); each loads with ``from_pretrained``.
    """
    root = Path(directory)
    tokenizer = make_tokenizer()
    paths = []
    slm = make_tiny_slm()
    llm = make_related_llm(slm) if related else make_tiny_llm()
    for name, model in (("tiny-slm", slm), ("tiny-llm", llm)):
        path = root / name
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def make_tiny_verifier(seed: int = 2) -> LlamaForCausalLM:
    """A tiny random "judge" that only says 0 or 1, about half of each depending on its input.

    Its lm_head keeps the rows of "0" and "1" only, set to plus and minus the direction in which
    its final hidden state varies most across sample requests, so the answer follows the input.
    """
    from ..pipeline.verifiers.judge import render

    model = make_tiny_llm(vocab_size=TOKENIZER_VOCAB, seed=seed)
    tok = make_tokenizer()
    zero, one = (tok.convert_tokens_to_ids(t) for t in ("0", "1"))
    g = torch.Generator().manual_seed(seed)
    writer = make_tiny_slm()

    def text(n: int) -> str:  # text the tiny models write, so the requests of a real tiny run fall on both sides
        if n == 0:
            return ""
        start = torch.randint(len(SPECIAL), TOKENIZER_VOCAB, (1, 3), generator=g)
        out = writer.generate(start, max_new_tokens=n, do_sample=False, pad_token_id=PAD_ID, eos_token_id=10**6)
        return tok.decode(out[0, 3:].tolist())

    requests = [render(tok, text(i * 7 % 40), text(3) + "<<" + text(1) + ">>" + text(5 + i % 15),
                       text(3) + "<<" + text(1) + ">>" + text(5 + i * 7 % 15)) for i in range(48)]
    with torch.no_grad():
        hidden = []
        for ids in requests:
            out = model(torch.tensor([ids]), output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0, -1])
        hidden = torch.stack(hidden)
        direction = torch.linalg.svd(hidden - hidden.mean(0), full_matrices=False).Vh[0]
        direction -= (direction @ hidden.mean(0)) / hidden.mean(0).norm() ** 2 * hidden.mean(0)
        head = model.get_output_embeddings().weight
        head.zero_()
        head[one] = 50 * direction / direction.norm()
        head[zero] = -head[one]
    return model


def save_tiny_verifier(directory: str | os.PathLike) -> str:
    """Save ``make_tiny_verifier()`` with the shared tokenizer; returns the folder."""
    path = Path(directory) / "tiny-verifier"
    tokenizer = make_tokenizer()
    model = make_tiny_verifier()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
