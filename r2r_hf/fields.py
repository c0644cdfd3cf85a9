"""One declaration per setting: its default, its help text and how a command line parses it.

Settings dataclasses (``LabelSettings``, ``TrainSettings``, ``ServeSettings``) declare their fields with
``setting``; the CLI builds its flags from those declarations (``cli.options.add_settings_flags``), so a default
or a help text is written once. Stdlib only: the CLI reads these before torch is imported.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, help: str = "", parse: str | None = None, flag: str | None = None,
            cli: bool = True) -> Any:
    """A dataclass field with what a command line needs to offer it.

    Args:
        default: its default (none: required).
        help: one line for ``--help``; the default is added to it.
        parse: the name of the ``cli.options`` parser that checks it on the command line (``positive_int``...).
        flag: its flag where that is not ``--field-name``.
        cli: False for settings a command line does not offer.
    """
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, "flag": flag, "cli": cli})


def flag_of(field: dataclasses.Field) -> str:
    """The command-line flag of a settings field."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")
