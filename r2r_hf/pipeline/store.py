"""On-disk layout of a labeling run: atomic shards, a manifest, and per-step records.

    work/
      manifest.json                 models, revisions, dtype, tokenizer hash, settings
      responses/shard-00003.json    step 0: LLM reference responses
      features/shard-00003.safetensors   step 1: SLM features per response token
      continuations/shard-00003.json     step 2: the two sentences at each mismatch
      verdicts/shard-00003.json     step 3: neutral / divergent per mismatch
      labels/shard-00003.safetensors     step 4: one label per response token
      summary.json                  step 4: class counts and shares, per-step cost

Every file is written to a temporary name and renamed into place, so a killed process
leaves either a whole shard or none; a rerun skips the shards that exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_UMASK = os.umask(0)
os.umask(_UMASK)
STEPS = ("responses", "features", "continuations", "verdicts", "labels")
_SUFFIX = {"responses": ".json", "features": ".safetensors", "continuations": ".json", "verdicts": ".json",
           "labels": ".safetensors"}


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give shards the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())

    _atomic(Path(path), write)


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write tensors as safetensors atomically; ``metadata`` travels as one JSON string."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    _atomic(Path(path), lambda tmp: save_file(tensors, tmp, metadata={"r2r": json.dumps(metadata)}))


def read_tensors(path: str | os.PathLike, keys: list[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read (some of) the tensors of a shard and its metadata."""
    with safe_open(str(path), framework="pt") as f:
        names = keys if keys is not None else list(f.keys())
        tensors = {k: f.get_tensor(k) for k in names}
        metadata = json.loads((f.metadata() or {}).get("r2r", "{}"))
    return tensors, metadata


class WorkDir:
    """Paths and bookkeeping of one labeling run.

    Args:
        root: the run's folder (created if missing).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def shard(self, step: str, index: int) -> Path:
        return self.root / step / f"shard-{index:05d}{_SUFFIX[step]}"

    def done(self, step: str, index: int) -> bool:
        return self.shard(step, index).exists()

    def shards(self, step: str) -> list[int]:
        folder = self.root / step
        if not folder.is_dir():
            return []
        return sorted(int(p.name[6:11]) for p in folder.glob(f"shard-*{_SUFFIX[step]}"))

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        """Write the manifest on a new run; on a resumed run refuse any differing setting."""
        if self.manifest_path.exists():
            old = read_json(self.manifest_path)
            differences = [
                f"{key}: {old.get(key)!r} before, {manifest.get(key)!r} now"
                for key in sorted(set(old) | set(manifest))
                if old.get(key) != manifest.get(key)
            ]
            if differences:
                raise ValueError(
                    f"{self.root} holds a run with other settings ({'; '.join(differences)}); "
                    "use a new --out folder, or the original settings to resume."
                )
            return
        write_json(self.manifest_path, manifest)


def text_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
