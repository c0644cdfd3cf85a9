"""r2r_hf: R2R token-level routing between a small and a large LM, native to Hugging Face transformers.

Importing the package registers ``model_type="r2r"`` with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(router_repo)`` returns an ``R2RForCausalLM``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import R2RConfig
from .modeling import R2RForCausalLM
from .outputs import R2RForwardOutput, R2RGenerateOutput
from .processor import R2RLogitsProcessor
from .router import EntropyRouter, MLPRouter, RandomRouter, Router, build_router

__version__ = "0.1.0"

AutoConfig.register("r2r", R2RConfig, exist_ok=True)
AutoModel.register(R2RConfig, R2RForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(R2RConfig, R2RForCausalLM, exist_ok=True)

__all__ = [
    "EntropyRouter",
    "MLPRouter",
    "R2RConfig",
    "R2RForCausalLM",
    "R2RForwardOutput",
    "R2RGenerateOutput",
    "R2RLogitsProcessor",
    "RandomRouter",
    "Router",
    "build_router",
]
