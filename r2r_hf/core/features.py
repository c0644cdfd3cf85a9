"""The SLM features a router reads, and the one function that turns them into scores.

Generation, the LogitsProcessor form, the labeling pipeline, training and the benchmarks all
go through ``read_features`` and ``score``, so a router sees at inference exactly what it
was trained on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache

from ..compat import cache_argument


@dataclass(frozen=True)
class Features:
    """What a router reads at N positions.

    Args:
        topk_logits: [N, k] the k largest raw SLM logits, sorted descending, float32.
        token_embedding: [N, E] the SLM's own input embedding of the proposed token.
        hidden: [N, H] the SLM's last hidden state after the final norm.
    """

    topk_logits: torch.Tensor
    token_embedding: torch.Tensor
    hidden: torch.Tensor

    @classmethod
    def from_dict(cls, values: dict[str, torch.Tensor]) -> Features:
        """From a dict with the three feature names (a label shard or a training batch)."""
        return cls(values["topk_logits"], values["token_embedding"], values["hidden"])


def read_features(slm: nn.Module, logits: torch.Tensor, hidden: torch.Tensor, token: torch.Tensor, k: int) -> Features:
    """The router's inputs from the SLM's raw logits [N, V], its hidden state [N, H] and its proposal [N]."""
    return Features(topk_logits(logits, k), embed_tokens(slm, token), hidden)


def score(router: nn.Module, features: Features) -> torch.Tensor:
    """Router scores [N] in [0, 1], computed on the router's device (returned there)."""
    device = router_device(router, features.hidden.device)
    return router.scores(
        features.topk_logits.to(device), features.token_embedding.to(device), features.hidden.to(device)
    )


def router_device(router: nn.Module, fallback: torch.device) -> torch.device:
    """Where a router runs: the device of its weights, or ``fallback`` for routers without any."""
    param = next(iter(router.parameters()), None)
    return param.device if param is not None else fallback


class HiddenStateCapture:
    """Keeps the input of the model's ``lm_head``: the last hidden state after the final norm.

    A forward pre-hook avoids ``output_hidden_states=True``, which would keep every
    layer's states. Use as a context manager around one or many forwards.

    The hook sits on a module that every thread running the model shares, so each capture keeps
    only the forwards of the thread that opened it: concurrent ``generate`` calls on one model
    (threads, a server) each read their own hidden state.

    Args:
        model: a causal LM whose ``get_output_embeddings()`` is its lm_head.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.hidden: torch.Tensor | None = None
        self._handle = None
        self._thread: int | None = None

    def _hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() == self._thread:
            self.hidden = args[0]

    def __enter__(self) -> HiddenStateCapture:
        head = self.model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(self.model).__name__} has no output embeddings (lm_head); R2R needs a causal LM.")
        self._thread = threading.get_ident()
        self._handle = head.register_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.hidden = None


def input_device(model: nn.Module) -> torch.device:
    """Where a model wants its input ids: the device of its input embedding.

    Models dispatched by accelerate move inputs themselves; an embedding that
    accelerate offloaded (weights on ``meta``) gets its inputs on the CPU.
    """
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


def output_device(model: nn.Module) -> torch.device:
    """The device of the model's lm_head, where its logits and hidden states appear."""
    weight = model.get_output_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0, 1, ... from each row's first real token (pads get 0), as HF's
    ``generate`` prepares them."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def lm_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Cache | None,
    logits_to_keep: int | torch.Tensor = 1,
) -> torch.Tensor:
    """One forward of a causal LM over ``input_ids`` (appended to ``cache``); returns its logits.

    Args:
        model: the SLM or LLM (or a compiled call of one).
        input_ids: [B, T] new tokens only.
        attention_mask: [B, past + T] mask over the whole sequence, or None when nothing is padded.
        position_ids: [B, T] positions of the new tokens.
        cache: the model's KV cache (extended in place), or None for a cache-free forward.
        logits_to_keep: compute logits for the last n positions only (0 = all), or at the given indices.
    """
    device = input_device(model)
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        position_ids=None if position_ids is None else position_ids.to(device),
        **cache_argument(cache, model),
        use_cache=cache is not None,
        logits_to_keep=logits_to_keep,
        return_dict=True,
    )
    return out.logits


def slm_proposals(slm: nn.Module, ids: torch.Tensor, vocab: int, keep: int = 0) -> tuple[torch.Tensor, ...]:
    """A cache-free SLM forward over ``ids`` [1, T]: its logits [n, V], post-norm hidden states [n, H] and argmax
    proposals over the first ``vocab`` ids [n] at the last ``keep`` positions (0: every position)."""
    with HiddenStateCapture(slm) as capture:
        logits = lm_forward(slm, ids, None, None, cache=None, logits_to_keep=keep)[0]
        hidden = capture.hidden[0]
    return logits, hidden, logits[:, :vocab].argmax(-1)


def topk_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest raw logits along the last axis, sorted descending, as float32."""
    return torch.topk(logits, k, dim=-1, sorted=True).values.float()


def embed_tokens(slm: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The SLM's own input embedding of ``tokens`` (the table is never copied)."""
    embedding = slm.get_input_embeddings()
    return embedding(tokens.to(input_device(slm)))
