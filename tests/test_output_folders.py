"""Where routers and runs are written: an output folder is checked before any work (a model folder is refused unless
--overwrite, which deletes nothing), links are replaced rather than written through, a Hugging Face cache snapshot
is refused, and a full disk or a refused write (a router, a run's shard, training) is one sentence that leaves the
old files in place.

From issue 15's hostile probe (item 1) and issue 19's second review (items 8 and 9); each test failed before its fix.
"""

import json
import os
import shutil

import pytest
import torch
from conftest import QUICK_TRAIN, one_line_error

from r2r_hf.cli import main as cli_main
from r2r_hf.training import train_router


@pytest.fixture
def slm_folder(pair_dir, tmp_path):
    """A copy of the tiny SLM's folder, with a weight shard HF's save_pretrained would delete."""
    folder = tmp_path / "slm"
    shutil.copytree(pair_dir[0], folder)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a shard of someone else's model")
    return folder


# ------------------------------------------------------------------ output folders (issue 15, item 1)
def test_train_refuses_a_model_folder_before_reading_the_data(slm_folder, capsys):
    config = (slm_folder / "config.json").read_text()
    rc = cli_main(["train", "--data", "nowhere", "--out", str(slm_folder)])
    one_line_error(capsys, rc, "not empty and holds no r2r router", "--overwrite")
    assert (slm_folder / "config.json").read_text() == config
    with pytest.raises(FileExistsError, match="overwrite=True"):
        train_router("nowhere", slm_folder)


def test_train_overwrite_writes_the_router_and_deletes_nothing(slm_folder, synthetic, capsys):
    before = {p.name for p in slm_folder.iterdir()}
    assert cli_main(["--quiet", "train", "--data", str(synthetic), "--out", str(slm_folder), "--overwrite",
                     *QUICK_TRAIN]) == 0
    after = {p.name for p in slm_folder.iterdir()}
    assert before <= after and "router_metrics.json" in after
    assert json.loads((slm_folder / "config.json").read_text())["model_type"] == "r2r"


def test_train_into_an_existing_router_folder_needs_no_flag(synthetic, tmp_path, capsys):
    out = tmp_path / "router"
    for _ in range(2):
        assert cli_main(["--quiet", "train", "--data", str(synthetic), "--out", str(out), *QUICK_TRAIN]) == 0


def test_calibrate_refuses_a_folder_that_is_not_a_router_before_loading(slm_folder, capsys):
    rc = cli_main(["calibrate", "--router", str(slm_folder), "--data", "nowhere", "--recall", "0.9"])
    one_line_error(capsys, rc, "is not an r2r router folder")


def test_import_official_refuses_a_model_folder_unless_overwrite(slm_folder, tmp_path, capsys):
    from official_layout import official_checkpoint

    torch.save(official_checkpoint(pretrained="org/slm"), tmp_path / "default_router.pt")
    args = ["import-official", str(tmp_path / "default_router.pt"), "--out", str(slm_folder),
            "--slm", "org/slm", "--llm", "org/llm"]
    one_line_error(capsys, cli_main(args), "not empty and holds no r2r router")
    assert cli_main([*args, "--overwrite"]) == 0
    assert (slm_folder / "model-00001-of-00002.safetensors").exists() and (slm_folder / "tokenizer.json").exists()


# ------------------------------------------------------- links are replaced, never written through (issue 19, item 8)
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


def test_saving_over_links_replaces_them_and_leaves_their_targets(model, synthetic, tmp_path, capsys):
    folder, blobs, before = _linked_router(model, tmp_path, "linked")
    assert cli_main(["--quiet", "calibrate", "--router", str(folder), "--data", str(synthetic),
                     "--llm-rate", "0.3"]) == 0
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before  # no blob changed, none created
    assert not any(p.is_symlink() for p in folder.iterdir())
    threshold = json.loads((folder / "config.json").read_text())["threshold"]
    assert threshold != json.loads(before["config.json"])["threshold"]
    assert "router_metrics.json" in os.listdir(folder) and (folder / "README.md").read_text().strip()


def test_a_hugging_face_cache_snapshot_is_refused_as_an_output(model, synthetic, tmp_path, capsys):
    folder, blobs, before = _linked_router(model, tmp_path, "hub/models--org--router/snapshots/0123abcd")
    capsys.readouterr()  # (what saving the setup printed — a progress bar, where no earlier command turned them off)
    rc = cli_main(["calibrate", "--router", str(folder), "--data", str(synthetic), "--llm-rate", "0.3"])
    one_line_error(capsys, rc, "is a Hugging Face cache snapshot", "write the router to a folder of your own")
    with pytest.raises(ValueError, match="cache snapshot"):
        model.save_pretrained(folder / "inner")
    assert {p.name: p.read_bytes() for p in blobs.iterdir()} == before and all(p.is_symlink() for p in folder.iterdir())


# ------------------------------------------------------------------ a full disk (issue 19, item 9)
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


def test_a_real_write_failure_while_training_is_one_sentence(synthetic, tmp_path):
    """The OS refuses the write (a file size limit: the same error path as a full disk, without one)."""
    import resource
    import signal
    import subprocess
    import sys

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "router"
    result = subprocess.run([sys.executable, "-m", "r2r_hf.cli", "--quiet", "train", "--data", str(synthetic),
                             "--out", str(out), "--epochs", "1", "--hidden-dims", "64"], preexec_fn=limit_file_size,
                            capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 2 and result.stderr.startswith(f"error: Could not write {out}: no space left"), \
        result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and not out.exists()
