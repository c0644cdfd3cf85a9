"""Uploading a folder to the Hub as one commit (used by push_to_hub and `r2r-hf push`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, HfApi


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
    import json

    config = Path(folder) / "config.json"
    if not config.exists() or json.loads(config.read_text()).get("model_type") != "r2r":
        raise ValueError(f"{folder} is not an r2r router folder (no config.json with model_type 'r2r').")
    commit = commit_folder(folder, repo_id, **kwargs)
    return getattr(commit, "commit_url", None)
