"""Only the router is saved; loading finds the SLM and LLM by name, locally or through the Hub cache, and reads the
router's folder strictly: weights that disagree with the config, a damaged file, a config of the wrong types or sizes,
a file or a plain model folder as the router are each refused in one sentence, from Python and the command line.

The refusals come from issue 15's hostile probe (items 2 and 8) and issue 19's second review (items 2, 3, 11, 13, 15).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hub_fakes import fake_hub, folder_to_cache
from r2r_hf import R2RConfig, R2RForCausalLM
from r2r_hf.cli import main as cli_main

from conftest import SMALL_ROUTER, one_line_error

GREEDY = dict(max_new_tokens=8, do_sample=False)


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_only_the_router_is_saved(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]
    assert all(key.startswith("router.") for key in model.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "r2r" and config["architectures"] == ["R2RForCausalLM"]
    size = (tmp_path / "model.safetensors").stat().st_size
    assert size < 200_000, "base model weights must not be in the router checkpoint"


def test_save_load_round_trip_is_exact(model, slm, llm, single, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm)
    assert _same_weights(model, loaded)
    assert loaded.config.to_diff_dict() == model.config.to_diff_dict()
    assert not loaded.training
    threshold = 0.5
    assert torch.equal(
        loaded.generate(**single, **GREEDY, threshold=threshold), model.generate(**single, **GREEDY, threshold=threshold)
    )


def test_from_pretrained_loads_the_pair_named_in_the_config(pair_dir, tok, tmp_path):
    slm_dir, llm_dir = pair_dir
    slm = AutoModelForCausalLM.from_pretrained(slm_dir)
    llm = AutoModelForCausalLM.from_pretrained(llm_dir)
    fresh = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    assert fresh.config.slm_name_or_path == slm_dir and fresh.config.llm_name_or_path == llm_dir
    fresh.save_pretrained(tmp_path)
    for loaded in (R2RForCausalLM.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert isinstance(loaded, R2RForCausalLM) and _same_weights(fresh, loaded)
        enc = tok(["the old man"], return_tensors="pt")
        assert torch.equal(loaded.generate(**enc, **GREEDY), fresh.generate(**enc, **GREEDY))


def test_config_kwargs_override_at_load(model, slm, llm, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm, threshold=0.123)
    assert loaded.config.threshold == 0.123


def test_top_level_dtype_applies_to_both_models_not_the_router(pair_dir, slm, llm, tmp_path):
    model = R2RForCausalLM.from_models(
        slm, llm, slm_name_or_path=pair_dir[0], llm_name_or_path=pair_dir[1], **SMALL_ROUTER
    )
    model.save_pretrained(tmp_path)
    loaded = R2RForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.slm.dtype == torch.bfloat16 and loaded.llm.dtype == torch.bfloat16
    assert loaded.dtype == torch.float32


def test_baseline_routers_round_trip_without_weights(slm, llm, tmp_path):
    for kind in ("entropy", "random"):
        model = R2RForCausalLM.from_models(slm, llm, router_type=kind, threshold=0.6)
        model.save_pretrained(tmp_path / kind)
        loaded = R2RForCausalLM.from_pretrained(tmp_path / kind, slm=slm, llm=llm)
        assert loaded.config.router_type == kind and type(loaded.router) is type(model.router)


def test_push_to_hub_then_offline_from_pretrained_in_fresh_process(pair_dir, slm, llm, tmp_path):
    cache = tmp_path / "hub"
    folder_to_cache(cache, "org/tiny-slm", pair_dir[0])
    folder_to_cache(cache, "org/tiny-llm", pair_dir[1])
    model = R2RForCausalLM.from_models(
        slm, llm, slm_name_or_path="org/tiny-slm", llm_name_or_path="org/tiny-llm", threshold=0.5, **SMALL_ROUTER
    )
    with fake_hub(cache) as uploaded:
        model.push_to_hub("org/r2r-router")
    assert {"README.md", "config.json", "model.safetensors"} <= set(uploaded)
    expected = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False).tolist()
    script = textwrap.dedent(
        """
        import json, torch, r2r_hf
        from transformers import AutoModelForCausalLM
        for load in (r2r_hf.R2RForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
            model = load("org/r2r-router")
            out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False)
            print(json.dumps([type(model).__name__, model.config.slm_name_or_path, out.tolist()]))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")]
    assert lines == [["R2RForCausalLM", "org/tiny-slm", expected]] * 2


def test_config_refuses_generation_parameter_names():
    config = R2RConfig(slm_hidden_size=64)
    assert not any(hasattr(config, name) for name in ("top_k", "temperature", "top_p", "max_length", "do_sample"))


def test_model_card_is_written_and_a_users_readme_is_kept(model, tmp_path):
    model.save_pretrained(tmp_path, repo_id="org/my-router")
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: r2r_hf") and 'from_pretrained("org/my-router")' in card
    assert "arXiv:2505.21600" in card and f"{model.config.threshold:.4g}" in card
    (tmp_path / "README.md").write_text("my own notes")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own notes"


def test_cli_push_uploads_the_folder_as_is(model, tmp_path):
    from r2r_hf.cli import main as cli_main

    folder = tmp_path / "router"
    model.save_pretrained(folder)
    (folder / "router_metrics.json").write_text("{}")
    cache = tmp_path / "hub"
    with fake_hub(cache) as uploaded:
        assert cli_main(["push", str(folder), "org/pushed-router"]) == 0
    assert set(uploaded) == {"README.md", "config.json", "generation_config.json", "model.safetensors",
                             "router_metrics.json"}
    not_a_router = tmp_path / "plain"
    not_a_router.mkdir()
    (not_a_router / "config.json").write_text('{"model_type": "llama"}')
    with fake_hub(cache):
        assert cli_main(["push", str(not_a_router), "org/x"]) == 2

# ------------------------------------------- what a router folder holds is checked at load (issue 15, items 2, 8)
@pytest.mark.parametrize("what, edit_state, edit_config, named", [
    ("a missing tensor", lambda s: s.pop("router.logits_projection.bias"), None, "missing router.logits_projection.bias"),
    ("an extra tensor", lambda s: s.__setitem__("router.extra.weight", torch.zeros(2)), None,
     "unexpected router.extra.weight"),
    ("another shape", lambda s: s.__setitem__("router.logits_projection.bias", torch.zeros(3)), None,
     "router.logits_projection.bias ([3] in the weights, [64] in the config)"),
    ("an extra block in the config", None, lambda c: c["router_hidden_dims"].append(32),
     "missing router.backbone.blocks.2."),
    ("normalize_input flipped", None, lambda c: c.__setitem__("normalize_input", True),
     "missing router.layer_norm_hidden_states.bias"),
])
def test_a_router_whose_weights_disagree_with_its_config_is_refused(model, tmp_path, what, edit_state, edit_config,
                                                                    named):
    model.save_pretrained(tmp_path)
    if edit_state:
        state = load_file(tmp_path / "model.safetensors")
        edit_state(state)
        save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        config = json.loads((tmp_path / "config.json").read_text())
        edit_config(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match the router its config describes") as info:
        R2RForCausalLM.from_pretrained(tmp_path, load_pair=False)
    assert named in str(info.value), what


def test_a_missing_router_folder_is_one_sentence(capsys):
    with pytest.raises(OSError, match=r"^The router folder /does/not/exist does not exist; pass an existing folder"):
        R2RForCausalLM.from_pretrained("/does/not/exist")
    one_line_error(capsys, cli_main(["generate", "--router", "/does/not/exist", "x"]), "does not exist")


def test_a_truncated_weights_file_is_one_sentence(router_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(router_dir, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="model.safetensors cannot be read"):
        R2RForCausalLM.from_pretrained(broken, load_pair=False)
    one_line_error(capsys, cli_main(["--quiet", "generate", "--router", str(broken), "x"]),
                   "damaged or incomplete")


def test_a_string_size_in_the_config_is_one_line(router_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(router_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["slm_hidden_size"] = "64"
    (broken / "config.json").write_text(json.dumps(config))
    one_line_error(capsys, cli_main(["generate", "--router", str(broken), "x"]),
                   "slm_hidden_size must be an integer, got '64'", "without quotes")


# ------------------------------- the router's own entries, and what --router may name (issue 19, items 2, 3, 13, 15)
def test_a_threshold_in_the_generation_config_survives_save_and_reload(model, slm, llm, single, tmp_path):
    saved = R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)
    saved.load_state_dict(model.state_dict())
    saved.generation_config.threshold = float("inf")  # never route: exactly slm.generate
    saved.save_pretrained(tmp_path)
    for reloaded in (R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm),
                     R2RForCausalLM.from_pretrained(tmp_path, load_pair=False)):
        assert reloaded.generation_config.threshold == float("inf")
    assert reloaded.config.threshold == 0.5
    given = R2RForCausalLM.from_pretrained(tmp_path, load_pair=False, threshold=0.3)  # an explicit one wins
    assert given.config.threshold == 0.3 and getattr(given.generation_config, "threshold", None) is None
    reloaded.set_models(slm, llm)  # the rest is the LLM's (EOS, pad); the router's entry stays
    assert reloaded.generation_config.threshold == float("inf")
    assert reloaded.generation_config.eos_token_id == llm.generation_config.eos_token_id
    out = reloaded.generate(**single, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert not out.routed.any()
    assert torch.equal(out.sequences, slm.generate(**single, max_new_tokens=6, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("router_type", ["entropy", "random"])
def test_a_baseline_config_beside_trained_weights_is_refused(model, tmp_path, router_type, capsys):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "router_type": router_type}))
    with pytest.raises(ValueError, match=f"holds weights .model.safetensors. but its config.json says router_type "
                                         f"'{router_type}'"):
        R2RForCausalLM.from_pretrained(tmp_path, load_pair=False)
    capsys.readouterr()
    one_line_error(capsys, cli_main(["generate", "--router", str(tmp_path), "x"]), "the same save")
    os.remove(tmp_path / "model.safetensors")  # a baseline as train writes it: no weights
    assert R2RForCausalLM.from_pretrained(tmp_path, load_pair=False).config.router_type == router_type


def test_a_router_file_that_is_not_a_pt_router_is_one_sentence(router_dir, capsys):
    with pytest.raises(ValueError, match="config.json is a file, not a router; pass the router's folder"):
        R2RForCausalLM.from_pretrained(router_dir / "config.json", load_pair=False)
    one_line_error(capsys, cli_main(["generate", "--router", str(router_dir / "config.json"), "x"]),
                   "is a file, not a router")


def test_a_plain_model_folder_as_router_says_it_is_not_a_router(pair_dir, capsys):
    with pytest.raises(ValueError, match="is not an r2r router: its config.json describes a 'qwen2' model"):
        R2RForCausalLM.from_pretrained(pair_dir[0], load_pair=False)
    one_line_error(capsys, cli_main(["generate", "--router", pair_dir[0], "x"]), "--slm / --llm")


# ------------------------------------------------------------------ router sizes (issue 19, item 11)
@pytest.mark.parametrize("field, value, message", [
    ("router_hidden_dims", [0], "router_hidden_dims must be widths from 1 to 16384, got [0]"),
    ("router_hidden_dims", [-4], "router_hidden_dims must be widths from 1 to 16384, got [-4]"),
    ("router_hidden_dims", [10**6], "router_hidden_dims must be widths from 1 to 16384, got [1000000]"),
    ("slm_hidden_size", -64, "slm_hidden_size must be at least 1, got -64"),
    ("slm_embedding_size", 0, "slm_embedding_size must be at least 1, got 0"),
    ("router_expansion", 0, "router_expansion must be at least 1, got 0"),
    ("router_dropout", 1.5, "router_dropout must be a number in [0, 1), got 1.5"),
    ("slm_hidden_size", 10**7, "describe a router of 1,650,011,745 parameters"),
    ("router_hidden_dims", [16384] * 4, "more than the 1,000,000,000 r2r_hf accepts"),
    ("random_seed", 2**70, "random_seed must be between 0 and 2**64 - 1"),
])
def test_router_sizes_are_range_checked_in_config_json(router_dir, tmp_path, field, value, message, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(router_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError) as info:
        R2RForCausalLM.from_pretrained(broken, load_pair=False)
    assert message in str(info.value)
    one_line_error(capsys, cli_main(["generate", "--router", str(broken), "x"]), message)


def test_the_parameter_count_the_bound_uses_is_the_routers():
    from r2r_hf.config import router_parameters

    for sizes in (dict(router_hidden_dims=[32, 48, 16], router_expansion=3), dict(normalize_input=True)):
        config = R2RConfig(slm_hidden_size=24, slm_embedding_size=20, num_topk_logits=7, **sizes)
        assert router_parameters(config) == sum(p.numel() for p in R2RForCausalLM(config).parameters())
