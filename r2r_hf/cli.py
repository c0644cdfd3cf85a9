"""The ``r2r-hf`` command line: one subcommand per job, each a thin shell over the Python API.

Errors a person can cause (a missing path, a bad option, a model that cannot load) print
one sentence and exit non-zero; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

import torch

Setup = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]
COMMANDS: dict[str, tuple[str, Setup, Run]] = {}


def register(name: str, help_text: str, setup: Setup, run: Run) -> None:
    """Add subcommand ``name``: ``setup(parser)`` declares its options, ``run(args)`` returns the exit code."""
    COMMANDS[name] = (help_text, setup, run)


# --------------------------------------------------------------- import-official
def _setup_import_official(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="official router: Hub repo id, folder, or .pt file (e.g. nics-efc/R2R_router)")
    p.add_argument("--out", required=True, help="folder to write the converted router to")
    p.add_argument("--subfolder", help="folder inside the repo, e.g. 'Qwen3-0.6B+Qwen3-8B'")
    p.add_argument("--slm", help="SLM Hub id or folder (default: from the published-router table)")
    p.add_argument("--llm", help="LLM Hub id or folder (default: from the published-router table)")
    p.add_argument("--revision", help="Hub revision of the router repo")


def _run_import_official(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from .loading import check_router_sizes
    from .modeling import R2RForCausalLM

    hub = {"revision": args.revision} if args.revision else {}
    model = R2RForCausalLM.from_official(args.source, subfolder=args.subfolder, slm=args.slm, llm=args.llm, **hub)
    config = model.config
    try:
        slm_config = AutoConfig.from_pretrained(config.slm_name_or_path).get_text_config()
    except (OSError, ValueError):
        print(f"note: could not read the config of {config.slm_name_or_path!r} here; sizes are checked when the "
              "router is loaded with its SLM", file=sys.stderr)
    else:
        check_router_sizes(config, slm_config.hidden_size, slm_config.hidden_size, slm_config.vocab_size,
                           config.slm_name_or_path)
    model.save_pretrained(args.out)
    print(f"wrote {args.out}: SLM {config.slm_name_or_path}, LLM {config.llm_name_or_path}, "
          f"threshold {config.threshold:.4g}, router {sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


register(
    "import-official", "convert an official R2R .pt router into an r2r_hf router folder",
    _setup_import_official, _run_import_official,
)


# --------------------------------------------------------------- entry point
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r2r-hf", description="R2R token routing between a small and a large LM.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or info messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, setup, _) in COMMANDS.items():
        setup(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _one_sentence(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) < 600 else text[:597] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``r2r-hf``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.quiet:
        logging.disable(logging.INFO)
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    _, _, run = COMMANDS[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError as err:
        if args.debug:
            raise
        print(f"error: out of memory ({_one_sentence(err)}); try a smaller dtype (--dtype bfloat16), "
              "a device map, or quantising the LLM.", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError, KeyError) as err:
        if args.debug:
            raise
        print(f"error: {_one_sentence(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
