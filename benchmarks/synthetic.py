"""Random-weight stand-ins for the real pair, shared by the rooms that measure shapes rather than answers.

``random_model`` builds a published Qwen2.5 shape with random weights (speed does not depend on them); ``HashRouter``,
``Letters``, ``request`` and ``serving_shape`` drive the server's engine in-process with such models: the device
check's serving phase (``gpu/serve.py``), the host work per step (``speed/host_ops.py``) and the prefill stall
(``serving/prefill_stall.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from r2r_hf import R2RForCausalLM
from r2r_hf.router import Router

CONFIGS = {  # published Qwen2.5 shapes (https://huggingface.co/Qwen, config.json of each size)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    # for the smoke tests and the dry run of the GPU check only
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "tiny-llm": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False),
}


def random_model(name: str, dtype: torch.dtype, device: str, seed: int, layers: int | None = None) -> Qwen2ForCausalLM:
    """A random ``name`` (``CONFIGS``) in ``dtype`` on ``device``; ``layers`` keeps that many of its decoder layers."""
    torch.manual_seed(seed)
    config = {**CONFIGS[name], **({"num_hidden_layers": layers} if layers else {})}
    with torch.device(device):  # built in ``dtype`` on the device: a 32B in fp32 would not fit beside itself
        model = Qwen2ForCausalLM._from_config(Qwen2Config(**config, max_position_embeddings=4096), dtype=dtype)
    return model.eval()


class HashRouter(Router):
    """Pays ``inner``'s cost, then scores each proposal by a hash of its hidden state (uniform in [0, 1)).

    With threshold ``1 - p`` a row routes a share ``p`` of its tokens. A pure tensor function: it is captured.
    """

    def __init__(self, inner: Router) -> None:
        super().__init__()
        self.inner = inner

    def scores(self, topk_logits, token_embedding, hidden):
        real = self.inner.scores(topk_logits, token_embedding, hidden)
        mixed = (hidden.float() * torch.arange(1, hidden.shape[-1] + 1, device=hidden.device)).sum(-1)
        return torch.frac(mixed.abs() * 7.919) + 0 * real


class Letters:
    """A stand-in tokenizer for random weights: one letter per token, so every token hands out text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + int(t) % 26) for t in ids)


def request(prompt: list[int], settings, emit):
    """A one-row request of ``prompt`` for the engine, answered with ``settings`` (``resolve_row``'s)."""
    from r2r_hf.serve.engine import Request
    from r2r_hf.serve.rows import Choice

    return Request([prompt], [Choice(settings)], emit)


@contextmanager
def serving_shape(model: R2RForCausalLM) -> Iterator[R2RForCausalLM]:
    """``model`` as the serving phase runs it, restored after: ``HashRouter`` in front of its router, and answers
    that run to their ``max_tokens`` (random weights would otherwise end some early on an end-of-text token)."""
    configs = (model.slm.generation_config, model.llm.generation_config, model.generation_config)
    saved, router = [(c.eos_token_id, c.pad_token_id) for c in configs], model.router
    for c in configs:
        c.eos_token_id = None
        c.pad_token_id = 0 if c.pad_token_id is None else c.pad_token_id
    model.router = HashRouter(router)
    try:
        yield model
    finally:
        model.router = router
        for c, (eos, pad) in zip(configs, saved):
            c.eos_token_id, c.pad_token_id = eos, pad
