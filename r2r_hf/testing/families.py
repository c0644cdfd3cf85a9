"""Tiny random SLM/LLM pairs of every decoder family the family matrix covers, built from transformers' own configs.

Each ``Family`` names a transformers config and causal-LM class and the few settings that make it tiny (2 layers,
hidden 32, vocabulary 416: the test tokenizer's 400 ids and padding) while keeping what makes the family itself: its
windows (8 tokens, so a short answer runs past them), chunks, recurrent blocks, rotary scaling. A pair's LLM is a
perturbed copy of its SLM (they agree on most tokens, so speculation both confirms and rejects), or, for a mixed
pair, a model of another family sharing the vocabulary. The lm_heads are spread as in ``models.py`` (no float
near-ties, no token past the tokenizer's). Used by ``matrix.py`` (tests/test_model_families.py and the docs table).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import transformers
from transformers import PreTrainedModel

from .models import EOS_ID, PAD_ID, _spread_lm_head

VOCAB, WINDOW = 416, 8
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
            bos_token_id=1, tie_word_embeddings=False)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MAMBA = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)


@dataclass(frozen=True)
class Family:
    """A decoder family: ``config``/``model`` are transformers class names; ``settings`` override ``BASE``.

    Args:
        label: the name the docs table shows (a transformers model type, or the variant's usual name).
        kind: what makes it differ from the dense Llama lineage ("dense", "absolute", "window", "chunked",
            "alibi", "mqa", "recurrent", "longrope").
        slow: kept out of CI's matrix (``pytest -m families_slow``): its reference kernels cost seconds per call.
    """

    label: str
    config: str
    model: str
    kind: str = "dense"
    settings: dict = field(default_factory=dict)
    slow: bool = False


def _f(label, config, model, kind="dense", slow=False, **settings) -> Family:
    return Family(label, config + "Config", model, kind, settings, slow)


SW = dict(sliding_window=WINDOW)
FAMILIES: dict[str, Family] = {f.label: f for f in (
    # the dense Llama lineage
    _f("llama", "Llama", "LlamaForCausalLM"),
    _f("qwen2", "Qwen2", "Qwen2ForCausalLM"),
    _f("qwen3", "Qwen3", "Qwen3ForCausalLM", head_dim=8),
    _f("qwen3_moe", "Qwen3Moe", "Qwen3MoeForCausalLM", head_dim=8, **EXPERTS),
    _f("qwen2_moe", "Qwen2Moe", "Qwen2MoeForCausalLM", shared_expert_intermediate_size=32, **EXPERTS),
    _f("mixtral", "Mixtral", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2),
    _f("olmo2", "Olmo2", "Olmo2ForCausalLM"),
    _f("gemma", "Gemma", "GemmaForCausalLM", head_dim=8),
    _f("granite", "Granite", "GraniteForCausalLM"),
    _f("cohere", "Cohere", "CohereForCausalLM"),
    _f("stablelm", "StableLm", "StableLmForCausalLM"),
    _f("phi3", "Phi3", "Phi3ForCausalLM"),
    _f("smollm3", "SmolLM3", "SmolLM3ForCausalLM"),
    _f("glm4", "Glm4", "Glm4ForCausalLM"),
    _f("gpt_neox", "GPTNeoX", "GPTNeoXForCausalLM"),
    _f("gptj", "GPTJ", "GPTJForCausalLM", rotary_dim=4),
    # learned absolute positions
    _f("gpt2", "GPT2", "GPT2LMHeadModel", "absolute", n_inner=64),
    _f("opt", "OPT", "OPTForCausalLM", "absolute", word_embed_proj_dim=32, ffn_dim=64),
    # sliding windows: from ``sliding_window`` alone, or per layer (``layer_types``)
    _f("mistral", "Mistral", "MistralForCausalLM", "window", **SW),
    _f("ministral", "Ministral", "MinistralForCausalLM", "window", head_dim=8,
       layer_types=["sliding_attention", "full_attention"], **SW),
    _f("starcoder2", "Starcoder2", "Starcoder2ForCausalLM", "window", **SW),
    _f("phi3-4k", "Phi3", "Phi3ForCausalLM", "window", **SW),
    _f("gemma2", "Gemma2", "Gemma2ForCausalLM", "window", head_dim=8, query_pre_attn_scalar=8, **SW),
    _f("gemma3", "Gemma3Text", "Gemma3ForCausalLM", "window", head_dim=8, query_pre_attn_scalar=8,
       layer_types=["sliding_attention", "full_attention"], **SW),
    _f("olmo3", "Olmo3", "Olmo3ForCausalLM", "window", layer_types=["sliding_attention", "full_attention"], **SW),
    _f("cohere2", "Cohere2", "Cohere2ForCausalLM", "window", layer_types=["sliding_attention", "full_attention"],
       **SW),
    _f("gpt_oss", "GptOss", "GptOssForCausalLM", "window", head_dim=8, num_local_experts=4, num_experts_per_tok=2,
       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                        "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}, **SW),
    # chunked attention
    _f("llama4", "Llama4Text", "Llama4ForCausalLM", "chunked", head_dim=8, intermediate_size_mlp=64,
       num_local_experts=2, attention_chunk_size=WINDOW, layer_types=["chunked_attention", "full_attention"]),
    # ALiBi, multi-query attention
    _f("bloom", "Bloom", "BloomForCausalLM", "alibi"),
    _f("falcon", "Falcon", "FalconForCausalLM", "mqa", ffn_hidden_size=64),
    # long-context rotary factors chosen by the sequence's length (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini)
    _f("phi3-longrope", "Phi3", "Phi3ForCausalLM", "longrope", original_max_position_embeddings=16,
       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                        "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 16}),
    # recurrent and hybrid layers
    _f("lfm2", "Lfm2", "Lfm2ForCausalLM", "recurrent", layer_types=["conv", "full_attention"],
       block_auto_adjust_ff_dim=False),
    _f("mamba", "Mamba", "MambaForCausalLM", "recurrent", state_size=8, expand=2, conv_kernel=4),
    _f("recurrent_gemma", "RecurrentGemma", "RecurrentGemmaForCausalLM", "recurrent", lru_width=32,
       block_types=["recurrent", "attention"], attention_window_size=WINDOW),
    _f("granitemoehybrid", "GraniteMoeHybrid", "GraniteMoeHybridForCausalLM", "recurrent", slow=True,
       layer_types=["mamba", "attention"], num_local_experts=2, mamba_n_heads=4, mamba_d_head=16,
       shared_intermediate_size=32, **MAMBA),
    _f("zamba2", "Zamba2", "Zamba2ForCausalLM", "recurrent", slow=True, layers_block_type=["mamba", "hybrid"],
       n_mamba_heads=4, chunk_size=8, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, adapter_rank=8),
    _f("falcon_h1", "FalconH1", "FalconH1ForCausalLM", "recurrent", slow=True, mamba_n_heads=4, mamba_d_head=16,
       mamba_d_ssm=64, **MAMBA),
)}

# Pairs: every family with itself, and SLMs of one family with an LLM of another that shares the vocabulary.
MIXED = {"qwen2+llama": ("qwen2", "llama"), "llama+mistral": ("llama", "mistral"), "gemma+gemma2": ("gemma", "gemma2")}
PAIRS: dict[str, tuple[str, str]] = {**{name: (name, name) for name in FAMILIES}, **MIXED}


def build(family: str, seed: int) -> PreTrainedModel:
    """A tiny random model of ``family`` (fp32, eval mode); the same seed gives the same weights."""
    spec = FAMILIES[family]
    config_class = getattr(transformers, spec.config)
    known = {f.name for f in dataclasses.fields(config_class)} | set(getattr(config_class, "attribute_map", {}))
    base = {k: v for k, v in BASE.items() if k in known}  # (an unknown key would become a stray attribute)
    config = config_class(**{**base, **spec.settings})
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD_ID, EOS_ID
    return _spread_lm_head(model, scale=12.0, seed=seed + 100)


def perturbed(model: PreTrainedModel, noise: float = 0.05, seed: int = 5) -> PreTrainedModel:
    """A copy of ``model`` with every weight moved a little: a "larger" model that agrees on most tokens."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            if param.numel() > 1 and param.is_floating_point():
                param.add_(torch.randn(param.shape, generator=generator) * noise * param.std())
    return other.eval()


def build_pair(name: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The fp32 SLM and LLM of pair ``name`` (a family, or a mixed pair of ``MIXED``)."""
    slm_family, llm_family = PAIRS[name]
    slm = build(slm_family, seed=0)
    llm = perturbed(slm) if slm_family == llm_family else build(llm_family, seed=1)
    return slm, llm


def is_slow(name: str) -> bool:
    return any(FAMILIES[f].slow for f in PAIRS[name])
