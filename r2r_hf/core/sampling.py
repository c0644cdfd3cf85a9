"""Turning processed scores into tokens, with the random stream R2R must keep exact.

Sampling keeps HF's random stream: it advances once per committed token. The SLM draws its
proposal; where a row is routed, the stream is rewound to where the SLM's draw started and the
LLM draws in its place. So never-route equals ``slm.generate`` and always-route equals
``llm.generate`` under the same seed.

``Sampler`` is one generate call's: one draw for the whole batch, from the global stream (HF's
behaviour) or from the call's own generator when the call names a ``seed`` (then the draws are the
same as ``torch.manual_seed(seed)`` would give, and concurrent calls never share a stream).
Per-row streams (the server's requests) are ``choice.RowChoice``'s: a row answers the same whether it
ran alone or beside others.
"""

from __future__ import annotations

import torch

# Seeds are drawn into a 64-bit generator state; larger values are refused before they reach torch.
MAX_SEED = 2**63 - 1


def check_seed(value: object) -> int:
    """A random seed as an int in [0, 2**63); anything else is refused in one sentence."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"seed must be a whole number between 0 and 2**63 - 1, got {value!r}.")
    return value


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A private generator on ``device`` that draws what the global one draws after ``torch.manual_seed(seed)``."""
    return torch.Generator(device=device).manual_seed(check_seed(seed))


def _global_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device.index)


def _set_global_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device.index)


def _widened(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Scores [B, V] over the writing model's own lm_head width (padding columns at -inf).

    A draw is taken over that width, so the stream advances by what that model's own ``generate`` would consume.
    """
    if width > scores.shape[-1]:
        scores = torch.nn.functional.pad(scores, (0, width - scores.shape[-1]), value=-float("inf"))
    return scores


def _draw(scores: torch.Tensor, width: int, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(_widened(scores, width).softmax(-1), num_samples=1, generator=generator).squeeze(1)


class Sampler:
    """One call's token choice: HF's argmax, or one multinomial draw for the batch.

    Args:
        do_sample: draw (True) or take the argmax (False).
        device: where the scores live (its global generator is used when ``generator`` is None).
        generator: the call's own stream (a ``seed`` was given), or None for the global one.
    """

    def __init__(self, do_sample: bool, device: torch.device, generator: torch.Generator | None = None) -> None:
        self.do_sample, self.device, self.generator = do_sample, device, generator

    def state(self) -> torch.Tensor | None:
        """Where the stream stands (taken before the SLM's draw so the LLM can redraw in its place)."""
        if not self.do_sample:
            return None
        return self.generator.get_state() if self.generator is not None else _global_state(self.device)

    def restore(self, state: torch.Tensor | None) -> None:
        if state is None:
            return
        if self.generator is not None:
            self.generator.set_state(state)
        else:
            _set_global_state(self.device, state)

    def pick(self, scores: torch.Tensor, width: int) -> torch.Tensor:
        """Tokens [B] from processed scores [B, V]; ``width`` is the writing model's lm_head width."""
        return _draw(scores, width, self.generator) if self.do_sample else scores.argmax(-1)
