"""Where a model or router name is read from: a folder, the Hugging Face cache, the Hub, or a registered local copy.

Two things a user without a network should not meet: two minutes of retried requests before an
error, and a name nobody can guess. So, before anything asks the Hub for a name that is not a local
folder:

* **one probe** (a TCP connection to the Hub with a short timeout, once per process; none when
  ``HF_HUB_OFFLINE`` is set or a proxy is configured) tells whether the Hub can be reached;
* unreachable, a name already in the Hugging Face cache is read from there alone
  (``local_files_only``), and a name neither cached nor registered is one sentence at once;
* a **registered local copy** serves a name from a folder some tool made and recorded in
  ``local_models.json``. A copy of a Hub model (``benchmarks/models.py`` records the demo's pair
  there: bf16 folders dequantised from Q4_K_M GGUF files on PyPI) is a fallback, used only when the
  Hub cannot be reached and the cache does not hold the name; a name that is no Hub repo (the
  shipped router's path as the docs write it, recorded by ``make demo``) is served from its folder
  wherever the command runs. Every use says so in one line, with what the copy is: a conversion is
  never passed off as the Hub's own files.

The registry lives in ``$R2R_HF_CACHE`` (default ``~/.cache/r2r_hf``), as ``{"name": {"path": ...,
"note": ..., "fallback": ...}}``; ``register_local_copy`` adds an entry, replacing only its own name.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .hub import is_hub_id

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
REGISTRY = "local_models.json"


def local_home() -> Path:
    """r2r_hf's own folder for downloads and local copies (``$R2R_HF_CACHE`` or ``~/.cache/r2r_hf``)."""
    return Path(os.environ.get("R2R_HF_CACHE") or Path.home() / ".cache" / "r2r_hf")


def _offline_set() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() not in ("0", "", "false", "no", "off")


@functools.lru_cache(maxsize=4)
def _probe(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def hub_reachable() -> bool:
    """Whether the Hub answers (one probe per process); False under ``HF_HUB_OFFLINE``, True behind a proxy."""
    if _offline_set():
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a direct probe says nothing about a proxy; let huggingface_hub use it
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return _probe(endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443))


def in_hf_cache(name: str, filename: str = "config.json", **hub: Any) -> bool:
    """Whether the Hugging Face cache holds ``filename`` of the Hub repo ``name`` (or, for ``filename=None``, any
    snapshot of it)."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.file_download import repo_folder_name

    if filename is not None:
        found = try_to_load_from_cache(name, filename, cache_dir=hub.get("cache_dir"), revision=hub.get("revision"))
        return isinstance(found, str)
    snapshots = Path(hub.get("cache_dir") or constants.HF_HUB_CACHE, repo_folder_name(repo_id=name, repo_type="model"),
                     "snapshots")
    return snapshots.is_dir() and any(snapshots.iterdir())


# ------------------------------------------------------------------ the registry of local copies
def registered_copies() -> dict[str, dict[str, str]]:
    """Every registered local copy: name -> {"path", "note"} (an unreadable registry counts as empty)."""
    try:
        data = json.loads((local_home() / REGISTRY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("path"), str)} \
        if isinstance(data, dict) else {}


def register_local_copy(name: str, path: str | os.PathLike, note: str, fallback: bool = True) -> None:
    """Record ``path`` as the local copy of ``name`` (a Hub id, or a router path as the docs write it).

    Args:
        name: what callers ask for.
        path: the folder that serves it.
        note: what the copy is, said whenever it is used (e.g. how it was converted).
        fallback: True for a copy of a Hub repo (used only when the Hub cannot serve it); False for a
            name that is no Hub repo, served from ``path`` always.
    """
    home = local_home()
    home.mkdir(parents=True, exist_ok=True)
    entries = registered_copies()
    entries[name] = {"path": str(Path(path).resolve()), "note": note, "fallback": bool(fallback)}
    fd, tmp = tempfile.mkstemp(dir=home, prefix=f".{REGISTRY}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, home / REGISTRY)


def local_copy(name: str) -> dict[str, Any] | None:
    """The registry entry of ``name`` ({"path", "note", "fallback"}) when its folder still exists, else None."""
    entry = registered_copies().get(str(name))
    return entry if entry and Path(entry["path"]).is_dir() else None


# ------------------------------------------------------------------ deciding where a name is read from
class Unavailable(OSError):
    """A name that no folder, cache, registered copy or reachable Hub can serve; ``reason`` says which was missing."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name!r}: {reason}")
        self.name, self.reason = name, reason


def resolve(name: str | os.PathLike, what: str, hub: dict[str, Any] | None = None,
            filename: str | None = "config.json") -> tuple[str | os.PathLike, dict[str, Any]]:
    """Where to read ``name`` from, and the Hub options to read it with, without a request that cannot answer.

    Args:
        name: a folder, a Hub id, or a name registered with ``register_local_copy``.
        what: what it is, for the line a registered copy's use prints ("the SLM", "the router").
        hub: the caller's Hub options (``local_files_only``, ``revision``, ``cache_dir``...).
        filename: a file the repo must hold (to tell whether the cache has it); None: any snapshot will do.

    Returns:
        (what to pass to ``from_pretrained``, the Hub options to pass with it).

    Raises:
        Unavailable: nothing here can serve ``name`` (the caller words the sentence).
    """
    hub = dict(hub or {})
    text = str(name)
    if os.path.exists(text):
        return name, hub
    copy = local_copy(text)
    if copy is not None and not copy.get("fallback", True):
        return _use(copy, what, text, hub)
    if is_hub_id(text):
        if not hub.get("local_files_only") and hub_reachable():
            return name, hub
        if in_hf_cache(text, filename, **hub):
            return name, {**hub, "local_files_only": True}
        if copy is not None:
            return _use(copy, what, text, hub)
        raise Unavailable(text, "not a local folder nor in the Hugging Face cache, and the Hub cannot be reached"
                                f"{' (HF_HUB_OFFLINE is set)' if _offline_set() else ''}")
    if copy is not None:
        return _use(copy, what, text, hub)
    raise Unavailable(text, "no such folder")


def _use(copy: dict[str, Any], what: str, name: str, hub: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    note = copy.get("note")
    logger.warning("%s %s: using the local copy %s%s", what[0].upper() + what[1:], name, copy["path"],
                   f" ({note})" if note else "")
    return copy["path"], {k: v for k, v in hub.items() if k not in ("revision", "local_files_only")}
