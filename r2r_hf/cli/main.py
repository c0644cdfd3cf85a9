"""The ``r2r-hf`` command line: one subcommand per job, each a thin shell over the Python API.

Errors a person can cause (a missing path, a bad option, a model that cannot load) print
one sentence and exit non-zero; ``--debug`` shows the traceback instead. Nothing heavy (torch,
transformers) is imported before the arguments are parsed: ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from . import generate, serve, tools

# name -> (help, setup(parser), run(args) -> exit code)
COMMANDS = {**generate.COMMANDS, **serve.COMMANDS, **tools.COMMANDS}


def _add_global_flags(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("--debug", action="store_true", default=default, help="show full tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", default=default, help="no progress bars or info messages")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="r2r-hf", description="R2R token routing between a small and a large LM.")
    _add_global_flags(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, setup, _) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        # Accepted after the subcommand too; SUPPRESS keeps a flag given before it from being reset to False.
        _add_global_flags(command, argparse.SUPPRESS)
        setup(command)
    return parser


def _one_sentence(err: BaseException, command: argparse.ArgumentParser | None = None) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    text = text if command is None else in_flags(text, command)
    return text if len(text) < 600 else text[:597] + "..."


def in_flags(text: str, command: argparse.ArgumentParser) -> str:
    """A library message in the shell's terms: the parameters it names (``slm=``) as the command's flags (``--slm``)."""
    flags = {a.dest: a.option_strings[-1] if a.option_strings else (a.metavar or a.dest.upper())
             for a in command._actions if a.dest not in (None, "help", argparse.SUPPRESS)}
    switches = {a.dest for a in command._actions if isinstance(a, argparse._StoreTrueAction)}

    def flag(m: re.Match) -> str:
        name, true = m.group(1), m.group(2)
        if true:  # ``overwrite=True`` is the switch ``--overwrite``
            return flags[name] if name in switches else m.group(0)
        return flags.get(name, m.group(0))

    return re.sub(r"\b([a-z_]+)=(True)?(?=[\s,;.)]|$)", flag, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``r2r-hf``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = parser._subparsers._group_actions[0].choices[args.command]
    if args.quiet:
        logging.disable(logging.INFO)
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    _, _, run = COMMANDS[args.command]
    import torch

    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (torch.OutOfMemoryError, MemoryError) as err:
        if args.debug:
            raise
        print(f"error: out of memory ({_one_sentence(err)}); try a smaller dtype (--dtype bfloat16), "
              "a device map, or quantising the LLM.", file=sys.stderr)
        return 1
    except (ValueError, OSError, RuntimeError, KeyError) as err:
        if args.debug:
            raise
        print(f"error: {_one_sentence(err, command)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
