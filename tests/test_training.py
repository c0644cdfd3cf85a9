"""Router training and threshold calibration, and what they refuse: one-class data, settings that cannot train,
labels of another SLM, a corrupt summary, a loss that diverges; a recall target no threshold reaches is flagged.

The refusals come from issue 15's hostile probe (items 3 and 4) and issue 19's second review (items 4, 10-12)."""

import json
import logging

import pytest
import torch

from r2r_hf import R2RForCausalLM
from r2r_hf.training import metrics_at, threshold_for_rate, threshold_for_recall
from r2r_hf.cli import main as cli_main
from r2r_hf.pipeline import load_labels
from r2r_hf.pipeline.store import WorkDir, read_tensors, write_tensors
from r2r_hf.training import TrainSettings, auto_hidden_dims, calibrate_router, scores_on, train_router
from conftest import QUICK_TRAIN, SMALL_ROUTER, one_line_error
from synthetic_labels import write_synthetic_run


def test_threshold_for_recall_on_a_hand_built_set():
    scores = torch.tensor([0.05, 0.2, 0.35, 0.5, 0.62, 0.8, 0.9, 0.95])
    targets = torch.tensor([0, 0, 1, 0, 1, 0, 1, 1])
    # Recall >= 0.75 holds while 3 of the 4 positives (0.62, 0.9, 0.95) are routed: threshold <= 0.62.
    threshold = threshold_for_recall(scores, targets, recall=0.75)
    assert 0.5 < threshold <= 0.62
    assert threshold == pytest.approx(max(t for t in torch.linspace(0.01, 0.99, 100).tolist() if t <= 0.62))
    assert metrics_at(scores, targets, threshold)["recall"] == 0.75
    # Full recall needs the lowest positive (0.35) routed.
    assert 0.2 < threshold_for_recall(scores, targets, recall=1.0) <= 0.35


def test_threshold_for_recall_falls_back_to_the_highest_recall():
    scores, targets = torch.tensor([0.001, 0.002, 0.9]), torch.tensor([1, 1, 0])
    assert threshold_for_recall(scores, targets, recall=0.95) == pytest.approx(0.01)


def test_threshold_for_rate_on_a_hand_built_set():
    scores = torch.arange(1, 101).float() / 100  # 0.01 .. 1.00
    threshold = threshold_for_rate(scores, 0.15)
    assert threshold == pytest.approx(0.86)
    assert metrics_at(scores, torch.zeros(100), threshold)["llm_token_rate"] == pytest.approx(0.15)
    assert threshold_for_rate(scores, 0.0) == float("inf")


def test_calibration_targets_are_checked():
    with pytest.raises(ValueError, match="no divergent"):
        threshold_for_recall(torch.rand(5), torch.zeros(5))
    with pytest.raises(ValueError, match="recall"):
        threshold_for_recall(torch.rand(5), torch.ones(5), recall=1.5)


def test_auto_router_size_follows_the_data():
    assert auto_hidden_dims(50_000) == [256] * 3
    assert auto_hidden_dims(1_000_000) == [512] * 4
    assert auto_hidden_dims(10_000_000) == [1024] * 6


def test_validation_split_is_by_sample_and_deterministic(synthetic):
    data = load_labels(synthetic)
    train, val = data.split_of("train"), data.split_of("validation")
    n_all, n_train, n_val = (len(d.tensors()["label"]) for d in (data, train, val))
    assert n_train + n_val == n_all and 0 < n_val < n_all * 0.3
    def samples(d):
        return {(i, int(s)) for i in d.shards for s in d.shard(i)["sample"].unique()}

    assert not samples(train) & samples(val), "whole samples are held out, never single tokens"
    assert torch.equal(val.tensors()["hidden"], load_labels(synthetic).split_of("validation").tensors()["hidden"])
    assert (data.tensors()["label"] >= 0).all(), "excluded rows are never served"


def test_training_reaches_high_recall_and_loads(synthetic, tmp_path, slm, llm, single):
    settings = TrainSettings(epochs=30, batch_size=256, lr=2e-3, patience=5, seed=0)
    model = train_router(synthetic, tmp_path / "router", settings, recall=0.95, progress=False,
                         router_hidden_dims=[64, 64])
    calibration = model.record["calibration"]
    assert calibration["target"] == {"recall": 0.95} and 0 < calibration["llm_token_rate"] < 0.5
    metrics = json.loads((tmp_path / "router" / "router_metrics.json").read_text())
    assert metrics["all_tokens"]["at_threshold"]["recall"] >= 0.95
    assert metrics["all_tokens"]["at_threshold"]["precision"] > 0.3
    assert len(metrics["curve"]) == 100 and metrics["training_curve"][0]["epoch"] == 1
    assert metrics["training"]["label_statistics"]["divergent"]["count"] > 0
    # The saved router loads with a pair, routes at about its expected rate on its own validation data...
    loaded = R2RForCausalLM.from_pretrained(tmp_path / "router", slm=slm, llm=llm)
    val = load_labels(synthetic).split_of("validation")
    scored = scores_on(loaded.router, val)
    rate = (scored["scores"] >= loaded.config.threshold).float().mean().item()
    assert rate == pytest.approx(calibration["llm_token_rate"], abs=0.02)
    assert loaded.record["calibration"] == calibration
    # ...and generates.
    out = loaded.generate(**single, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape[1] == single["input_ids"].shape[1] + 5


def test_training_is_deterministic_with_a_seed(synthetic, tmp_path):
    settings = TrainSettings(epochs=2, batch_size=256, lr=1e-3, seed=3)
    a = train_router(synthetic, tmp_path / "a", settings, progress=False, router_hidden_dims=[32])
    b = train_router(synthetic, tmp_path / "b", settings, progress=False, router_hidden_dims=[32])
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.config.threshold == b.config.threshold


def test_cli_train_calibrate_and_baselines(synthetic, tmp_path, capsys):
    out = tmp_path / "router"
    assert cli_main(["--quiet", "train", "--data", str(synthetic), "--out", str(out), "--epochs", "3",
                     "--batch-size", "256", "--lr", "1e-3", "--hidden-dims", "32,32"]) == 0
    assert "expected LLM token rate" in capsys.readouterr().out
    assert cli_main(["calibrate", "--router", str(out), "--data", str(synthetic), "--llm-rate", "0.2"]) == 0
    record = json.loads((out / "router_metrics.json").read_text())
    assert record["calibration"]["llm_token_rate"] == pytest.approx(0.2, abs=0.01)
    assert record["calibration"]["target"] == {"llm_token_rate": 0.2}
    for kind in ("entropy", "random"):
        base = tmp_path / kind
        assert cli_main(["--quiet", "train", "--data", str(synthetic), "--out", str(base), "--router-type", kind,
                         "--llm-rate", "0.2"]) == 0
        config = json.loads((base / "config.json").read_text())
        record = json.loads((base / "router_metrics.json").read_text())
        assert config["router_type"] == kind and record["calibration"]["llm_token_rate"] == pytest.approx(0.2, abs=0.02)


@pytest.mark.parametrize("args, message", [
    (["train", "--data", "nowhere", "--out", "x"], "holds no labels"),
    (["calibrate", "--router", "nowhere", "--data", "x", "--recall", "0.9"], "router folder nowhere does not exist"),
    (["push", "nowhere", "org/name"], "router folder nowhere does not exist"),
])
def test_cli_errors_are_one_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_rejects_invalid_option_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--data", "d", "--out", "o", "--recall", "1.5"])
    assert exit_info.value.code == 2 and "between 0 and 1" in capsys.readouterr().err


# ------------------------------------------------------------------ one-class data (issue 15, item 3)
@pytest.mark.parametrize("share, counts", [(0.0, "holds 0 divergent and"), (1.0, "and 0 non-divergent tokens")])
def test_training_on_one_class_is_refused_with_the_counts(tmp_path, share, counts, capsys):
    write_synthetic_run(tmp_path / "data", samples=24, divergent_share=share)
    out = tmp_path / "router"
    rc = cli_main(["--quiet", "train", "--data", str(tmp_path / "data"), "--out", str(out), *QUICK_TRAIN])
    one_line_error(capsys, rc, counts, "training split")
    assert not out.exists()


# ------------------------------------------------------------------ unreachable recall (issue 15, item 4)
def _silent_router(tmp_path):
    """A router whose scores are all ~0: no threshold on the grid routes a single token."""
    model = R2RForCausalLM(R2RForCausalLM.config_class(slm_hidden_size=64, **SMALL_ROUTER))
    with torch.no_grad():
        model.router.backbone.output_layer[1].weight.zero_()
        model.router.backbone.output_layer[1].bias.fill_(-30.0)
    model.save_pretrained(tmp_path / "router")
    return tmp_path / "router"


def test_unreachable_recall_keeps_the_best_threshold_and_says_so(synthetic, tmp_path, capsys, caplog):
    folder = _silent_router(tmp_path)
    with caplog.at_level(logging.WARNING, logger="r2r_hf.training.train"):
        assert cli_main(["calibrate", "--router", str(folder), "--data", str(synthetic), "--recall", "0.95"]) == 0
    assert "divergent recall 0.0% (target 95.0% not reached)" in capsys.readouterr().out
    assert "No threshold on the grid reaches divergent recall 0.95" in caplog.text
    record = json.loads((folder / "router_metrics.json").read_text())["calibration"]
    assert record["target"] == {"recall": 0.95} and record["target_met"] is False and record["recall"] == 0.0
    assert "no grid threshold reaches recall 0.95" in record["method"]
    assert "(not reached)" in (folder / "README.md").read_text()


def test_a_rate_calibration_without_divergent_tokens_records_no_recall(tmp_path, capsys, caplog):
    write_synthetic_run(tmp_path / "data", samples=24, divergent_share=0.0)
    folder = _silent_router(tmp_path)
    with caplog.at_level(logging.WARNING, logger="r2r_hf.training.train"):
        assert cli_main(["calibrate", "--router", str(folder), "--data", str(tmp_path / "data"),
                         "--llm-rate", "0.2"]) == 0
    assert "divergent recall not measured (no divergent token in the calibration data)" in capsys.readouterr().out
    assert "holds no divergent token, so the router's recall cannot be measured" in caplog.text
    assert json.loads((folder / "router_metrics.json").read_text())["calibration"]["recall"] is None
    assert "recall not measured" in (folder / "README.md").read_text()


def test_reachable_targets_are_recorded_as_met(synthetic):
    router = R2RForCausalLM(R2RForCausalLM.config_class(slm_hidden_size=64, router_type="entropy"))
    val = load_labels(synthetic).split_of("validation")
    calibrate_router(router, val, llm_rate=0.2)
    assert router.record["calibration"]["target_met"] is True


# ------------------------------------------------------------------ settings that cannot train (issue 19)
@pytest.mark.parametrize("field, value, message", [
    ("lr", float("inf"), "lr must be in (0, 1]"), ("lr", 1e10, "lr must be in (0, 1]"),
    ("lr", float("nan"), "lr must be in (0, 1]"), ("weight_decay", float("inf"), "weight_decay must be a finite"),
    ("epochs", 0, "epochs must be a whole number >= 1"), ("seed", 2**70, "seed must be a whole number from 0"),
])
def test_train_settings_refuse_values_that_cannot_train(field, value, message):
    from r2r_hf.training import TrainSettings

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        TrainSettings(**{field: value})


# ---------------------------------------------------- calibrating on another SLM's labels (issue 19, item 4)
def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_calibrate_refuses_labels_of_another_slm(tmp_path, capsys):
    write_synthetic_run(tmp_path / "mine", slm="org/slm")
    router = tmp_path / "router"
    assert cli_main(["--quiet", "train", "--data", str(tmp_path / "mine"), "--out", str(router), *QUICK_TRAIN]) == 0
    before = _files(router)
    for other, kwargs, message in (
        ("other", {"slm": "org/other-slm"}, "was labelled with the SLM 'org/other-slm', but this router reads the "
                                            "SLM 'org/slm'"),
        ("wide", {"slm": "org/slm", "hidden": 32}, "(hidden 32, embedding 32, top 100 logits) are not the ones this "
                                                   "router reads (hidden 64, embedding 64, top 100)"),
    ):
        write_synthetic_run(tmp_path / other, **kwargs)
        capsys.readouterr()
        rc = cli_main(["calibrate", "--router", str(router), "--data", str(tmp_path / other), "--llm-rate", "0.2"])
        one_line_error(capsys, rc, message)
        assert _files(router) == before
    write_synthetic_run(tmp_path / "copy", slm=str(tmp_path / "models" / "slm"))  # a local copy of org/slm
    assert cli_main(["--quiet", "calibrate", "--router", str(router), "--data", str(tmp_path / "copy"),
                     "--llm-rate", "0.2"]) == 0


# ---------------------------------------------- a corrupt summary, a diverging loss (issue 19, items 10 and 12)
def test_a_summary_of_the_wrong_shape_is_refused_before_training(tmp_path, capsys):
    write_synthetic_run(tmp_path / "data")
    (tmp_path / "data" / "summary.json").write_text("{}")
    rc = cli_main(["--quiet", "train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "r"), *QUICK_TRAIN])
    one_line_error(capsys, rc, "summary.json is corrupt (its 'counts' is NoneType, not a JSON object)")
    assert not (tmp_path / "r").exists()


def test_training_that_diverges_is_one_sentence_and_writes_nothing(tmp_path, capsys):
    write_synthetic_run(tmp_path / "data")
    work = WorkDir(tmp_path / "data")
    tensors, meta = read_tensors(work.shard("features", 0))
    tensors["hidden"][0, 0] = float("inf")  # an SLM feature that overflowed (fp16, say)
    write_tensors(work.shard("features", 0), tensors, meta)
    rc = cli_main(["--quiet", "train", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "r"), *QUICK_TRAIN])
    one_line_error(capsys, rc, "Training diverged in epoch 1 (training loss nan", "lower the learning rate (--lr")
    assert not (tmp_path / "r").exists()
    assert torch.isinf(read_tensors(work.shard("features", 0))[0]["hidden"]).any()
