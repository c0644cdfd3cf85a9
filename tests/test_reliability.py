"""Issue #15: what a hostile probe with tiny random models found, each fixed and pinned here.

Output folders are checked before the work, router weights load strictly, one-class data and
unreachable targets are refused or flagged, the LogitsProcessor starts fresh records per call,
and every bad input gets one sentence instead of a traceback.
"""

import json
import logging
import shutil
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import SMALL_ROUTER
from r2r_hf import R2RForCausalLM, R2RLogitsProcessor
from r2r_hf.cli import main as cli_main
from r2r_hf.pipeline import load_labels
from r2r_hf.testing import make_tiny_llm, make_tiny_slm, make_tokenizer
from r2r_hf.training import calibrate_router, train_router
from synthetic_labels import write_synthetic_run

QUICK_TRAIN = ["--epochs", "1", "--batch-size", "256", "--hidden-dims", "32"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_run(root)
    return root


@pytest.fixture
def slm_folder(pair_dir, tmp_path):
    """A copy of the tiny SLM's folder, with a weight shard HF's save_pretrained would delete."""
    folder = tmp_path / "slm"
    shutil.copytree(pair_dir[0], folder)
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a shard of someone else's model")
    return folder


def _one_line_error(capsys, rc, *expected):
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err
    return err


# ------------------------------------------------------------------ 1. output folders
def test_train_refuses_a_model_folder_before_reading_the_data(slm_folder, capsys):
    config = (slm_folder / "config.json").read_text()
    rc = cli_main(["train", "--data", "nowhere", "--out", str(slm_folder)])
    _one_line_error(capsys, rc, "not empty and holds no r2r router", "--overwrite")
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
    _one_line_error(capsys, rc, "is not an r2r router folder")


def test_import_official_refuses_a_model_folder_unless_overwrite(slm_folder, tmp_path, capsys):
    from official_layout import official_checkpoint

    torch.save(official_checkpoint(pretrained="org/slm"), tmp_path / "default_router.pt")
    args = ["import-official", str(tmp_path / "default_router.pt"), "--out", str(slm_folder),
            "--slm", "org/slm", "--llm", "org/llm"]
    _one_line_error(capsys, cli_main(args), "not empty and holds no r2r router")
    assert cli_main([*args, "--overwrite"]) == 0
    assert (slm_folder / "model-00001-of-00002.safetensors").exists() and (slm_folder / "tokenizer.json").exists()


# ------------------------------------------------------------------ 2. strict loading
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


# ------------------------------------------------------------------ 3. one-class data
@pytest.mark.parametrize("share, counts", [(0.0, "holds 0 divergent and"), (1.0, "and 0 non-divergent tokens")])
def test_training_on_one_class_is_refused_with_the_counts(tmp_path, share, counts, capsys):
    write_synthetic_run(tmp_path / "data", samples=24, divergent_share=share)
    out = tmp_path / "router"
    rc = cli_main(["--quiet", "train", "--data", str(tmp_path / "data"), "--out", str(out), *QUICK_TRAIN])
    _one_line_error(capsys, rc, counts, "training split")
    assert not out.exists()


# ------------------------------------------------------------------ 4. unreachable recall
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


# ------------------------------------------------------------------ 5. the LogitsProcessor
GREEDY = {"do_sample": False, "pad_token_id": 0, "eos_token_id": 2}


def test_processor_refuses_a_nan_threshold(model, llm):
    with pytest.raises(ValueError, match="threshold must be a number"):
        R2RLogitsProcessor(llm=llm, router=model, threshold=float("nan"))


def test_generating_again_from_the_output_starts_fresh_records(model, slm, llm, single):
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        first = slm.generate(**single, max_new_tokens=4, logits_processor=[proc], **GREEDY)
        assert proc.routed.shape == (1, 4)
        mask = torch.ones_like(first)
        second = slm.generate(first, attention_mask=mask, max_new_tokens=3, logits_processor=[proc], **GREEDY)
        assert proc.routed.shape == (1, 3)
        # A fresh LLM cache as well: always routing is exactly llm.generate on the longer prompt.
        assert torch.equal(second, llm.generate(first, attention_mask=mask, max_new_tokens=3, **GREEDY))
        # Without a cache a call on the previous output cannot be told from a continuation; reset() says it.
        slm.generate(second, max_new_tokens=2, logits_processor=[proc], use_cache=False, **GREEDY)
        assert proc.routed.shape == (1, 5)
        proc.reset()
        slm.generate(second, max_new_tokens=2, logits_processor=[proc], use_cache=False, **GREEDY)
        assert proc.routed.shape == (1, 2)


def test_sampling_warpers_shape_routed_rows_and_logits_processors_do_not(model, slm, single):
    """What the processor module's docstring says about HF's processor order (transformers 5.23)."""
    llm = make_tiny_llm(vocab_size=416)  # the SLM's width: both samplers draw from the same number of ids
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 8, "top_p": 0.9, "max_new_tokens": 8,
                "pad_token_id": 0, "eos_token_id": 2}
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        torch.manual_seed(7)
        routed = slm.generate(**single, logits_processor=[proc], **sampling)
    torch.manual_seed(7)
    assert torch.equal(routed, llm.generate(**single, **sampling)), "warpers run after the processor"
    penalised = {**GREEDY, "repetition_penalty": 5.0, "max_new_tokens": 12}
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        routed = slm.generate(**single, logits_processor=[proc], **penalised)
    plain = llm.generate(**single, **GREEDY, max_new_tokens=12)
    assert torch.equal(routed, plain), "the repetition penalty shaped the SLM's scores only"
    assert not torch.equal(plain, llm.generate(**single, **penalised))


# ------------------------------------------------------------------ 6. tokenizer identity
def _save(model, tokenizer, folder):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("vocab, accepted", [(400, True), (416, False)])
def test_tokenizers_are_compared_on_the_ids_both_models_can_write(tmp_path, vocab, accepted):
    extra = make_tokenizer()
    extra.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    assert extra.convert_tokens_to_ids("<|extra|>") == 400
    slm = _save(make_tiny_slm(vocab_size=vocab), make_tokenizer(), tmp_path / "slm")
    llm = _save(make_tiny_llm(vocab_size=vocab), extra, tmp_path / "llm")
    if accepted:  # id 400 is past both vocabularies: neither model can write it
        assert R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER).shared_vocab_size == 400
    else:
        with pytest.raises(ValueError, match="differ in 1 of the 416 ids"):
            R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)


# ------------------------------------------------------------------ 8. one sentence, no traceback
def test_an_empty_prompt_is_refused(model, router_dir, capsys):
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    _one_line_error(capsys, cli_main(["generate", "--router", str(router_dir), " "]), "The prompt is empty")


def test_a_missing_router_folder_is_one_sentence(capsys):
    with pytest.raises(OSError, match=r"^The router folder /does/not/exist does not exist; pass an existing folder"):
        R2RForCausalLM.from_pretrained("/does/not/exist")
    _one_line_error(capsys, cli_main(["generate", "--router", "/does/not/exist", "x"]), "does not exist")


def test_a_truncated_weights_file_is_one_sentence(router_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(router_dir, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="model.safetensors cannot be read"):
        R2RForCausalLM.from_pretrained(broken, load_pair=False)
    _one_line_error(capsys, cli_main(["--quiet", "generate", "--router", str(broken), "x"]),
                    "damaged or incomplete")


def test_cuda_on_a_machine_without_it_is_refused_by_the_option(router_dir, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["generate", "--router", str(router_dir), "--device", "cuda", "x"],
                    ["train", "--data", "d", "--out", "o", "--device", "cuda:0"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(command)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "no CUDA support" in err and "Traceback" not in err


def test_a_string_size_in_the_config_is_one_line(router_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(router_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["slm_hidden_size"] = "64"
    (broken / "config.json").write_text(json.dumps(config))
    _one_line_error(capsys, cli_main(["generate", "--router", str(broken), "x"]),
                    "slm_hidden_size must be an integer, got '64'", "without quotes")


def test_quiet_and_debug_work_after_the_subcommand(tmp_path, monkeypatch):
    from r2r_hf.cli.main import build_parser

    args = build_parser().parse_args(["train", "--quiet", "--data", "d", "--out", "o", "--debug"])
    assert args.quiet and args.debug
    args = build_parser().parse_args(["--quiet", "train", "--data", "d", "--out", "o"])
    assert args.quiet and not args.debug
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):  # --debug: the exception itself, not one line
        cli_main(["push", "nowhere", "org/name", "--debug"])


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--router", "r", "--threads", "0", "x"])
    assert exit_info.value.code == 2 and "expected a whole number >= 1, got '0'" in capsys.readouterr().err


def test_a_prompt_past_the_context_warns_as_slm_generate_does(model, slm):
    from transformers.generation import stopping_criteria

    prompt = torch.randint(3, 300, (1, 1030))
    with mock.patch.object(stopping_criteria.logger, "warning_once") as warn:
        slm.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        expected = warn.call_args
        warn.reset_mock()
        model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert expected is not None and "maximum length (1024)" in expected.args[0]
    assert warn.call_args == expected
