"""Issue #19, second hostile review: loading, saving and the command line (items 2, 3, 8, 9, 11, 13-15).

Each test failed before its fix; the labeling and training items are in ``test_reliability_3.py``.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import SMALL_ROUTER
from r2r_hf import R2RConfig, R2RForCausalLM
from r2r_hf.cli import main as cli_main
from test_reliability import _one_line_error


def _usage_error(capsys, argv, *expected):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


# ------------------------------------------------------------------ 2. the router's generation entries
def test_a_threshold_in_the_generation_config_survives_save_and_reload(model, slm, llm, single, tmp_path):
    saved = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    saved.load_state_dict(model.state_dict())
    saved.generation_config.threshold = float("inf")  # never route: exactly slm.generate
    saved.save_pretrained(tmp_path)
    for reloaded in (R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm),
                     R2RForCausalLM.from_pretrained(tmp_path, load_pair=False)):
        assert reloaded.generation_config.threshold == float("inf")
    assert reloaded.config.threshold == 0.5
    reloaded.set_models(slm, llm)  # the rest is the LLM's (EOS, pad); the router's entry stays
    assert reloaded.generation_config.threshold == float("inf")
    assert reloaded.generation_config.eos_token_id == llm.generation_config.eos_token_id
    out = reloaded.generate(**single, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert not out.routed.any()
    assert torch.equal(out.sequences, slm.generate(**single, max_new_tokens=6, do_sample=False, pad_token_id=0))


# ------------------------------------------------------------------ 3. a baseline config beside trained weights
@pytest.mark.parametrize("router_type", ["entropy", "random"])
def test_a_baseline_config_beside_trained_weights_is_refused(model, tmp_path, router_type, capsys):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "router_type": router_type}))
    with pytest.raises(ValueError, match=f"holds weights .model.safetensors. but its config.json says router_type "
                                         f"'{router_type}'"):
        R2RForCausalLM.from_pretrained(tmp_path, load_pair=False)
    capsys.readouterr()
    _one_line_error(capsys, cli_main(["generate", "--router", str(tmp_path), "x"]), "the same save")
    os.remove(tmp_path / "model.safetensors")  # a baseline as train writes it: no weights
    assert R2RForCausalLM.from_pretrained(tmp_path, load_pair=False).config.router_type == router_type


# ------------------------------------------------------------------ 13, 15. what --router may name
def test_a_router_file_that_is_not_a_pt_router_is_one_sentence(router_dir, capsys):
    with pytest.raises(ValueError, match="config.json is a file, not a router; pass the router's folder"):
        R2RForCausalLM.from_pretrained(router_dir / "config.json", load_pair=False)
    _one_line_error(capsys, cli_main(["generate", "--router", str(router_dir / "config.json"), "x"]),
                    "is a file, not a router")


def test_a_plain_model_folder_as_router_says_it_is_not_a_router(pair_dir, capsys):
    with pytest.raises(ValueError, match="is not an r2r router: its config.json describes a 'qwen2' model"):
        R2RForCausalLM.from_pretrained(pair_dir[0], load_pair=False)
    _one_line_error(capsys, cli_main(["generate", "--router", pair_dir[0], "x"]), "--slm / --llm")
