"""The decoder families the family matrix covers, declared from transformers' own configs (``builds.py`` builds them).

Each ``Family`` names a transformers config and causal-LM class and the few settings that make it tiny (2 layers,
hidden 32, vocabulary 416: the test tokenizer's 400 ids and padding) while keeping what makes the family itself: its
windows (16 tokens, so a 40-token answer runs past them), chunks, recurrent blocks, rotary scaling. A pair's LLM is
another model of its family, wider, deeper and with more heads (``GROWN``, and a family's own ``llm`` settings), or,
for a mixed pair, a model of another family sharing the vocabulary. Variants (Falcon's new architecture and ALiBi,
Phi-1/2, Qwen2's sliding window, dynamic-NTK and YaRN rotary, tied embeddings, Granite's multipliers) are families
of their own. Used by ``matrix.py`` (tests/test_model_families.py and the docs table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import transformers

VOCAB, WINDOW = 416, 16
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
            bos_token_id=1, tie_word_embeddings=False)
# The LLM of a family's pair: wider, deeper, more heads (lists of one entry per layer follow the depth: builds.py).
GROWN = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=6)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MAMBA = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)
LINEAR = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
SHARED_KV = dict(head_dim=8, num_hidden_layers=4, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                 vocab_size_per_layer_input=VOCAB, layer_types=["sliding_attention", "full_attention"] * 2)


@dataclass(frozen=True)
class Family:
    """A decoder family: ``config``/``model`` are transformers class names; ``settings`` override ``BASE``.

    Args:
        label: the name the docs table shows (a transformers model type, or the variant's usual name).
        kind: what makes it differ from the dense Llama lineage ("dense", "absolute", "window", "chunked",
            "alibi", "mqa", "recurrent", "longrope", "shared-kv").
        llm: settings of the pair's LLM over ``settings`` and ``GROWN`` (where a family ties widths together).
        since: the first transformers release the matrix found it in, where that is newer than the oldest supported.
    """

    label: str
    config: str
    model: str
    kind: str = "dense"
    settings: dict = field(default_factory=dict)
    llm: dict = field(default_factory=dict)
    since: str = ""


def _f(label, config, model, kind="dense", llm=None, since="", **settings) -> Family:
    return Family(label, config + "Config", model, kind, settings, llm or {}, since)


SW = dict(sliding_window=WINDOW)
ROPE = dict(rope_theta=10000.0)
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
    _f("phi", "Phi", "PhiForCausalLM", partial_rotary_factor=0.5),  # Phi-1, 1.5, 2
    # variants: rotary scaling, tied embeddings, Granite's multipliers
    _f("llama-dynamic", "Llama", "LlamaForCausalLM", rope_parameters={"rope_type": "dynamic", "factor": 2.0, **ROPE}),
    _f("llama-yarn", "Llama", "LlamaForCausalLM", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, **ROPE}),
    _f("llama-tied", "Llama", "LlamaForCausalLM", tie_word_embeddings=True),
    _f("granite-multipliers", "Granite", "GraniteForCausalLM", embedding_multiplier=12.0, residual_multiplier=0.22,
       attention_multiplier=0.125, logits_scaling=8.0),
    # learned absolute positions
    _f("gpt2", "GPT2", "GPT2LMHeadModel", "absolute", n_inner=64, llm=dict(n_inner=96)),
    _f("opt", "OPT", "OPTForCausalLM", "absolute", word_embed_proj_dim=32, ffn_dim=64,
       llm=dict(word_embed_proj_dim=48, ffn_dim=96)),
    # sliding windows: from ``sliding_window`` alone, or per layer (``layer_types``)
    _f("mistral", "Mistral", "MistralForCausalLM", "window", **SW),
    _f("ministral", "Ministral", "MinistralForCausalLM", "window", head_dim=8,
       layer_types=["sliding_attention", "full_attention"], **SW),
    _f("starcoder2", "Starcoder2", "Starcoder2ForCausalLM", "window", **SW),
    _f("phi3-4k", "Phi3", "Phi3ForCausalLM", "window", **SW),
    _f("qwen2-window", "Qwen2", "Qwen2ForCausalLM", "window", use_sliding_window=True, max_window_layers=1, **SW),
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
       num_local_experts=2, attention_chunk_size=WINDOW, layer_types=["chunked_attention", "full_attention"],
       llm=dict(intermediate_size_mlp=96)),
    # key/value-shared layers (the static cache holds placeholders for the layers that reuse another's keys)
    _f("gemma3n", "Gemma3nText", "Gemma3nForCausalLM", "shared-kv", laurel_rank=4, altup_num_inputs=2,
       activation_sparsity_pattern=[0.0] * 4, llm=dict(activation_sparsity_pattern=[0.0] * 6, num_hidden_layers=6,
                                                      num_kv_shared_layers=2), **SHARED_KV, **SW),
    _f("gemma4", "Gemma4Text", "Gemma4ForCausalLM", "shared-kv", llm=dict(num_hidden_layers=6, num_kv_shared_layers=2),
       **SHARED_KV, **SW),
    # ALiBi, multi-query attention and Falcon's variants
    _f("bloom", "Bloom", "BloomForCausalLM", "alibi"),
    _f("falcon", "Falcon", "FalconForCausalLM", "mqa", ffn_hidden_size=64, llm=dict(ffn_hidden_size=96)),
    _f("falcon-40b", "Falcon", "FalconForCausalLM", "mqa", ffn_hidden_size=64, new_decoder_architecture=True,
       num_kv_heads=2, llm=dict(ffn_hidden_size=96)),
    _f("falcon-rw", "Falcon", "FalconForCausalLM", "alibi", ffn_hidden_size=64, alibi=True, multi_query=False,
       parallel_attn=False, bias=True, llm=dict(ffn_hidden_size=96)),
    # long-context rotary factors chosen by the sequence's length (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini)
    _f("phi3-longrope", "Phi3", "Phi3ForCausalLM", "longrope", original_max_position_embeddings=16,
       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                        "long_factor": [1.0, 2.0, 4.0, 8.0], "original_max_position_embeddings": 16}),
    # recurrent and hybrid layers: convolutions, state-space (Mamba, Mamba-2), RG-LRU, Gated DeltaNet
    _f("lfm2", "Lfm2", "Lfm2ForCausalLM", "recurrent", layer_types=["conv", "full_attention"],
       block_auto_adjust_ff_dim=False),
    _f("lfm3", "Lfm3", "Lfm3ForCausalLM", "recurrent", since="5.23", head_dim=8,
       layer_types=["conv", "full_attention"], **SW),
    _f("mamba", "Mamba", "MambaForCausalLM", "recurrent", state_size=8, expand=2, conv_kernel=4),
    _f("mamba2", "Mamba2", "Mamba2ForCausalLM", "recurrent", num_heads=4, head_dim=16, state_size=8, n_groups=1,
       chunk_size=8, llm=dict(num_heads=6)),
    _f("falcon_mamba", "FalconMamba", "FalconMambaForCausalLM", "recurrent", state_size=8),
    _f("recurrent_gemma", "RecurrentGemma", "RecurrentGemmaForCausalLM", "recurrent", lru_width=32,
       block_types=["recurrent", "attention"], attention_window_size=WINDOW, llm=dict(lru_width=48)),
    _f("granitemoehybrid", "GraniteMoeHybrid", "GraniteMoeHybridForCausalLM", "recurrent",
       layer_types=["mamba", "attention"], num_local_experts=2, mamba_n_heads=4, mamba_d_head=16,
       shared_intermediate_size=32, llm=dict(mamba_n_heads=6), **MAMBA),
    _f("zamba2", "Zamba2", "Zamba2ForCausalLM", "recurrent", layers_block_type=["mamba", "hybrid"],
       n_mamba_heads=4, chunk_size=8, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, adapter_rank=8),
    _f("falcon_h1", "FalconH1", "FalconH1ForCausalLM", "recurrent", mamba_n_heads=4, mamba_d_head=16,
       mamba_d_ssm=64, llm=dict(mamba_n_heads=6, mamba_d_ssm=96), **MAMBA),
    _f("bamba", "Bamba", "BambaForCausalLM", "recurrent", attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
       mamba_d_state=8, mamba_chunk_size=8, llm=dict(mamba_n_heads=6)),
    _f("jamba", "Jamba", "JambaForCausalLM", "recurrent", attn_layer_period=2, attn_layer_offset=1,
       expert_layer_period=2, expert_layer_offset=1, num_experts=2, use_mamba_kernels=False, mamba_d_state=8,
       mamba_dt_rank=4),
    _f("nemotron_h", "NemotronH", "NemotronHForCausalLM", "recurrent", layers_block_type=["mamba", "attention"],
       use_mamba_kernels=False, head_dim=8, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
       chunk_size=8, llm=dict(mamba_num_heads=6)),
    _f("qwen3_5", "Qwen3_5Text", "Qwen3_5ForCausalLM", "recurrent", head_dim=8, **LINEAR),
    _f("qwen3_5_moe", "Qwen3_5MoeText", "Qwen3_5MoeForCausalLM", "recurrent", head_dim=8,
       shared_expert_intermediate_size=32, **LINEAR, **EXPERTS),
    _f("qwen3_next", "Qwen3Next", "Qwen3NextForCausalLM", "recurrent", head_dim=8, shared_expert_intermediate_size=32,
       **LINEAR, **EXPERTS),
    _f("olmo_hybrid", "OlmoHybrid", "OlmoHybridForCausalLM", "recurrent", **LINEAR),
    _f("qwen4_exp", "Qwen4ExpText", "Qwen4ExpForCausalLM", "recurrent", head_dim=8, shared_expert_intermediate_size=32,
       indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
       hc_count=2, hc_lowrank=8, ngram_vocab_size_base=512, split_ngram_parts=4, **LINEAR, **EXPERTS),
)}

# Pairs: every family with its grown LLM, and SLMs of one family with an LLM of another that shares the vocabulary.
MIXED = {"qwen2+llama": ("qwen2", "llama"), "llama+mistral": ("llama", "mistral"), "gemma+gemma2": ("gemma", "gemma2"),
         "qwen3+qwen3_5": ("qwen3", "qwen3_5"), "qwen3_5+llama": ("qwen3_5", "llama"), "llama+mamba2": ("llama", "mamba2")}
PAIRS: dict[str, tuple[str, str]] = {**{name: (name, name) for name in FAMILIES}, **MIXED}


def missing(pair: str) -> str | None:
    """Why the matrix cannot run ``pair`` on this transformers release (a family it does not ship, or whose own
    ``generate``, what R2R is compared with, is wrong on it), or None."""
    from ..compat import LONG_ROPE_GENERATE_EXACT

    for family in dict.fromkeys(PAIRS[pair]):
        spec = FAMILIES[family]
        if not hasattr(transformers, spec.config):
            since = f" (the matrix found it in {spec.since})" if spec.since else ""
            return f"transformers {transformers.__version__} has no {spec.config}{since}"
        if spec.kind == "longrope" and not LONG_ROPE_GENERATE_EXACT:
            return (f"transformers {transformers.__version__}'s own generate of a long-RoPE model drops its cache "
                    "past the original context but reads only the new token (5.23 reads everything again): no "
                    "reference to compare R2R with")
    return None
