"""Loading a router's weights strictly: every tensor its config describes, nothing else, in the right shape.

HF's ``from_pretrained`` initialises missing tensors at random and only reports it in a load report
(which ``--quiet`` hides); a router loaded that way routes at random. Native folders and official
``.pt`` files both go through ``check_router_weights``, so either loads exactly or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from safetensors import SafetensorError
from transformers.utils import cached_file

# Weight files a router folder may hold; a baseline router (entropy, random) holds none.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _names(keys: Iterable[str], limit: int = 6) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_router_weights(
    source: Any,
    missing: Iterable[str] = (),
    unexpected: Iterable[str] = (),
    mismatched: Iterable[tuple[str, Any, Any]] = (),
) -> None:
    """Raise one ValueError naming every tensor that is missing, unexpected or of another shape.

    Args:
        source: where the weights came from (named in the message).
        missing: tensors the config describes that the weights lack.
        unexpected: tensors in the weights that the config does not describe.
        mismatched: ``(name, shape in the weights, shape the config implies)``.
    """
    missing, unexpected, mismatched = sorted(missing), sorted(unexpected), sorted(mismatched, key=lambda m: m[0])
    if not (missing or unexpected or mismatched):
        return
    problems = []
    if missing:
        problems.append(f"missing {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {_names(unexpected)}")
    if mismatched:
        shapes = [f"{name} ({list(got)} in the weights, {list(want)} in the config)" for name, got, want in mismatched]
        problems.append(f"other shapes for {_names(shapes, limit=3)}")
    raise ValueError(
        f"The router weights of {source} do not match the router its config describes ({'; '.join(problems)}); "
        "the config (router_hidden_dims, normalize_input, sizes) and the weights must come from the same save: "
        "save the router again, or fix its config.json."
    )


def load_router_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Any) -> None:
    """Load ``state`` into ``model`` after ``check_router_weights`` found it complete and of the right shapes."""
    expected = model.state_dict()
    mismatched = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in state.items()
                  if k in expected and tuple(v.shape) != tuple(expected[k].shape)]
    check_router_weights(source, expected.keys() - state.keys(), state.keys() - expected.keys(), mismatched)
    model.load_state_dict(state, strict=True)


def load_strictly(load: Callable[..., Any], location: Any, *args: Any, **kwargs: Any) -> Any:
    """Run HF's ``from_pretrained`` (``load``) for a router folder; refuse what it would only report.

    Args:
        load: ``PreTrainedModel.from_pretrained`` bound to the router class.
        location: the router's folder or Hub id.
        args, kwargs: passed to ``load``.
    """
    kwargs.pop("output_loading_info", None)  # the load is strict, so there is nothing left to report
    kwargs["ignore_mismatched_sizes"] = True  # HF would raise on shapes pointing at its (maybe hidden) report
    try:
        model, info = load(location, *args, output_loading_info=True, **kwargs)
    except SafetensorError as err:
        raise OSError(f"Could not load the router {str(location)!r}: its model.safetensors cannot be read ({err}); "
                      "the file is damaged or incomplete: download or save the router again.") from err
    check_router_weights(location, info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"])
    return model


def refuse_baseline_weights(location: Any, router_type: str, hub: dict[str, Any] | None = None) -> None:
    """Refuse a baseline router (no weights) whose folder holds weights: config and weights disagree."""
    for name in WEIGHT_FILES:
        try:
            found = cached_file(str(location), name, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False, **(hub or {}))
        except OSError:
            found = None
        if found is not None:
            raise ValueError(
                f"The router {str(location)!r} holds weights ({name}) but its config.json says router_type "
                f"{router_type!r}, a baseline that has none; the config and the weights must come from the same "
                "save: save the router again, or fix router_type in its config.json."
            )
