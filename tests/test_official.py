"""The published routers: official .pt files convert one to one and route exactly as the official forward."""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from hub_fakes import folder_to_cache, write_to_cache
from official_layout import official_checkpoint, official_scores
from r2r_hf import R2RForCausalLM
from r2r_hf.cli import main as cli_main
from r2r_hf.model.official import PUBLISHED_ROUTERS, find_official_file

R1_SLM, R1_LLM = PUBLISHED_ROUTERS[("nics-efc/R2R_router", None)]


def _save(tmp_path, name="default_router.pt", **kwargs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("pretrained", "org/slm")
    checkpoint = official_checkpoint(**kwargs)
    torch.save(checkpoint, tmp_path / name)
    return checkpoint, tmp_path / name


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("batch", [1, 5])
def test_converted_router_scores_equal_the_official_forward(tmp_path, normalize, batch):
    checkpoint, path = _save(tmp_path, normalize=normalize, dims=(32, 32, 16))
    model = R2RForCausalLM.from_official(path, slm="org/slm", llm="org/llm")
    assert model.config.router_hidden_dims == [32, 32, 16] and model.config.normalize_input == normalize
    g = torch.Generator().manual_seed(batch)
    logits = torch.randn(batch, 100, generator=g).sort(descending=True).values * 5
    emb, hidden = torch.randn(batch, 64, generator=g), torch.randn(batch, 64, generator=g)
    expected = official_scores(checkpoint["state_dict"], logits, emb, hidden, normalize)
    torch.testing.assert_close(model.router.scores(logits, emb, hidden), expected, rtol=1e-5, atol=1e-6)


def test_threshold_comes_from_the_checkpoint_and_calls_can_override(tmp_path, slm, llm, single):
    _, path = _save(tmp_path, threshold=0.37)
    model = R2RForCausalLM.from_pretrained(path, slm=slm, llm=llm)
    assert model.config.threshold == pytest.approx(0.37)
    out = model.generate(**single, max_new_tokens=6, do_sample=False, threshold=0.0, return_dict_in_generate=True)
    assert out.llm_token_rate == 1.0 and model.config.threshold == pytest.approx(0.37)


def test_missing_threshold_falls_back_to_half_with_a_warning(tmp_path, caplog):
    _, path = _save(tmp_path, threshold=None)
    with caplog.at_level(logging.WARNING, logger="r2r_hf.model.official"):
        model = R2RForCausalLM.from_official(path, slm="org/slm", llm="org/llm")
    assert model.config.threshold == 0.5 and "no calibrated threshold" in caplog.text


def test_file_choice_follows_the_official_loader(tmp_path):
    for name in ("zz.pt", "router.pt", "default_router_sampling.pt"):
        (tmp_path / name).write_bytes(b"")
    assert find_official_file(tmp_path).endswith("/router.pt")
    other = tmp_path / "other"
    other.mkdir()
    for name in ("b_all.pt", "b.pt", "c.pt"):
        (other / name).write_bytes(b"")
    assert find_official_file(other).endswith("/b.pt")
    (other / "config.json").write_text('{"model_type": "r2r"}')
    assert find_official_file(other) is None, "a folder in our format is not an official router"


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch r2r_pwned_marker",))


def test_unsafe_pickle_is_refused_and_never_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint = official_checkpoint(pretrained="org/slm")
    checkpoint["model_specific_args"] = {"payload": _Evil()}
    torch.save(checkpoint, tmp_path / "default_router.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        R2RForCausalLM.from_official(tmp_path, slm="org/slm", llm="org/llm")
    assert not (tmp_path / "r2r_pwned_marker").exists()


def test_unknown_location_without_pair_lists_what_to_pass(tmp_path):
    _save(tmp_path)
    with pytest.raises(ValueError, match=r"pass slm=.*llm=.*nics-efc/R2R_router"):
        R2RForCausalLM.from_official(tmp_path)


def test_pretrained_model_name_must_agree_with_the_slm(tmp_path):
    _save(tmp_path, pretrained="Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="Qwen/Qwen3-0.6B.*org/other"):
        R2RForCausalLM.from_official(tmp_path, slm="org/other", llm="org/llm")


def test_hidden_size_mismatch_names_both_sizes(tmp_path, slm, llm):
    _save(tmp_path, hidden=96, embed=96)
    with pytest.raises(ValueError, match=r"size 96.*hidden size 64"):
        R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm)


def test_position_embedding_routers_are_refused(tmp_path):
    checkpoint = official_checkpoint(pretrained="org/slm")
    checkpoint["init_args"]["use_position_embedding"] = True
    torch.save(checkpoint, tmp_path / "router.pt")
    with pytest.raises(ValueError, match="use_position_embedding"):
        R2RForCausalLM.from_official(tmp_path, slm="org/slm", llm="org/llm")


def test_import_official_cli_writes_a_loadable_router(tmp_path, slm, llm, single):
    checkpoint, path = _save(tmp_path / "src")
    out = tmp_path / "converted"
    assert cli_main(["import-official", str(path), "--out", str(out), "--slm", "org/slm", "--llm", "org/llm"]) == 0
    assert {"config.json", "model.safetensors", "README.md"} <= set(os.listdir(out))
    assert "official R2R checkpoint" in (out / "README.md").read_text()
    model = R2RForCausalLM.from_pretrained(out, slm=slm, llm=llm)
    direct = R2RForCausalLM.from_pretrained(path, slm=slm, llm=llm)
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    a, b = model.generate(**single, **kwargs), direct.generate(**single, **kwargs)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.router_scores, b.router_scores)


def test_import_official_cli_error_is_one_line(tmp_path, capsys):
    assert cli_main(["import-official", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No official R2R router file") and err.count("\n") == 1


def test_published_locations_load_offline_through_the_hub_cache(tmp_path, pair_dir):
    cache = tmp_path / "hub"
    _, r1 = _save(tmp_path / "r1", threshold=0.41, pretrained=R1_SLM)
    write_to_cache(cache, "nics-efc/R2R_router", {"default_router.pt": str(r1), "README.md": str(r1)})
    _, q3 = _save(tmp_path / "q3", name="router_v2.pt", pretrained="Qwen/Qwen3-0.6B", threshold=0.2)
    torch.save(official_checkpoint(pretrained="Qwen/Qwen3-0.6B"), tmp_path / "q3" / "router_v2_all.pt")
    write_to_cache(cache, "nics-efc/R2R_router_collections", {
        "Qwen3-0.6B+Qwen3-8B/router_v2.pt": str(q3),
        "Qwen3-0.6B+Qwen3-8B/router_v2_all.pt": str(tmp_path / "q3" / "router_v2_all.pt"),
    })
    for repo, folder in ((R1_SLM, pair_dir[0]), (R1_LLM, pair_dir[1]),
                         ("Qwen/Qwen3-0.6B", pair_dir[0]), ("Qwen/Qwen3-8B", pair_dir[1])):
        folder_to_cache(cache, repo, folder)
    script = textwrap.dedent(
        """
        import json, torch
        from r2r_hf import R2RForCausalLM
        for args in (("nics-efc/R2R_router",), ("nics-efc/R2R_router_collections",)):
            kwargs = {"subfolder": "Qwen3-0.6B+Qwen3-8B"} if "collections" in args[0] else {}
            model = R2RForCausalLM.from_pretrained(*args, **kwargs)
            out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False,
                                 return_dict_in_generate=True)
            print(json.dumps([model.config.slm_name_or_path, model.config.llm_name_or_path,
                              round(model.config.threshold, 4), out.sequences.shape[1]]))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[")]
    assert rows == [[R1_SLM, R1_LLM, 0.41, 8], ["Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B", 0.2, 8]]


def test_an_official_config_string_is_split_into_repo_folder_and_file(tmp_path, slm, llm, monkeypatch, capsys):
    """The official configs name a router as "org/repo/folder/file.pt"; from_pretrained and the CLI split it."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    _, chosen = _save(tmp_path / "a", pretrained="Qwen/Qwen3-0.6B", threshold=0.3)
    _, other = _save(tmp_path / "b", pretrained="Qwen/Qwen3-0.6B", threshold=0.7)
    write_to_cache(cache, "nics-efc/R2R_router_collections", {
        "Qwen3-0.6B+Qwen3-32B/default_router.pt": str(chosen), "Qwen3-0.6B+Qwen3-32B/router.pt": str(other)})
    name = "nics-efc/R2R_router_collections/Qwen3-0.6B+Qwen3-32B/router.pt"
    model = R2RForCausalLM.from_pretrained(name, slm=slm, llm=llm, cache_dir=str(cache))
    assert model.config.threshold == pytest.approx(0.7), "the named file, not the loader's first choice"
    assert model.record["calibration"]["source"] == name
    router = R2RForCausalLM.from_official(name.replace("router.pt", "default_router.pt"), cache_dir=str(cache))
    assert (router.config.slm_name_or_path, router.config.llm_name_or_path) == ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-32B")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert cli_main(["import-official", name, "--out", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["llm_name_or_path"] == "Qwen/Qwen3-32B" and config["threshold"] == pytest.approx(0.7)
    assert cli_main(["import-official", name.replace("router.pt", "gone.pt"), "--out", str(tmp_path / "o2")]) == 2
    assert "gone.pt does not exist" in capsys.readouterr().err


def test_a_config_json_that_is_not_ours_beside_a_pt_is_an_official_router(tmp_path):
    cache = tmp_path / "hub"
    _, path = _save(tmp_path / "src")
    foreign = tmp_path / "config.json"
    foreign.write_text('{"model_type": "qwen2"}')
    write_to_cache(cache, "org/mixed", {"config.json": str(foreign), "default_router.pt": str(path)})
    model = R2RForCausalLM.from_official("org/mixed", slm="org/slm", llm="org/llm", cache_dir=str(cache))
    assert model.config.threshold == pytest.approx(0.37)
    shutil.copy(foreign, tmp_path / "src" / "config.json")
    assert find_official_file(tmp_path / "src") == str(path), "a local folder is decided the same way"


def test_import_official_errors_are_one_line(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    checkpoint = official_checkpoint(pretrained="org/slm")
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("backbone.")}
    torch.save(checkpoint, tmp_path / "headless.pt")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for source, message in ((str(tmp_path / "headless.pt"), "holds no backbone.blocks.* tensors"),
                            ("org/never-downloaded", "not in the local Hugging Face cache")):
        rc = cli_main(["import-official", source, "--out", str(tmp_path / "out"), "--slm", "org/slm", "--llm", "o/l"])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
