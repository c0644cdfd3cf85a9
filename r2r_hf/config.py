"""R2RConfig: everything a router checkpoint needs besides its weights.

A router folder holds this config (``config.json``), the router's weights
(``model.safetensors``), its model card (``README.md``) and, for trained routers, the
record of how it was trained, calibrated and evaluated (``router_metrics.json``; see
``model/record.py``). The config says only what the router *is*: the pair it routes
between, its sizes and its default threshold, so ``R2RForCausalLM.from_pretrained(folder)``
can load all three models.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

from .router_types import ROUTER_TYPES, SIGNALS  # noqa: F401 - declared there, re-exported here

DEFAULT_THRESHOLD = 0.5  # route where score >= 0.5: the default of an uncalibrated router
DEFAULT_NUM_TOPK = 100  # the paper's router reads the top-100 raw SLM logits
# Bounds that keep a mistyped size from building a useless or a terabyte router: the paper's blocks are 1024
# wide and its router has 56M parameters.
MAX_ROUTER_WIDTH = 16384
MAX_ROUTER_PARAMETERS = 10**9
# Fields of configs written before r2r_hf 0.2: provenance now kept in router_metrics.json.
LEGACY_RECORD_FIELDS = (
    "threshold_recall_target", "expected_llm_token_rate", "calibration", "training", "evaluation", "license",
)


@strict
class R2RConfig(PreTrainedConfig):
    """Configuration of an R2R router and the model pair it routes between.

    No attribute shares a name with a generation parameter (``top_k``,
    ``temperature``...): ``save_pretrained`` refuses configs that do.

    Args:
        slm_name_or_path: Hub id or folder of the small model (writes most tokens).
        llm_name_or_path: Hub id or folder of the large model (writes routed tokens).
        slm_revision: Hub revision of the SLM (branch, tag or commit), or None.
        llm_revision: Hub revision of the LLM, or None.
        router_type: ``"mlp"`` (the paper's neural router), ``"entropy"`` (normalised
            entropy of the SLM's top-k distribution) or ``"random"`` (a uniform score:
            routes a share ``1 - threshold`` of tokens). The last two are baselines.
        slm_hidden_size: width H of the SLM's last hidden state.
        slm_embedding_size: width E of the SLM's input embedding (usually H).
        num_topk_logits: how many sorted raw SLM logits the router reads (k).
        router_hidden_dims: widths of the residual blocks; one block per entry.
        router_expansion: MLP expansion factor inside each block.
        router_dropout: dropout rate during training.
        normalize_input: apply LayerNorm to hidden/embedding and softmax to the
            logits before projecting (off in every published router).
        router_signals: free signals of the SLM's top-k logits the MLP router also reads (``entropy``, ``margin``);
            none in the paper's router and every published one.
        threshold: route to the LLM when ``score >= threshold`` (the default of every call).
        random_seed: the random baseline's seed: keys the draws of rows without a seed of their own (``RandomRouter``).
    """

    model_type = "r2r"

    slm_name_or_path: str | None = None
    llm_name_or_path: str | None = None
    slm_revision: str | None = None
    llm_revision: str | None = None
    router_type: str = "mlp"
    slm_hidden_size: int | None = None
    slm_embedding_size: int | None = None
    num_topk_logits: int = DEFAULT_NUM_TOPK
    router_hidden_dims: list[int] | None = None
    router_expansion: int = 4
    router_dropout: float = 0.1
    normalize_input: bool = False
    router_signals: list[str] | None = None
    threshold: float = DEFAULT_THRESHOLD
    random_seed: int = 0

    def __post_init__(self, **kwargs: Any) -> None:
        for name in ("slm_hidden_size", "slm_embedding_size", "num_topk_logits", "router_expansion", "random_seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}); write a whole "
                                 "number (in config.json, without quotes).")
        if self.router_type not in ROUTER_TYPES:
            raise ValueError(f"router_type={self.router_type!r} is unknown; use one of {', '.join(ROUTER_TYPES)}.")
        for name in ("slm_hidden_size", "slm_embedding_size", "num_topk_logits", "router_expansion"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if not 0 <= self.random_seed < 2**64:
            raise ValueError(f"random_seed must be between 0 and 2**64 - 1, got {self.random_seed}.")
        if isinstance(self.router_dropout, bool) or not isinstance(self.router_dropout, (int, float)) \
                or not 0 <= self.router_dropout < 1:
            raise ValueError(f"router_dropout must be a number in [0, 1), got {self.router_dropout!r}.")
        if self.slm_embedding_size is None:
            self.slm_embedding_size = self.slm_hidden_size
        if self.router_hidden_dims is None:
            self.router_hidden_dims = [1024] * 6
        if not self.router_hidden_dims:
            raise ValueError("router_hidden_dims must name at least one block width, e.g. [1024] * 6.")
        self.router_hidden_dims = [int(d) for d in self.router_hidden_dims]
        self.router_signals = list(self.router_signals or [])
        unknown = [name for name in self.router_signals if name not in SIGNALS]
        if unknown or len(set(self.router_signals)) != len(self.router_signals):
            raise ValueError(f"router_signals={self.router_signals} must name each of {', '.join(SIGNALS)} at most once.")
        if not all(1 <= d <= MAX_ROUTER_WIDTH for d in self.router_hidden_dims):
            raise ValueError(f"router_hidden_dims must be widths from 1 to {MAX_ROUTER_WIDTH}, got "
                             f"{self.router_hidden_dims}.")
        if self.router_type == "mlp" and self.slm_hidden_size is not None and \
                router_parameters(self) > MAX_ROUTER_PARAMETERS:
            raise ValueError(
                f"These sizes describe a router of {router_parameters(self):,} parameters, more than the "
                f"{MAX_ROUTER_PARAMETERS:,} r2r_hf accepts (slm_hidden_size {self.slm_hidden_size}, "
                f"slm_embedding_size {self.slm_embedding_size}, num_topk_logits {self.num_topk_logits}, "
                f"router_hidden_dims {self.router_hidden_dims}, router_expansion {self.router_expansion}); "
                "check them, above all router_hidden_dims and router_expansion (the paper's router: [1024] * 6 with expansion 4, 56M parameters)."
            )
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"threshold must be a number (route when score >= threshold), got {self.threshold!r}.")
        self.threshold = float(self.threshold)
        # A config written before 0.2 carries the router's provenance; the model moves it to its record.
        self.legacy_record = {k: kwargs.pop(k) for k in LEGACY_RECORD_FIELDS if k in kwargs}
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.pop("legacy_record", None)
        return out


def router_parameters(config: R2RConfig) -> int:
    """How many parameters the MLP router ``config`` describes has (see ``router.MLPRouter``)."""
    hidden, embed, k, dims, x = (config.slm_hidden_size, config.slm_embedding_size, config.num_topk_logits,
                                 config.router_hidden_dims, config.router_expansion)
    n = len(config.router_signals or [])
    count = 2 * (hidden + embed) if config.normalize_input else 0
    count += (k + 1) * hidden + (2 * hidden + embed + n + 1) * dims[0] + (dims[0] + 1) * dims[0]
    count += n + 1 if n else 0  # the signal head
    for d_in, d_out in zip(dims, dims[1:] + dims[-1:]):
        count += 2 * d_in + (d_in + 1) * x * d_in + (x * d_in + 1) * d_out
        count += (d_in + 1) * d_out if d_in != d_out else 0
    return count + 2 * dims[-1] + dims[-1] + 1
