"""Quantised and dispatched LLMs: R2R must run through bitsandbytes layers and accelerate hooks."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from r2r_hf import R2RForCausalLM


GREEDY = dict(max_new_tokens=10, do_sample=False)


@pytest.mark.filterwarnings("ignore")
def test_llm_in_8bit_bitsandbytes(router_dir, batch):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes cannot be imported here")
    from transformers import BitsAndBytesConfig

    model = R2RForCausalLM.from_pretrained(
        router_dir, llm_kwargs={"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
    )
    assert type(model.llm.model.layers[0].mlp.down_proj).__name__ == "Linear8bitLt"
    assert model.router.logits_projection.weight.dtype == torch.float32
    out = model.generate(**batch, **GREEDY, threshold=0.0, return_dict_in_generate=True)
    assert out.llm_token_rate == 1.0
    assert torch.equal(out.sequences, model.llm.generate(**batch, **GREEDY))


def test_llm_offloaded_to_disk_by_device_map(router_dir, pair_dir, batch, tmp_path):
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    model = R2RForCausalLM.from_pretrained(
        router_dir, llm_kwargs={"device_map": device_map, "offload_folder": str(tmp_path)}
    )
    assert model.llm.hf_device_map["model.layers.1"] == "disk"
    assert any(hasattr(m, "_hf_hook") for m in model.llm.modules()), "accelerate hooks are in the path"
    in_memory = AutoModelForCausalLM.from_pretrained(pair_dir[1])
    out = model.generate(**batch, **GREEDY, threshold=0.0)
    assert torch.equal(out, in_memory.generate(**batch, **GREEDY))
