"""Hub and folder I/O: telling a Hub id from a local path, which folders a router may be written to,
and uploading a router folder as one commit."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi
from safetensors import SafetensorError
from transformers.utils import cached_file

# Keyword arguments of `from_pretrained` that say where and how to fetch files; they apply to
# the router and, unless overridden in slm_kwargs/llm_kwargs, to the SLM and LLM as well.
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "proxies")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(name: str | os.PathLike | None) -> bool:
    """True for ``"org/name"`` or ``"name"`` that is not an existing local path: it names a Hub repo.

    Anything else that does not exist (``./x``, ``/abs/x``, ``a/b/c``) is a local path that is missing.
    """
    text = str(name) if name is not None else ""
    return bool(text) and not os.path.exists(text) and _HUB_ID.fullmatch(text) is not None


def missing_local_path(name: str | os.PathLike) -> bool:
    """True when ``name`` can only be a local path and nothing is there."""
    return not os.path.exists(str(name)) and not is_hub_id(name)


def split_hub_path(
    name: str | os.PathLike, subfolder: str | None = None
) -> tuple[str | os.PathLike, str | None, str | None]:
    """``"org/repo/folder/router.pt"`` -> ``("org/repo", "folder", "router.pt")``; anything else is returned as is.

    The official R2R configs name a router as one such string. A local path that exists, and any name
    that does not end in ``.pt``, is left whole (with ``subfolder``), so a missing local folder stays one.

    Returns:
        (location, subfolder, filename); filename is None unless the name was split.
    """
    text = str(name)
    parts = text.split("/")
    if os.path.exists(text) or not text.endswith(".pt") or len(parts) < 3 or not is_hub_id("/".join(parts[:2])):
        return name, subfolder, None
    inner = "/".join(parts[2:-1]) or None
    if inner and subfolder and inner != subfolder.strip("/"):
        raise ValueError(f"{text} names the folder {inner!r} inside the repo and subfolder={subfolder!r} another; "
                         "name it once.")
    return "/".join(parts[:2]), inner or subfolder, parts[-1]


def read_router_json(location: str | os.PathLike, filename: str, hub: dict[str, Any] | None = None) -> Any:
    """A JSON file of a router (folder or Hub repo), or None when it has none; a damaged one is one sentence."""
    try:
        path = cached_file(str(location), filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **(hub or {}))
    except OSError:
        return None
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); restore it or delete it to load the router without it.") \
            from None


def check_router_location(location: str | os.PathLike) -> None:
    """Refuse, before any download, a router location that is a missing local path or a file other than a ``.pt``."""
    if missing_local_path(location):
        raise OSError(f"The router folder {location} does not exist; pass an existing folder, a Hub id (with "
                      "subfolder= for a folder inside the repo) or an official router file (org/repo/folder/file.pt).")
    if os.path.isfile(str(location)) and not str(location).endswith(".pt"):
        raise ValueError(f"{location} is a file, not a router; pass the router's folder (the one holding "
                         "config.json and model.safetensors), a Hub id or an official router file (.pt).")


def is_router_config(path: str | os.PathLike | None) -> bool:
    """True when ``path`` is a ``config.json`` with ``model_type`` "r2r" (a router r2r_hf wrote)."""
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8")) if path else None
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == "r2r"


def check_is_router(config: dict[str, Any], location: str | os.PathLike) -> None:
    """Refuse a ``config.json`` of another model type (a plain model's folder given as a router)."""
    model_type = config.get("model_type")
    if model_type not in (None, "r2r"):
        raise ValueError(
            f"{location} is not an r2r router: its config.json describes a {model_type!r} model; pass a router "
            "folder or Hub id (a model goes to slm= / llm=)."
        )


def is_router_folder(folder: str | os.PathLike) -> bool:
    """True when ``folder`` holds a router r2r_hf wrote (see ``is_router_config``)."""
    return is_router_config(Path(folder, "config.json"))


def check_output_folder(folder: str | os.PathLike, overwrite: bool = False, update: bool = False) -> None:
    """Refuse to write a router where it would replace files r2r_hf did not write; call it before the work.

    A new or empty folder, or one holding an r2r router, is accepted. Any other non-empty folder (a model's
    folder, say) is refused unless ``overwrite``; even then only the router's own files are written into it
    and nothing there is deleted.

    Args:
        folder: where the router will be written.
        overwrite: accept a non-empty folder that holds no r2r router.
        update: the folder must already hold an r2r router (calibrating one in place).
    """
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{folder} is a file, not a folder; pass a folder to write the router to.")
    check_not_cache_snapshot(folder)
    if update:
        if not path.is_dir():
            raise FileNotFoundError(f"The router folder {folder} does not exist.")
        if not is_router_folder(path):
            raise ValueError(
                f"{folder} is not an r2r router folder (no config.json with model_type 'r2r'); pass a folder "
                "a router was saved to (save_pretrained, train_router, R2RForCausalLM.from_official)."
            )
        return
    if path.is_dir() and any(path.iterdir()) and not is_router_folder(path) and not overwrite:
        raise FileExistsError(
            f"{folder} is not empty and holds no r2r router (no config.json with model_type 'r2r'); pass a new or "
            "empty folder, or overwrite=True to write the router's files into it (nothing else there "
            "is deleted)."
        )


def write_failed(path: str | os.PathLike, err: BaseException) -> OSError | None:
    """One sentence for a write that failed for lack of space (safetensors raises its own error type for it);
    None for any other error, which then propagates as it is."""
    code = getattr(err, "errno", None)
    # safetensors reports the OS error as text: "... (os error 28)" or "Os { code: 28, kind: StorageFull ... }".
    found = re.search(r"os error (\d+)|code: (\d+)", str(err)) if code is None else None
    code = int(found.group(1) or found.group(2)) if found else code
    if code not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    return OSError(f"Could not write {path}: no space left (the disk is full, or a quota or file size limit was "
                   "reached); free some space or write to another folder, then run the command again (nothing "
                   "was replaced).")


def check_not_cache_snapshot(folder: str | os.PathLike) -> None:
    """Refuse a folder inside the Hugging Face cache: its files are links to blobs other snapshots share."""
    parts = Path(folder).resolve().parts
    for i, part in enumerate(parts[:-1]):
        if part.startswith(("models--", "datasets--", "spaces--")) and parts[i + 1] == "snapshots":
            raise ValueError(
                f"{folder} is a Hugging Face cache snapshot (its files are shared with other snapshots); write the "
                "router to a folder of your own (copy the snapshot first to change a downloaded router)."
            )


@contextlib.contextmanager
def staging_folder(folder: str | os.PathLike) -> Iterator[str]:
    """A private folder inside ``folder`` (created if needed); its files replace their namesakes in ``folder`` on exit.

    Whatever writes into it can delete nothing else of ``folder``, and a namesake that is a symbolic link is
    replaced, never written through (its target, maybe shared, stays as it was; a dangling one stays absent).
    """
    check_not_cache_snapshot(folder)
    created = not Path(folder).exists()
    Path(folder).mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".r2r-save-", dir=folder)
    try:
        yield staging
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(folder, name))
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if created:  # a failed save leaves no trace, not even the folder
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        full = write_failed(folder, err) if isinstance(err, (OSError, SafetensorError)) else None
        if full is not None:  # a full disk: one sentence, and the folder as it was
            raise full from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def commit_folder(
    folder: str | os.PathLike,
    repo_id: str,
    commit_message: str = "Upload R2R router",
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
) -> Any:
    """Create ``repo_id`` if needed and upload every file of ``folder`` in one commit.

    Args:
        folder: local folder.
        repo_id: ``"org/name"``.
        commit_message: the commit's title.
        private: visibility of a newly created repo.
        token: Hub token (default: the logged-in one).
        revision: branch to push to.
        create_pr: open a pull request instead of committing.
    """
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.name.startswith("."))
    operations = [CommitOperationAdd(str(p.relative_to(folder)), str(p)) for p in files]
    return api.create_commit(repo_id=repo_id, operations=operations, commit_message=commit_message,
                             revision=revision, create_pr=create_pr)


def push_folder(folder: str | os.PathLike, repo_id: str, **kwargs: Any) -> str | None:
    """Push a saved router folder as is (config, weights, model card, metrics); returns the commit URL.

    Refuses folders that are not r2r routers.
    """
    if not is_router_folder(folder):
        raise ValueError(f"{folder} is not an r2r router folder (no config.json with model_type 'r2r').")
    commit = commit_folder(folder, repo_id, **kwargs)
    return getattr(commit, "commit_url", None)
