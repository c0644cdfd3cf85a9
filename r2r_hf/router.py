"""Routers: from the SLM's features at one position to a score in [0, 1].

Every router reads the same three features of the SLM at the current step:

* ``topk_logits`` [B, k]: the k largest raw SLM logits, sorted descending;
* ``token_embedding`` [B, E]: the SLM's own input embedding of the token it proposes;
* ``hidden`` [B, H]: the SLM's last hidden state after the final norm.

and returns ``score`` [B]; the LLM writes the token where ``score >= threshold``.

``MLPRouter`` is the paper's neural router. Its parameter names and block
structure match the official checkpoints one to one, so published weights load
without renaming. ``EntropyRouter`` and ``RandomRouter`` are the baselines the
paper compares against; they share the interface so every evaluation can swap them in.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import R2RConfig
from .router_types import ENTROPY, MLP, RANDOM


class Router(nn.Module):
    """Interface of every router: ``scores(topk_logits, token_embedding, hidden) -> [B]`` in [0, 1].

    ``capturable``: ``scores`` is a pure function of its tensors (no host synchronisation, no Python
    state), so the fast path may compile it or capture it in a CUDA graph. A stateful router sets it
    False and runs eagerly.
    """

    capturable = True

    def for_call(self) -> Router:
        """The router one generate call scores with (called once per call, before the first step).

        A stateless router returns itself. A router with per-call state returns a fresh instance, so
        concurrent calls on one model never share that state (the default restarts it via ``reset``
        and returns itself: enough for single-threaded use).
        """
        self.reset()
        return self

    def scores(self, topk_logits: torch.Tensor, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reset(self) -> None:
        """Restart per-call state (the default ``for_call`` calls it)."""

    def step(self) -> None:
        """Called eagerly once per decoding step, before ``scores``.

        A router with per-step state updates it here, in place, so that ``scores`` stays a pure
        tensor function the fast path can capture.
        """


class BackboneLinear(nn.Linear):
    """A Linear of the backbone: the paper initialises these Kaiming-normal (the projections keep torch's default)."""


class ResidualBlock(nn.Module):
    """Pre-LN residual MLP block: ``x -> dim_change(x) + mlp(layer_norm(x))``."""

    def __init__(self, dim_in: int, dim_out: int, expansion: int, dropout: float) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(dim_in)
        self.mlp = nn.Sequential(
            BackboneLinear(dim_in, expansion * dim_in),
            nn.GELU(),
            nn.Dropout(dropout),
            BackboneLinear(expansion * dim_in, dim_out),
            nn.Dropout(dropout),
        )
        self.dim_change = BackboneLinear(dim_in, dim_out) if dim_in != dim_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.dim_change is None else self.dim_change(x)
        return skip + self.mlp(self.layer_norm(x))


class Backbone(nn.Module):
    """Input projection, the residual blocks, then LayerNorm and one output logit."""

    def __init__(self, hidden_dims: list[int], expansion: int, dropout: float) -> None:
        super().__init__()
        self.input_projection = BackboneLinear(hidden_dims[0], hidden_dims[0])
        dims = list(hidden_dims) + [hidden_dims[-1]]
        self.blocks = nn.ModuleList(
            ResidualBlock(dims[i], dims[i + 1], expansion, dropout) for i in range(len(hidden_dims))
        )
        self.output_layer = nn.Sequential(nn.LayerNorm(dims[-1]), BackboneLinear(dims[-1], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_projection(x)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x).squeeze(-1)


def normalised_entropy(topk_logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the top-k logits, divided by ln(k): in [0, 1], float32."""
    logp = topk_logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1) / math.log(max(topk_logits.shape[-1], 2))


def signals(topk_logits: torch.Tensor, names: list[str]) -> torch.Tensor:
    """The free signals ``names`` of the SLM's top-k logits [..., k] as [..., len(names)] float32: ``entropy``
    (normalised, as the entropy baseline scores) and ``margin`` (the gap between the two largest raw logits). Any
    leading shape, as the router's other inputs (a model's embedding may keep a token axis: Gemma 3n's)."""
    if not names:
        return topk_logits.new_zeros(*topk_logits.shape[:-1], 0, dtype=torch.float32)
    values = {"entropy": lambda: normalised_entropy(topk_logits),
              "margin": lambda: (topk_logits[..., 0] - topk_logits[..., 1]).float()}
    return torch.stack([values[name]() for name in names], dim=-1)


class SignalHead(nn.Linear):
    """The free signals straight to the router's logit, beside the backbone: initialised to the entropy baseline's
    ranking (the backbone's last layer starts at zero), so training starts from entropy and corrects it."""

    ENTROPY_WEIGHT, BIAS = 10.0, -3.0  # sigmoid(10 * entropy - 3): entropy's order, spread over the score's range

    def __init__(self, names: list[str]) -> None:
        super().__init__(len(names), 1)
        self.names = list(names)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
        nn.init.constant_(self.bias, self.BIAS)
        with torch.no_grad():
            for i, name in enumerate(getattr(self, "names", ())):
                if name == "entropy":
                    self.weight[0, i] = self.ENTROPY_WEIGHT


class MLPRouter(Router):
    """The paper's router: concat[hidden, token embedding, projected logits] -> residual MLP -> logit.

    With ``router_signals`` (``entropy``, ``margin``: computed from the top-k logits it reads anyway, so it needs
    nothing the paper's router does not) the signals join the concatenation, and a ``SignalHead`` adds them to the
    logit directly: the router starts from the entropy baseline and learns what it misses.

    Args:
        config: gives ``slm_hidden_size`` (H), ``slm_embedding_size`` (E),
            ``num_topk_logits`` (k), ``router_hidden_dims``, ``router_expansion``,
            ``router_dropout``, ``normalize_input`` and ``router_signals``.
    """

    def __init__(self, config: R2RConfig) -> None:
        super().__init__()
        if config.slm_hidden_size is None:
            raise ValueError(
                "R2RConfig.slm_hidden_size is not set; build the config with R2RForCausalLM.from_models(slm, llm) "
                "or pass slm_hidden_size=<the SLM's hidden size>."
            )
        hidden, embed, k = config.slm_hidden_size, config.slm_embedding_size, config.num_topk_logits
        self.normalize_input = config.normalize_input
        if self.normalize_input:
            self.layer_norm_hidden_states = nn.LayerNorm(hidden)
            self.layer_norm_token = nn.LayerNorm(embed)
        self.signal_names = list(config.router_signals)
        n = len(self.signal_names)
        self.logits_projection = nn.Linear(k, hidden)
        self.combined_projection = nn.Linear(hidden + embed + hidden + n, config.router_hidden_dims[0])
        self.backbone = Backbone(config.router_hidden_dims, config.router_expansion, config.router_dropout)
        if n:
            self.signal_head = SignalHead(self.signal_names)
            self.backbone.output_layer[1].starts_at_zero = True

    def forward(self, topk_logits: torch.Tensor, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Returns the router logit [B]; ``sigmoid`` of it is the score."""
        dtype = self.logits_projection.weight.dtype
        free = signals(topk_logits, self.signal_names).to(dtype)  # from the raw logits, before any normalisation
        topk_logits, token_embedding, hidden = topk_logits.to(dtype), token_embedding.to(dtype), hidden.to(dtype)
        if self.normalize_input:
            hidden = self.layer_norm_hidden_states(hidden)
            token_embedding = self.layer_norm_token(token_embedding)
            topk_logits = topk_logits.softmax(-1)
        # Concatenation order is the official one: [hidden, token embedding, projected logits] (then any signals).
        x = torch.cat([hidden, token_embedding, self.logits_projection(topk_logits), free], dim=-1)
        logit = self.backbone(self.combined_projection(x))
        return logit + self.signal_head(free).squeeze(-1) if self.signal_names else logit

    def scores(self, topk_logits: torch.Tensor, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # The sigmoid in fp32: in a bf16 copy (core/fast/router_copy.py) a bf16 score near the threshold moves in steps of
        # 2^-8, which ties scores a rate-calibrated threshold must separate; the logit's own steps are ~4x finer.
        return torch.sigmoid(self(topk_logits, token_embedding, hidden).float())


class EntropyRouter(Router):
    """Baseline: entropy of the SLM's top-k distribution, divided by ln(k) so it lies in [0, 1]."""

    def scores(self, topk_logits: torch.Tensor, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return normalised_entropy(topk_logits)


class RandomRouter(Router):
    """Baseline: a uniform score (routes about ``1 - threshold``), never from the global random stream.

    In a decoding loop the score of a row's answer token ``i`` is ``uniform(key, i)``, ``key`` the row's seed: its
    owner's ``seed`` where it has one (a served request's; choice i: seed + i), else the call's
    (``generate(seed=...)``), else ``seed``. So each row has its own stream: it routes as it routes alone whatever
    its neighbours, a position proposed again after a speculative rollback draws what was drawn there, and a served
    answer is ``generate`` alone's, the same every time it is sent. (Rows with one key route at the same
    positions.) The decoding step tells it which rows it scores (``per_row``: ``rows_scored``). Outside a loop
    (``scores`` on teacher-forced features) it draws from a private generator seeded with ``seed``. Its keys are
    host values: never captured.
    """

    capturable = False
    per_row = True  # the step calls ``rows_scored`` before ``scores``

    def __init__(self, seed: int, call_seed: int | None = None) -> None:
        super().__init__()
        self.seed, self.call_seed = seed, call_seed
        self.generator = torch.Generator().manual_seed(seed)
        self._keys: list[tuple[int, int]] | None = None

    def reset(self) -> None:
        self.generator.manual_seed(self.seed)

    def for_call(self, seed: int | None = None) -> RandomRouter:
        """A fresh router for one call; ``seed``: the call's, which keys every row without a seed of its own."""
        return RandomRouter(self.seed, seed)

    def rows_scored(self, rows: list) -> None:
        """The host state (``core.rows.RowState``) of the rows the next ``scores`` scores, in its order."""
        default = self.seed if self.call_seed is None else self.call_seed
        keys = [getattr(row.owner, "seed", None) for row in rows]
        self._keys = [(default if key is None else key, row.written) for key, row in zip(keys, rows)]

    def scores(self, topk_logits: torch.Tensor, token_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        keys, self._keys = self._keys, None
        if keys is None:
            draw = torch.rand(topk_logits.shape[0], generator=self.generator)
        elif len(keys) != topk_logits.shape[0]:
            raise RuntimeError(f"RandomRouter was told of {len(keys)} rows and asked to score {topk_logits.shape[0]}.")
        else:
            draw = torch.tensor([uniform(key, i) for key, i in keys], dtype=torch.float32)
        return draw.to(topk_logits.device)


_MASK = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: 64 well-mixed bits from any 64."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def uniform(key: int, position: int) -> float:
    """A uniform number in [0, 1) that is a fixed function of (``key``, ``position``): 24 bits, exact in float32."""
    return (_mix(_mix((key + 0x9E3779B97F4A7C15) & _MASK) ^ position) >> 40) / 2**24


def build_router(config: R2RConfig) -> Router:
    """The router named by ``config.router_type``."""
    builders = {MLP: lambda: MLPRouter(config), ENTROPY: EntropyRouter, RANDOM: lambda: RandomRouter(config.random_seed)}
    return builders[config.router_type]()  # R2RConfig refused any other type


def init_router_module(module: nn.Module) -> None:
    """Initialise one router module as the paper does (Kaiming-normal backbone, default projections); with signals,
    the backbone's last layer at zero and the signal head at the entropy baseline (``SignalHead``)."""
    if isinstance(module, BackboneLinear):
        if getattr(module, "starts_at_zero", False):
            nn.init.zeros_(module.weight)
        else:
            nn.init.kaiming_normal_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.Linear, nn.LayerNorm)):
        module.reset_parameters()
