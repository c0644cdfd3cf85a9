"""Everything one generate call routes with travels in that call: threshold precedence, threads, streamers."""

import json

import pytest
import torch
from transformers import GenerationConfig

from r2r_hf import R2RConfig, R2RForCausalLM, RoutingAwareStreamer

from conftest import SMALL_ROUTER

GREEDY = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=2)
INF = float("inf")


def _rate(model, enc, **kwargs):
    return model.generate(**enc, **GREEDY, return_dict_in_generate=True, **kwargs).llm_token_rate


def test_threshold_on_a_generation_config_is_honoured(model, single):
    assert _rate(model, single, generation_config=GenerationConfig(threshold=0.0)) == 1.0
    assert _rate(model, single, generation_config=GenerationConfig(threshold=INF)) == 0.0


def test_threshold_precedence_call_then_config_then_model_defaults(model, single):
    stored = model.config.threshold
    try:
        model.config.threshold = 0.0
        assert _rate(model, single) == 1.0, "the router's config.threshold is the default"
        model.generation_config.threshold = INF
        assert _rate(model, single) == 0.0, "model.generation_config.threshold beats config.threshold"
        assert _rate(model, single, generation_config=GenerationConfig(threshold=0.0)) == 1.0
        assert _rate(model, single, generation_config=GenerationConfig(threshold=0.0), threshold=INF) == 0.0
    finally:
        model.config.threshold = stored
        del model.generation_config.threshold
    assert model.config.threshold == stored and not hasattr(model.generation_config, "threshold")


def test_a_bad_threshold_on_a_generation_config_is_refused(model, single):
    with pytest.raises(ValueError, match="threshold must be a number"):
        model.generate(**single, generation_config=GenerationConfig(threshold="high", max_new_tokens=2))


class _Recorder(RoutingAwareStreamer):
    def __init__(self):
        self.calls = []

    def put_routing(self, routed, scores):
        self.calls.append(("routing", routed.clone(), scores.clone()))

    def put(self, value):
        self.calls.append(("put", value.clone()))

    def end(self):
        self.calls.append(("end",))


def test_routing_aware_streamer_learns_who_wrote_each_token_before_it(model, batch):
    streamer = _Recorder()
    out = model.generate(**batch, **GREEDY, threshold=0.5, streamer=streamer, return_dict_in_generate=True)
    kinds = [c[0] for c in streamer.calls]
    steps = out.routed.shape[1]
    assert kinds == ["put"] + ["routing", "put"] * steps + ["end"]
    routed = torch.stack([c[1] for c in streamer.calls if c[0] == "routing"], dim=1)
    scores = torch.stack([c[2] for c in streamer.calls if c[0] == "routing"], dim=1)
    assert torch.equal(routed, out.routed)
    torch.testing.assert_close(scores, out.router_scores, equal_nan=True)


def test_config_written_before_the_record_existed_still_loads(model, slm, llm, tmp_path):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(threshold_recall_target=0.95, expected_llm_token_rate=0.12, license="apache-2.0",
                  calibration={"method": "lowest LLM token rate with recall >= 0.95", "recall": 0.96},
                  training={"epochs_run": 3}, evaluation={"benchmark": "x"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm)
    assert loaded.record["calibration"] == {"method": "lowest LLM token rate with recall >= 0.95", "recall": 0.96,
                                            "target": {"recall": 0.95}, "llm_token_rate": 0.12}
    assert loaded.record["training"] == {"epochs_run": 3} and loaded.record["license"] == "apache-2.0"
    assert not hasattr(loaded.config, "calibration") and "calibration" not in loaded.config.to_dict()
    loaded.save_pretrained(tmp_path / "again")
    assert "calibration" not in json.loads((tmp_path / "again" / "config.json").read_text())
    assert json.loads((tmp_path / "again" / "router_metrics.json").read_text())["license"] == "apache-2.0"
    assert "license: apache-2.0" in (tmp_path / "again" / "README.md").read_text()


def test_config_holds_only_what_defines_the_router():
    fields = set(R2RConfig(slm_hidden_size=64, **SMALL_ROUTER).to_diff_dict())
    assert not fields & {"calibration", "training", "evaluation", "license", "threshold_recall_target",
                         "expected_llm_token_rate", "legacy_record"}


def test_rows_ending_on_eos_leave_the_random_stream_where_hf_leaves_it(model, slm, single):
    # The loop learns that every row finished together with the next routing decision (one host
    # synchronisation per step); the draw it made meanwhile must not count.
    sampling = dict(max_new_tokens=12, do_sample=True, temperature=0.8, pad_token_id=0)
    torch.manual_seed(5)
    free = slm.generate(**single, **sampling, eos_token_id=10_000)
    eos = int(free[0, single["input_ids"].shape[1] + 3])
    torch.manual_seed(5)
    expected = slm.generate(**single, **sampling, eos_token_id=eos)
    after_reference = torch.rand(3)
    assert expected.shape[1] < free.shape[1], "the reference stopped on EOS"
    torch.manual_seed(5)
    got = model.generate(**single, **sampling, eos_token_id=eos, threshold=INF)
    assert torch.equal(got, expected) and torch.equal(torch.rand(3), after_reference)
