"""Only the router is saved; loading finds the SLM and LLM by name, locally or through the Hub cache."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers import AutoModelForCausalLM

from hub_fakes import fake_hub, folder_to_cache
from r2r_hf import R2RConfig, R2RForCausalLM

from conftest import SMALL_ROUTER

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
