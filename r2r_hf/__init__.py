"""r2r_hf: R2R token-level routing between a small and a large LM, native to Hugging Face transformers.

Importing the package registers ``model_type="r2r"`` with the Auto classes, so
``AutoModelForCausalLM.from_pretrained(router_repo)`` returns an ``R2RForCausalLM``.

Layers (each a subpackage): ``core`` (the decoding loop and its engines), ``model`` (the HF
model, loading, Hub I/O, official routers, the LogitsProcessor form), ``pipeline`` (labeling),
``training`` (training and calibration), ``views`` (HTML, ANSI, streaming), ``cli``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .config import R2RConfig
from .core.outputs import R2RGenerateOutput, RoutingAwareStreamer
from .model.modeling import R2RForCausalLM
from .model.processor import R2RLogitsProcessor
from .router import EntropyRouter, MLPRouter, RandomRouter, Router, build_router
from .version import __version__

AutoConfig.register("r2r", R2RConfig, exist_ok=True)
AutoModel.register(R2RConfig, R2RForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(R2RConfig, R2RForCausalLM, exist_ok=True)

__all__ = [
    "EntropyRouter",
    "MLPRouter",
    "R2RConfig",
    "R2RForCausalLM",
    "R2RGenerateOutput",
    "R2RLogitsProcessor",
    "RandomRouter",
    "Router",
    "RoutingAwareStreamer",
    "__version__",
    "build_router",
]
