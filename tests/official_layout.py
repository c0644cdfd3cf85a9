"""Build router files in the official R2R layout, and compute their forward independently.

The layout follows the published description (keys, state-dict names and shapes, the
concatenation order [hidden, token embedding, projected logits]); nothing here uses r2r_hf.
"""

import torch
import torch.nn.functional as F


def official_state_dict(hidden, embed, topk, dims, expansion, normalize=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "logits_projection.weight": t(hidden, topk, scale=0.05),
        "logits_projection.bias": t(hidden),
        "combined_projection.weight": t(dims[0], 2 * hidden + embed, scale=0.05),
        "combined_projection.bias": t(dims[0]),
        "backbone.input_projection.weight": t(dims[0], dims[0], scale=0.1),
        "backbone.input_projection.bias": t(dims[0]),
        "token_embeddings.weight": t(400, embed),  # the SLM's table: present in *_all.pt files, dropped on import
    }
    widths = list(dims) + [dims[-1]]
    for i in range(len(dims)):
        d_in, d_out = widths[i], widths[i + 1]
        sd[f"backbone.blocks.{i}.layer_norm.weight"] = 1 + t(d_in)
        sd[f"backbone.blocks.{i}.layer_norm.bias"] = t(d_in)
        sd[f"backbone.blocks.{i}.mlp.0.weight"] = t(expansion * d_in, d_in, scale=0.1)
        sd[f"backbone.blocks.{i}.mlp.0.bias"] = t(expansion * d_in)
        sd[f"backbone.blocks.{i}.mlp.3.weight"] = t(d_out, expansion * d_in, scale=0.1)
        sd[f"backbone.blocks.{i}.mlp.3.bias"] = t(d_out)
        if d_in != d_out:
            sd[f"backbone.blocks.{i}.dim_change.weight"] = t(d_out, d_in, scale=0.1)
            sd[f"backbone.blocks.{i}.dim_change.bias"] = t(d_out)
    sd["backbone.output_layer.0.weight"] = 1 + t(widths[-1])
    sd["backbone.output_layer.0.bias"] = t(widths[-1])
    sd["backbone.output_layer.1.weight"] = t(1, widths[-1], scale=0.3)
    sd["backbone.output_layer.1.bias"] = t(1)
    if normalize:
        sd["layer_norm_hidden_states.weight"] = 1 + t(hidden)
        sd["layer_norm_hidden_states.bias"] = t(hidden)
        sd["layer_norm_token.weight"] = 1 + t(embed)
        sd["layer_norm_token.bias"] = t(embed)
    return sd


def official_checkpoint(hidden=64, embed=64, topk=100, dims=(32, 32), expansion=4, threshold=0.37,
                        normalize=False, pretrained="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", seed=0):
    return {
        "model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
        "init_args": {
            "hidden_states_size": hidden, "logits_size": topk, "hidden_dims": list(dims),
            "expansion_factor": expansion, "dropout_rate": 0.1, "use_position_embedding": False,
            "max_position_embeddings": 32768, "normalize_input": normalize, "freeze_lm_head": True,
            "pretrained_model_name": pretrained,
        },
        "common_args": {"threshold": threshold, "input_type": ["hidden_states", "token", "logits"]},
        "model_specific_args": {},
        "state_dict": official_state_dict(hidden, embed, topk, list(dims), expansion, normalize, seed),
    }


def official_scores(sd, logits, token_embedding, hidden, normalize=False):
    """sigmoid(router logit), written from the layout description with plain tensor ops."""
    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps=1e-5)

    def lin(x, name):
        return x @ sd[name + ".weight"].T + sd[name + ".bias"]

    if normalize:
        hidden = ln(hidden, "layer_norm_hidden_states")
        token_embedding = ln(token_embedding, "layer_norm_token")
        logits = logits.softmax(-1)
    x = torch.cat([hidden, token_embedding, lin(logits, "logits_projection")], dim=-1)
    x = lin(lin(x, "combined_projection"), "backbone.input_projection")
    i = 0
    while f"backbone.blocks.{i}.layer_norm.weight" in sd:
        p = f"backbone.blocks.{i}"
        update = lin(F.gelu(lin(ln(x, p + ".layer_norm"), p + ".mlp.0")), p + ".mlp.3")
        x = (lin(x, p + ".dim_change") if p + ".dim_change.weight" in sd else x) + update
        i += 1
    return torch.sigmoid(lin(ln(x, "backbone.output_layer.0"), "backbone.output_layer.1")).squeeze(-1)
