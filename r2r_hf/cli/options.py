"""Argument types shared by every subcommand (each says what it expected in one sentence), and the flags every
command that loads the models declares the same way."""

from __future__ import annotations

import argparse
import math
import os


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1] (an LLM token rate: 0 routes nothing)."""
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def positive_fraction(text: str) -> float:
    """A number in (0, 1] (a recall target, top-p: 0 would mean nothing at all)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (between 0 and 1, 0 excluded), got {text!r}")
    return value


def non_negative(text: str) -> float:
    """A number >= 0 (a temperature, a threshold)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def whole(minimum: int):
    """Whole numbers >= ``minimum`` (1 for counts that must be positive)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"whole number >= {minimum}"
    return parse


positive_int = whole(1)
non_negative_int = whole(0)

# torch's OpenMP pool aborts (libgomp) or crashes far above the machine's cores; more threads than this gain nothing.
THREADS_PER_CPU = 4


def threads(text: str) -> int:
    """A CPU thread count for torch: 1 to ``THREADS_PER_CPU`` times this machine's CPU count."""
    most = THREADS_PER_CPU * (os.cpu_count() or 1)
    value = positive_int(text)
    if value > most:
        raise argparse.ArgumentTypeError(f"expected at most {most} threads ({THREADS_PER_CPU} per CPU of this "
                                         f"machine's {os.cpu_count() or 1}), got {text!r}")
    return value


def seed(text: str) -> int:
    """A random seed torch accepts: a whole number from 0 to 2**64 - 1."""
    value = non_negative_int(text)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"expected a seed between 0 and 2**64 - 1, got {text!r}")
    return value


def _bounded(expected: str, accept) -> type:
    """A number type that accepts what ``accept(value)`` says, and otherwise says it ``expected`` that."""

    def parse(text: str) -> float:
        value = _number(text)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected
    return parse


# AdamW diverges far below 1, and at 0 nothing is learnt; a dropout of 1 drops everything.
learning_rate = _bounded("a learning rate in (0, 1] (the paper's is 5e-5)", lambda v: 0 < v <= 1)
finite_non_negative = _bounded("a finite number >= 0", lambda v: 0 <= v < math.inf)
finite_non_positive = _bounded("a finite number <= 0 (a log-probability)", lambda v: -math.inf < v <= 0)
dropout = _bounded("a dropout rate in [0, 1)", lambda v: 0 <= v < 1)
positive_seconds = _bounded("a finite number of seconds > 0", lambda v: 0 < v < math.inf)


def draft_cost(text: str) -> float | str:
    """An LLM forward's cost in SLM steps, or 'auto' (``core.policy.MEASURED_COST``, spelt here: the CLI imports
    nothing heavy before parsing; timed on the pair's device: ``core/costs.py``)."""
    return text if text == "auto" else finite_non_negative(text)


draft_cost.__name__ = "a finite number >= 0 or 'auto'"


CAPTURE_MODES = ("auto", "graphs", "compile", "off")


def capture_mode(text: str) -> str:
    """``--capture``: how the server runs its steps."""
    if text not in CAPTURE_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(CAPTURE_MODES)}, got {text!r}")
    return text


def min_rows(text: str) -> tuple[int, ...]:
    """``--llm-min-rows``: one whole number >= 1, or a comma-separated list of them."""
    from ..core.policy import check_min_rows  # the one check (stdlib only: no torch before a command runs)

    try:
        return check_min_rows(tuple(int(part) for part in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or a comma-separated list of them "
                                         f"(e.g. 1,2,2,3), got {text!r}") from None


def draft_block(text: str) -> int:
    """``--draft-block``: steps drafted per host synchronisation, 1 (off) to ``policy.MAX_BLOCK``."""
    from ..core.policy import MAX_BLOCK, check_block  # the one check (stdlib only: no torch before a command runs)

    try:
        return check_block(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of drafted steps from 1 to {MAX_BLOCK} (1: off), "
                                         f"got {text!r}") from None


def signal_names(text: str) -> list[str]:
    """``--signals``: comma-separated free signals of the SLM's top-k logits for the router to read, each once."""
    from ..router_types import SIGNALS

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or any(n not in SIGNALS for n in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(SIGNALS)}, comma-separated, each once; got "
                                         f"{text!r}")
    return names


def widths(text: str) -> list[int]:
    """Comma-separated router block widths, each from 1 to ``MAX_ROUTER_WIDTH``."""
    from ..config import MAX_ROUTER_WIDTH

    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(1 <= v <= MAX_ROUTER_WIDTH for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers from 1 to {MAX_ROUTER_WIDTH} "
                                         f"(e.g. 512,512,512), got {text!r}")
    return values


def device(allow_auto: bool = False):
    """A torch device (``cpu``, ``cuda``, ``cuda:1``, ``mps``; ``auto`` where allowed) this machine has."""
    names = "cpu, cuda, cuda:N, mps" + (" or auto" if allow_auto else "")

    def parse(text: str) -> str:
        if text == "cpu" or (text == "auto" and allow_auto):
            return text
        import torch  # only when a device other than the CPU is asked for

        try:
            dev = torch.device(text)
        except (RuntimeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a device ({names}), got {text!r}") from None
        if dev.type == "meta":
            raise argparse.ArgumentTypeError("'meta' holds no data, so nothing can run on it; use --device cpu or cuda")
        backend = getattr(torch, dev.type, None)  # xpu and other accelerators say whether they are there
        if dev.type not in ("cpu", "cuda", "mps") and not getattr(backend, "is_available", lambda: False)():
            raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine; use --device cpu")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not available: this torch build has no CUDA support or no GPU is visible; "
                "use --device cpu, or install a CUDA build of torch"
            )
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not available: {torch.cuda.device_count()} GPU(s) are visible; pick one of them"
            )
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} is not available on this machine; use --device cpu")
        return text

    parse.__name__ = "device"
    return parse


def add_threads_flag(p: argparse.ArgumentParser, help_text: str = "torch CPU threads") -> None:
    """``--threads``: torch's CPU threads for the command (bounded by this machine's CPUs)."""
    p.add_argument("--threads", type=threads, help=help_text)


def add_model_flags(p: argparse.ArgumentParser, router_flag: bool = True,
                    threads_help: str = "torch CPU threads") -> None:
    """The flags of every command that loads the router and its pair: the router (``--router``, or a positional
    argument where ``router_flag`` is False), the two models, where they run, their dtype and torch's threads."""
    if router_flag:
        p.add_argument("--router", required=True, help="router folder or Hub id")
    else:
        p.add_argument("router", help="router folder or Hub id")
    p.add_argument("--slm", help="SLM Hub id or folder (default: the one the router names)")
    p.add_argument("--llm", help="LLM Hub id or folder (default: the one the router names)")
    p.add_argument("--device", type=device(allow_auto=True), default="cpu",
                   help="cpu, cuda, cuda:1, or auto (accelerate device map)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    add_threads_flag(p, threads_help)


def load_models(args: argparse.Namespace):
    """The model and tokenizer ``add_model_flags``' flags name, with torch's threads set first."""
    from ..serve import load_for_serving

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return load_for_serving(args.router, args.slm, args.llm, args.device, args.dtype)


def require_dir(path: str, what: str) -> None:
    """Refuse a folder argument that names nothing."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"The {what} folder {path} does not exist.")


def _parser_of(f) -> object:
    """How a settings field is parsed: its declared ``cli.options`` parser, else its annotation's type."""
    if f.metadata.get("parse"):
        return globals()[f.metadata["parse"]]
    kind = str(f.type)
    return int if "int" in kind else float if "float" in kind else str


def add_settings_flags(p: argparse.ArgumentParser, settings: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of a settings dataclass, with its default and help text (``r2r_hf.fields.setting``).

    A field without a default is a required flag; a ``bool`` field (default False) is a switch; fields declared
    ``cli=False`` or named in ``skip`` get none.
    """
    import dataclasses

    from ..fields import flag_of

    for f in dataclasses.fields(settings):
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        if str(f.type) == "bool":
            p.add_argument(flag_of(f), dest=f.name, action="store_true", help=f.metadata.get("help", ""))
            continue
        required = f.default is dataclasses.MISSING
        default = None if required else f.default
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(flag_of(f), dest=f.name, type=_parser_of(f), default=default, required=required,
                       help=f.metadata.get("help", "") + shown)


def settings_from(args: argparse.Namespace, settings: type, **overrides):
    """The settings dataclass the parsed flags describe (``overrides`` replace fields the command computes)."""
    import dataclasses

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings) if hasattr(args, f.name)}
    return settings(**(values | overrides))
