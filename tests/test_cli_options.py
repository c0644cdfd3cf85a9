"""The command line's options: a value out of range is refused by the option itself (exit 2, no traceback) before
anything loads, --threads is bounded by the machine's CPUs, --device cuda needs CUDA, and --quiet / --debug work
before or after the subcommand.

From issue 15's hostile probe (item 8) and issue 19's second review (items 11, 12, 14, 15: the range checks)."""

import os

import pytest
import torch

from r2r_hf.cli import main as cli_main


def _usage_error(capsys, argv, *expected):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


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
    (["serve", "r", "--draft-block", "64"], "argument --draft-block: expected a whole number of drafted steps from 1 to "
                                            "16 (1: off), got '64'"),  # issue 59, item 4: "block must be..."
    (["serve", "r", "--draft-block", "0"], "argument --draft-block: expected a whole number of drafted steps"),
])
def test_option_values_out_of_range_are_refused_by_the_option(argv, expected, capsys):
    _usage_error(capsys, argv, expected)


def test_the_servers_draft_block_is_refused_by_its_own_name():
    """Issue 59, item 4: in Python the setting is ``draft_block`` (the policy's own field is ``block``)."""
    from r2r_hf.core.policy import WaitPolicy
    from r2r_hf.serve.settings import ServeSettings

    with pytest.raises(ValueError, match=r"^draft_block must be a whole number of drafted steps from 1 to 16 \(1: off\), "
                                         r"got 64\.$"):
        ServeSettings(draft_block=64)
    with pytest.raises(ValueError, match=r"^block must be a whole number of drafted steps"):
        WaitPolicy(block=17)


def test_threads_up_to_the_bound_are_accepted():
    from r2r_hf.cli.main import build_parser
    from r2r_hf.cli.options import THREADS_PER_CPU

    most = THREADS_PER_CPU * os.cpu_count()
    assert build_parser().parse_args(["generate", "--router", "r", "--threads", str(most), "x"]).threads == most


def test_threads_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--router", "r", "--threads", "0", "x"])
    assert exit_info.value.code == 2 and "expected a whole number >= 1, got '0'" in capsys.readouterr().err


def test_cuda_on_a_machine_without_it_is_refused_by_the_option(router_dir, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["generate", "--router", str(router_dir), "--device", "cuda", "x"],
                    ["train", "--data", "d", "--out", "o", "--device", "cuda:0"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(command)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "no CUDA support" in err and "Traceback" not in err


def test_quiet_and_debug_work_after_the_subcommand(tmp_path, monkeypatch):
    from r2r_hf.cli.main import build_parser

    args = build_parser().parse_args(["train", "--quiet", "--data", "d", "--out", "o", "--debug"])
    assert args.quiet and args.debug
    args = build_parser().parse_args(["--quiet", "train", "--data", "d", "--out", "o"])
    assert args.quiet and not args.debug
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError):  # --debug: the exception itself, not one line
        cli_main(["push", "nowhere", "org/name", "--debug"])


def test_the_commands_that_load_the_pair_declare_the_same_model_flags():
    from r2r_hf.cli.main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices

    def model_flags(name: str) -> dict:
        flags = {}
        for action in commands[name]._actions:
            if action.dest in ("router", "slm", "llm", "device", "dtype", "threads"):
                flags[action.dest] = (action.default, action.choices, getattr(action.type, "__name__", None),
                                      (action.help or "").replace(" (per replica)", ""))
        return flags

    generate = model_flags("generate")
    assert len(generate) == 6 and model_flags("chat") == generate == model_flags("serve")
    assert commands["serve"].parse_args(["r", "--threads", "1"]).router == "r", "serve takes the router by position"
