"""Hub I/O: telling a Hub id from a local path, and uploading a router folder as one commit."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi

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
    config = Path(folder) / "config.json"
    if not config.exists() or json.loads(config.read_text()).get("model_type") != "r2r":
        raise ValueError(f"{folder} is not an r2r router folder (no config.json with model_type 'r2r').")
    commit = commit_folder(folder, repo_id, **kwargs)
    return getattr(commit, "commit_url", None)
