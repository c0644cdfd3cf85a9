"""Router training and threshold calibration."""

import json

import pytest
import torch

from r2r_hf import R2RForCausalLM
from r2r_hf.training import metrics_at, threshold_for_rate, threshold_for_recall
from r2r_hf.cli import main as cli_main
from r2r_hf.pipeline import load_labels
from r2r_hf.training import TrainSettings, auto_hidden_dims, scores_on, train_router
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


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_run(root)
    return root


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
