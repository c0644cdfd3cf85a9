"""On-disk layout of a labeling run: atomic shards, a manifest, a lock, and one folder per label set.

    work/
      manifest.json                          models, dtype, generation settings, tokenizer hash (format 2)
      responses/shard-00003.json             step 0: LLM reference responses
      features/shard-00003.safetensors       step 1: SLM features per response token
      continuations/shard-00003.json         step 2: the two versions of the sentence at each mismatch
      verdicts/<verifier key>/shard-00003.json    step 3: one verifier's verdicts (kept per verifier, reused)
      labels/<label set>/shard-00003.safetensors  step 4: one label per response token for a chain of verifiers
      labels/<label set>/settings.json, summary.json   the chain and its class shares and costs

Steps 0-2 depend on the manifest only, so relabeling with other verifiers reuses them. Every
file is written to a temporary name and renamed into place, so a killed process leaves either a
whole shard or none; a rerun skips the shards that exist. Runs of format 1 (one label set, written
to ``labels/`` and ``summary.json`` directly) are read as the label set ``legacy``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..model.hub import write_failed
from .steps import LABEL_SET_FILES, LABELS, LEGACY_SET, NAMES, Step, step

_UMASK = os.umask(0)
os.umask(_UMASK)
STEPS = NAMES  # the step names, in order (declared in steps.py)
FORMAT = 2
# Manifest keys of format 1 that now belong to a label set (they no longer decide steps 0-2).
_FORMAT1_VERIFIER_KEYS = ("verifier", "verifier_max_new_tokens", "share_verifier_prefix", "verifier_tokenizer_hash")


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give shards the usual permissions
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        full = write_failed(path, err) if isinstance(err, (OSError, SafetensorError)) else None
        if full is not None:
            raise full from None
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False)
            f.flush()
            os.fsync(f.fileno())

    _atomic(Path(path), write)


def _corrupt(path: str | os.PathLike, err: BaseException) -> ValueError:
    reason = " ".join(str(err).split())[:200] or type(err).__name__
    return ValueError(f"{path} is corrupt ({reason}); delete it and label the run again (pipeline.label; "
                      "`r2r-hf label` on the command line) to write it again.")


# What the readers of a run's JSON files rely on: an object with these fields (a list holds objects). The steps'
# shards declare theirs (``Step.shape``); these are the run's other files.
SHAPES: dict[str, dict[str, type]] = {
    "manifest": {},
    "settings": {"verifiers": list},
    "summary": {"counts": dict, "tokens": int},
}


def read_json(path: str | os.PathLike, shape: str | Step | None = None) -> Any:
    """Read a JSON file of a run; a damaged one, or one without the fields its shape names (``SHAPES`` or a step's
    ``Step.shape``), is one clear error naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(path, err) from None
    if shape is None:
        return data
    if not isinstance(data, dict):
        raise _corrupt(path, ValueError(f"a JSON object was expected, not {type(data).__name__}"))
    fields = SHAPES[shape] if isinstance(shape, str) and shape in SHAPES else dict(step(shape).shape)
    for key, kind in fields.items():
        value = data.get(key)
        if not isinstance(value, kind) or (kind is list and not all(isinstance(v, dict) for v in value)):
            expected = {list: "list of objects", dict: "object", int: "number"}[kind]
            raise _corrupt(path, ValueError(f"its {key!r} is {type(value).__name__}, not a JSON {expected}"))
    return data


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> None:
    """Write tensors as safetensors atomically; ``metadata`` travels as one JSON string."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    _atomic(Path(path), lambda tmp: save_file(tensors, tmp, metadata={"r2r": json.dumps(metadata)}))


def read_tensors(path: str | os.PathLike, keys: list[str] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read (some of) the tensors of a shard and its metadata; a damaged shard is one clear error naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            names = keys if keys is not None else list(f.keys())
            tensors = {k: f.get_tensor(k) for k in names}
            metadata = json.loads((f.metadata() or {}).get("r2r", "{}"))
        if not isinstance(metadata, dict):
            raise ValueError(f"its metadata is a JSON {type(metadata).__name__}, not an object")
    except FileNotFoundError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise _corrupt(path, err) from None
    return tensors, metadata


class WorkDir:
    """Paths and bookkeeping of one labeling run.

    Args:
        root: the run's folder (created when something is first written).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def folder(self, of: str | Step, subset: str | None = None) -> Path:
        """The folder of a step; verdicts and labels have one subfolder per verifier / label set."""
        folder = self.root / step(of).name
        return folder if subset is None or subset == LEGACY_SET else folder / subset

    def shard(self, of: str | Step, index: int, subset: str | None = None) -> Path:
        return self.folder(of, subset) / f"shard-{index:05d}{step(of).suffix}"

    def done(self, of: str | Step, index: int, subset: str | None = None) -> bool:
        """Whether the step's shard is written (a shard exists whole or not at all)."""
        return self.shard(of, index, subset).exists()

    def read(self, of: str | Step, index: int, subset: str | None = None) -> dict[str, Any]:
        """A JSON shard (responses, continuations, verdicts), checked to have the fields its readers use."""
        return read_json(self.shard(of, index, subset), step(of))

    def shards(self, of: str | Step, subset: str | None = None) -> list[int]:
        """The indices of the step's shards written so far."""
        of = step(of)
        folder = self.folder(of, subset)
        if not folder.is_dir():
            return []
        found = []
        for path in folder.iterdir():
            name = path.name
            if path.is_dir() or name.startswith("."):
                continue
            if name in LABEL_SET_FILES and of is LABELS:
                continue
            if not (name.startswith("shard-") and name.endswith(of.suffix) and name[6:11].isdigit()
                    and len(name) == 11 + len(of.suffix)):
                raise ValueError(f"{path} is not a shard of this run; move it out of {folder} (only shard-NNNNN"
                                 f"{of.suffix} files belong there).")
            found.append(int(name[6:11]))
        return sorted(found)

    def label_sets(self) -> list[str]:
        """Names of the label sets written so far (``legacy`` for a format-1 run)."""
        folder = self.folder(LABELS)
        if not folder.is_dir():
            return []
        named = sorted(p.name for p in folder.iterdir() if p.is_dir() and (p / "settings.json").exists())
        legacy = any(p.name.startswith("shard-") for p in folder.iterdir() if p.is_file())
        return ([LEGACY_SET] if legacy else []) + named

    def summary_path(self, label_set: str) -> Path:
        return self.root / "summary.json" if label_set == LEGACY_SET else self.folder(LABELS, label_set) / "summary.json"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def manifest(self) -> dict[str, Any]:
        """The run's manifest in format 2 (a format-1 manifest read as one)."""
        if not self.manifest_path.exists():
            raise FileNotFoundError(f"{self.root} holds no manifest.json; it is not a labeling run.")
        manifest = read_json(self.manifest_path, "manifest")
        if manifest.get("format", 1) == 1:
            manifest = {k: v for k, v in manifest.items() if k not in _FORMAT1_VERIFIER_KEYS} | {"format": FORMAT}
        return manifest

    def record_manifest(self, manifest: dict[str, Any]) -> None:
        """Write the manifest of a new run (after ``check_manifest`` and every other check passed)."""
        if not self.manifest_path.exists():
            write_json(self.manifest_path, manifest)

    def check_manifest(self, manifest: dict[str, Any]) -> None:
        """On a resumed run, refuse any setting that differs from the manifest's (writes nothing)."""
        if self.manifest_path.exists():
            old = self.manifest()
            differences = [
                f"{key}: {old.get(key)!r} before, {manifest.get(key)!r} now"
                for key in sorted(set(old) | set(manifest))
                if old.get(key) != manifest.get(key)
            ]
            if differences:
                raise ValueError(
                    f"{self.root} holds a run with other settings ({'; '.join(differences)}); "
                    "use a new out= folder, or the original settings to resume."
                )

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run for one process: a second run on the same folder is refused at once.

        An OS file lock dies with its process, so a run killed by SIGKILL never blocks a resume.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"Another labeling run (pipeline.label; `r2r-hf label` on the command line) is "
                                 f"writing {self.root}; wait for it to finish, or label into another out= "
                                 "folder.") from None
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def text_hash(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
