"""Issue #19, second hostile review: loading, saving and the command line (items 2, 3, 8, 9, 11, 13-15).

Each test failed before its fix; the labeling and training items are in ``test_reliability_3.py``.
"""

import json
import os
import shutil

import pytest
import torch
from conftest import SMALL_ROUTER
from synthetic_labels import write_synthetic_run
from test_reliability import _one_line_error

from r2r_hf import R2RConfig, R2RForCausalLM
from r2r_hf.cli import main as cli_main


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_run(root)
    return root


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
    given = R2RForCausalLM.from_pretrained(tmp_path, load_pair=False, threshold=0.3)  # an explicit one wins
    assert given.config.threshold == 0.3 and getattr(given.generation_config, "threshold", None) is None
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


def test_embeddings_as_the_positional_prompt_are_one_sentence(model, single):
    embeddings = model.slm.get_input_embeddings()(single["input_ids"])
    with pytest.raises(ValueError, match=r"takes token ids.*float32 tensor of shape \[1, 12, 64\]; prompts as emb"):
        model.generate(embeddings, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"got a int64 tensor of shape \[12\]"):
        model.generate(input_ids=single["input_ids"][0], max_new_tokens=2)


# ------------------------------------------------------------------ 11. router sizes
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
    _one_line_error(capsys, cli_main(["generate", "--router", str(broken), "x"]), message)


def test_the_parameter_count_the_bound_uses_is_the_routers():
    from r2r_hf.config import router_parameters

    for sizes in (dict(router_hidden_dims=[32, 48, 16], router_expansion=3), dict(normalize_input=True)):
        config = R2RConfig(slm_hidden_size=24, slm_embedding_size=20, num_topk_logits=7, **sizes)
        assert router_parameters(config) == sum(p.numel() for p in R2RForCausalLM(config).parameters())


# ------------------------------------------------------------------ 11, 12, 14, 15. option values
@pytest.mark.parametrize("argv, expected", [
    (["train", "--data", "d", "--out", "o", "--hidden-dims", "0"], "from 1 to 16384 (e.g. 512,512,512), got '0'"),
    (["train", "--data", "d", "--out", "o", "--hidden-dims", "64,-4"], "got '64,-4'"),
    (["train", "--data", "d", "--out", "o", "--dropout", "1"], "expected a dropout rate in [0, 1), got '1'"),
    (["train", "--data", "d", "--out", "o", "--lr", "1e10"], "expected a learning rate in (0, 1]"),
    (["train", "--data", "d", "--out", "o", "--lr", "inf"], "expected a learning rate in (0, 1]"),
    (["train", "--data", "d", "--out", "o", "--weight-decay", "inf"], "expected a finite number >= 0"),
    (["train", "--data", "d", "--out", "o", "--seed", str(2**70)], "expected a seed between 0 and 2**64 - 1"),
    (["train", "--data", "d", "--out", "o", "--device", "meta"], "'meta' holds no data"),
    (["generate", "--router", "r", "--device", "meta", "x"], "'meta' holds no data"),
    (["generate", "--router", "r", "--seed", "99999999999999999999999", "x"], "expected a seed between 0 and"),
    (["generate", "--router", "r", "--threads", "20000", "x"], "expected at most"),
    (["chat", "--router", "r", "--threads", "100000"], "per CPU of this machine's"),
    (["label", "--slm", "s", "--llm", "l", "--prompts", "p", "--out", "o", "--threads", "20000"], "expected at most"),
])
def test_option_values_out_of_range_are_refused_by_the_option(argv, expected, capsys):
    _usage_error(capsys, argv, expected)


def test_threads_up_to_the_bound_are_accepted():
    from r2r_hf.cli.main import build_parser
    from r2r_hf.cli.options import THREADS_PER_CPU

    most = THREADS_PER_CPU * os.cpu_count()
    assert build_parser().parse_args(["generate", "--router", "r", "--threads", str(most), "x"]).threads == most


@pytest.mark.parametrize("field, value, message", [
    ("lr", float("inf"), "lr must be in (0, 1]"), ("lr", 1e10, "lr must be in (0, 1]"),
    ("lr", float("nan"), "lr must be in (0, 1]"), ("weight_decay", float("inf"), "weight_decay must be a finite"),
    ("epochs", 0, "epochs must be a whole number >= 1"), ("seed", 2**70, "seed must be a whole number from 0"),
])
def test_train_settings_refuse_values_that_cannot_train(field, value, message):
    from r2r_hf.training import TrainSettings

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        TrainSettings(**{field: value})


# ------------------------------------------------------------------ 8. links are replaced, never written through
def _linked_router(model, tmp_path, layout):
    """A router whose files are symbolic links to blobs elsewhere (as in a Hugging Face cache), and a dangling
    README.md link."""
    saved, blobs, folder = tmp_path / "saved", tmp_path / "blobs", tmp_path / layout
    model.save_pretrained(saved)
    blobs.mkdir()
    folder.mkdir(parents=True)
    for path in saved.iterdir():
        if path.name != "README.md":
            shutil.copy(path, blobs / path.name)
            (folder / path.name).symlink_to(blobs / path.name)
    (folder / "README.md").symlink_to(blobs / "missing-readme")
    return folder, blobs, {p.name: p.read_bytes() for p in blobs.iterdir()}


def test_saving_over_links_replaces_them_and_leaves_their_targets(model, synthetic_run, tmp_path, capsys):
    folder, blobs, before = _linked_router(model, tmp_path, "linked")
    assert cli_main(["--quiet", "calibrate", "--router", str(folder), "--data", str(synthetic_run),
                     "--llm-rate", "0.3"]) == 0
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before  # no blob changed, none created
    assert not any(p.is_symlink() for p in folder.iterdir())
    threshold = json.loads((folder / "config.json").read_text())["threshold"]
    assert threshold != json.loads(before["config.json"])["threshold"]
    assert "router_metrics.json" in os.listdir(folder) and (folder / "README.md").read_text().strip()


def test_a_hugging_face_cache_snapshot_is_refused_as_an_output(model, synthetic_run, tmp_path, capsys):
    folder, blobs, before = _linked_router(model, tmp_path, "hub/models--org--router/snapshots/0123abcd")
    rc = cli_main(["calibrate", "--router", str(folder), "--data", str(synthetic_run), "--llm-rate", "0.3"])
    _one_line_error(capsys, rc, "is a Hugging Face cache snapshot", "write the router to a folder of your own")
    with pytest.raises(ValueError, match="cache snapshot"):
        model.save_pretrained(folder / "inner")
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before and all(p.is_symlink() for p in folder.iterdir())


# ------------------------------------------------------------------ 9. a full disk
def _full_disk(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                          'left on device" })')


def test_a_full_disk_while_saving_a_router_is_one_sentence_and_keeps_the_old_one(model, router_dir, tmp_path,
                                                                                  monkeypatch, capsys):
    import transformers.modeling_utils

    folder = tmp_path / "router"
    shutil.copytree(router_dir, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", _full_disk)
    with pytest.raises(OSError, match=r"^Could not write .*router: no space left \(the disk is full"):
        model.save_pretrained(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no staging folder left either


def test_a_full_disk_while_writing_a_shard_is_one_sentence(tmp_path, monkeypatch):
    from r2r_hf.pipeline import store

    monkeypatch.setattr(store, "save_file", _full_disk)
    with pytest.raises(OSError, match=r"^Could not write .*shard-00000.safetensors: no space left"):
        store.write_tensors(tmp_path / "shard-00000.safetensors", {"a": torch.zeros(3)}, {})
    assert os.listdir(tmp_path) == []


def test_a_real_write_failure_while_training_is_one_sentence(synthetic_run, tmp_path):
    """The OS refuses the write (a file size limit: the same error path as a full disk, without one)."""
    import resource
    import signal
    import subprocess
    import sys

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "router"
    result = subprocess.run([sys.executable, "-m", "r2r_hf.cli", "--quiet", "train", "--data", str(synthetic_run),
                             "--out", str(out), "--epochs", "1", "--hidden-dims", "64"], preexec_fn=limit_file_size,
                            capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 2 and result.stderr.startswith(f"error: Could not write {out}: no space left"), \
        result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and not out.exists()
