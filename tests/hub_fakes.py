"""An offline stand-in for the Hugging Face Hub: uploads land in a real HF cache layout.

Only the network calls are replaced (create_repo, create_commit); paths are computed
by huggingface_hub's own functions, so an offline ``from_pretrained("org/name")``
resolves them exactly as it would after a real download.
"""

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from huggingface_hub.file_download import _get_pointer_path, repo_folder_name


def write_to_cache(cache_dir, repo_id, files):
    """Place ``{path_in_repo: local_path}`` into ``cache_dir`` as the snapshot of ``repo_id``'s main branch."""
    repo = os.path.join(cache_dir, repo_folder_name(repo_id=repo_id, repo_type="model"))
    sha = hashlib.sha1(repo_id.encode()).hexdigest()
    for path_in_repo, source in files.items():
        target = _get_pointer_path(repo, sha, path_in_repo)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(source, target)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    Path(repo, "refs", "main").write_text(sha)


def folder_to_cache(cache_dir, repo_id, folder):
    """Publish every file of a local folder as ``repo_id``."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): str(p) for p in folder.rglob("*") if p.is_file()}
    write_to_cache(cache_dir, repo_id, files)


@contextlib.contextmanager
def fake_hub(cache_dir):
    """Within the block, ``push_to_hub`` writes into ``cache_dir``; yields the list of uploaded paths."""
    uploaded = []

    def create_commit(self, repo_id, operations, **kwargs):
        files = {op.path_in_repo: op.path_or_fileobj for op in operations}
        uploaded.extend(files)
        write_to_cache(cache_dir, repo_id, files)
        return SimpleNamespace(commit_url="", oid=hashlib.sha1(repo_id.encode()).hexdigest(), pr_url=None)

    with mock.patch("huggingface_hub.HfApi.create_repo", lambda self, repo_id, **k: SimpleNamespace(repo_id=repo_id)), \
         mock.patch("huggingface_hub.HfApi.create_commit", create_commit):  # fmt: skip
        yield uploaded
