"""The ``r2r-hf`` command line (``python -m r2r_hf.cli``); ``main`` runs it."""

from .main import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
