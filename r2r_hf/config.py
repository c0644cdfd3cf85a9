"""R2RConfig: everything a router checkpoint needs besides its weights.

A router folder holds this config (``config.json``) and the router's weights
(``model.safetensors``). The config names the SLM and LLM the router was trained
for, so ``R2RForCausalLM.from_pretrained(folder)`` can load all three.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

ROUTER_TYPES = ("mlp", "entropy", "random")


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
        threshold: route to the LLM when ``score >= threshold``.
        threshold_recall_target: divergent-class recall the threshold was calibrated for.
        expected_llm_token_rate: share of tokens routed at ``threshold`` on the
            calibration data.
        calibration: how the threshold was picked (method, target, recall, LLM token rate...).
        training: how the router was trained (data, label statistics, epochs...).
        evaluation: benchmark results to show in the model card.
        license: the router's licence for its model card (default: the pair's, where both agree).
        random_seed: seed of the random baseline's private generator.
    """

    model_type = "r2r"

    slm_name_or_path: str | None = None
    llm_name_or_path: str | None = None
    slm_revision: str | None = None
    llm_revision: str | None = None
    router_type: str = "mlp"
    slm_hidden_size: int | None = None
    slm_embedding_size: int | None = None
    num_topk_logits: int = 100
    router_hidden_dims: list[int] | None = None
    router_expansion: int = 4
    router_dropout: float = 0.1
    normalize_input: bool = False
    threshold: float = 0.5
    threshold_recall_target: float | None = None
    expected_llm_token_rate: float | None = None
    calibration: dict[str, Any] | None = None
    training: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None
    license: str | None = None
    random_seed: int = 0

    def __post_init__(self, **kwargs: Any) -> None:
        if self.router_type not in ROUTER_TYPES:
            raise ValueError(f"router_type={self.router_type!r} is unknown; use one of {', '.join(ROUTER_TYPES)}.")
        if self.num_topk_logits < 1:
            raise ValueError(f"num_topk_logits must be at least 1, got {self.num_topk_logits}.")
        if self.slm_embedding_size is None:
            self.slm_embedding_size = self.slm_hidden_size
        if self.router_hidden_dims is None:
            self.router_hidden_dims = [1024] * 6
        if not self.router_hidden_dims:
            raise ValueError("router_hidden_dims must name at least one block width, e.g. [1024] * 6.")
        self.router_hidden_dims = [int(d) for d in self.router_hidden_dims]
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"threshold must be a number (route when score >= threshold), got {self.threshold!r}.")
        self.threshold = float(self.threshold)
        self.calibration = dict(self.calibration or {})
        self.training = dict(self.training or {})
        self.evaluation = dict(self.evaluation or {})
        super().__post_init__(**kwargs)
