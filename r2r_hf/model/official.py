"""Import the routers the R2R authors published as ``torch.save`` files for their SGLang stack.

A published file (``default_router.pt`` and similar) is a dict of plain types and tensors:
``model_type``, ``init_args``, ``common_args`` (``threshold``), ``model_specific_args`` and
``state_dict``. Its parameter names are the ones ``MLPRouter`` uses, so the weights map one
to one. Files are read with ``torch.load(weights_only=True)`` only: a file that needs
arbitrary unpickling is refused, never executed.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import HfHubHTTPError

from ..config import DEFAULT_THRESHOLD, R2RConfig
from .hub import is_hub_id, is_router_config, is_router_folder

logger = logging.getLogger(__name__)

OFFICIAL_MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"
# The official loader's order of preference inside a repo or folder; else the first .pt, sorted.
PREFERRED_FILES = ("default_router.pt", "router.pt", "default_router_sampling.pt")

_R1 = "deepseek-ai/DeepSeek-R1-Distill-Qwen-"
# (repo id, subfolder) -> (SLM, LLM), from the official pair configs.
PUBLISHED_ROUTERS: dict[tuple[str, str | None], tuple[str, str]] = {
    ("nics-efc/R2R_router", None): (_R1 + "1.5B", _R1 + "32B"),
    ("nics-efc/R2R_router_collections", "Qwen3-0.6B+Qwen3-32B"): ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-32B"),
    ("nics-efc/R2R_router_collections", "Qwen3-0.6B+Qwen3-8B"): ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"),
    ("nics-efc/R2R_router_collections", "Qwen3-0.6B+Qwen3-30B-A3B"): ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-30B-A3B"),
    ("nics-efc/R2R_router_collections", "Qwen3-1.7B+Qwen3-8B"): ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"),
    ("nics-efc/R2R_router_collections", "Qwen3-4B+Qwen-8B"): ("Qwen/Qwen3-4B", "Qwen/Qwen3-8B"),
    ("GY2233/Qwen3_0_6B_Qwen3_8B", None): ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"),
    ("GY2233/Qwen3_1_7B_Qwen3_8B", None): ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"),
    ("GY2233/Qwen3_4B_Qwen_8B", None): ("Qwen/Qwen3-4B", "Qwen/Qwen3-8B"),
    ("GY2233/Qwen3_0_6B_Qwen3_30B_A3B", None): ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-30B-A3B"),
}


# ------------------------------------------------------------------ locating
def _choose(names: list[str]) -> str | None:
    pts = sorted(n for n in names if n.endswith(".pt"))
    for preferred in PREFERRED_FILES:
        if preferred in pts:
            return preferred
    return pts[0] if pts else None


def _hub_file(repo_id: str, filename: str, subfolder: str | None, hub: dict[str, Any]) -> str | None:
    try:
        return hf_hub_download(repo_id, filename, subfolder=subfolder or None, **hub)
    except (EntryNotFoundError, LocalEntryNotFoundError):  # not in the repo, or (offline) not in the cache
        return None
    except HfHubHTTPError as err:
        if getattr(err.response, "status_code", None) == 404:
            return None
        raise


def _hub_names(repo_id: str, subfolder: str | None, hub: dict[str, Any]) -> list[str] | None:
    """File names in a repo folder: from the Hub, or from the local cache when offline; None when neither answers."""
    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    revision = hub.get("revision")
    try:
        if hub.get("local_files_only"):  # the Hub is not to be asked: straight to the cache
            raise LocalEntryNotFoundError("local_files_only")
        files = HfApi(token=hub.get("token")).list_repo_files(repo_id, revision=revision)
    except RepositoryNotFoundError:
        raise OSError(f"{repo_id} is not a Hub repo you can read; check its name (or log in for a private or gated one).") \
            from None
    except Exception:  # noqa: BLE001 - offline or unreachable: fall back to what the cache holds
        try:
            snapshot = snapshot_download(
                repo_id, revision=revision, cache_dir=hub.get("cache_dir"), local_files_only=True,
                allow_patterns=[f"{prefix}*.pt"],
            )
        except Exception:  # noqa: BLE001 - nothing cached for this repo
            return None
        files = [str(p.relative_to(snapshot)) for p in Path(snapshot).rglob("*.pt")]
    return [f[len(prefix) :] for f in files if f.startswith(prefix) and "/" not in f[len(prefix) :]]


def _unreachable(where: str) -> OSError:
    return OSError(
        f"{where} is not in the local Hugging Face cache and the Hub could not be asked (offline, HF_HUB_OFFLINE=1, "
        "or no network); connect once to download it, or pass a local .pt file or folder."
    )


def find_official_file(
    location: str | os.PathLike,
    subfolder: str | None = None,
    hub: dict[str, Any] | None = None,
    filename: str | None = None,
) -> str | None:
    """The official ``.pt`` file the official loader would pick at ``location``, or None.

    A folder is an r2r_hf router (None) when its ``config.json`` has ``model_type`` "r2r"; otherwise
    it is an official router when it holds a ``.pt`` file.

    Args:
        location: a ``.pt`` file, a local folder, or a Hub repo id.
        subfolder: folder inside the repo (e.g. ``"Qwen3-0.6B+Qwen3-8B"``).
        hub: download arguments (revision, cache_dir, token, local_files_only...).
        filename: this file of the repo folder (e.g. ``"default_router.pt"``) instead of the loader's choice.
    """
    hub = {k: v for k, v in (hub or {}).items() if k in ("revision", "cache_dir", "token", "local_files_only", "force_download")}
    path = Path(location)
    if path.is_file():
        return str(path) if path.suffix == ".pt" else None
    if path.is_dir():
        folder = path / subfolder if subfolder else path
        if not folder.is_dir() or is_router_folder(folder):
            return None
        name = filename or _choose([p.name for p in folder.iterdir() if p.is_file()])
        return str(folder / name) if name and (folder / name).is_file() else None
    repo_id = str(location)
    where = "/".join(part for part in (repo_id, subfolder, filename) if part)
    if filename:
        found = _hub_file(repo_id, filename, subfolder, hub)
        if found is None and _hub_names(repo_id, subfolder, hub) is None:
            raise _unreachable(where)
        if found is None:
            raise OSError(f"{where} does not exist; check the repo, folder and file name.")
        return found
    if is_router_config(_hub_file(repo_id, "config.json", subfolder, hub)):
        return None
    for name in PREFERRED_FILES:
        found = _hub_file(repo_id, name, subfolder, hub)
        if found:
            return found
    names = _hub_names(repo_id, subfolder, hub)
    if names is None:
        raise _unreachable(where)
    name = _choose(names)
    return _hub_file(repo_id, name, subfolder, hub) if name else None


def published_pair(location: str | os.PathLike, subfolder: str | None) -> tuple[str, str] | None:
    """(SLM, LLM) Hub ids of a published router location, or None for an unknown location."""
    return PUBLISHED_ROUTERS.get((str(location).strip("/"), subfolder.strip("/") if subfolder else None))


# ------------------------------------------------------------------ reading
def read_official_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load an official router file with ``torch.load(weights_only=True)``; refuse anything else."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{path} cannot be read safely with torch.load(weights_only=True) ({reason}); r2r_hf never "
            "unpickles arbitrary objects. Export its state_dict and settings with plain types, or convert it "
            "where you trust the file."
        ) from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"{path} is not an official R2R router file: expected a dict with a 'state_dict' entry.")
    model_type = checkpoint.get("model_type")
    if model_type != OFFICIAL_MODEL_TYPE:
        raise ValueError(
            f"{path} holds an official router of type {model_type!r}; r2r_hf imports {OFFICIAL_MODEL_TYPE!r} only."
        )
    return checkpoint


# ------------------------------------------------------------------ converting
def _same_model(official: str, given: str) -> bool:
    return official.rstrip("/").lower() == given.rstrip("/").lower()


def _check_slm_name(official: str | None, slm: str) -> None:
    """``init_args.pretrained_model_name`` names the SLM; two differing Hub ids are an error."""
    if not official or _same_model(official, slm):
        return
    if not is_hub_id(slm):
        if Path(official).name.lower() != Path(slm.rstrip("/")).name.lower():
            logger.warning("The router was trained for the SLM %r; using the local SLM %r.", official, slm)
        return
    raise ValueError(
        f"This router was trained for the SLM {official!r} (init_args.pretrained_model_name) but the SLM "
        f"given is {slm!r}; pass slm={official!r} (or a local copy of it)."
    )


def official_config_and_weights(
    checkpoint: dict[str, Any], slm: str | None, llm: str | None, source: str
) -> tuple[R2RConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Translate an official checkpoint into an ``R2RConfig``, a ``router.*`` state dict and a record.

    Sizes come from the tensors, not from ``init_args`` (some official configs carried wrong
    hidden sizes); a disagreement is logged.

    Args:
        checkpoint: as returned by ``read_official_checkpoint``.
        slm: Hub id or folder of the SLM (stored in the config).
        llm: Hub id or folder of the LLM.
        source: where the file came from (recorded as the calibration's source).
    """
    init = dict(checkpoint.get("init_args") or {})
    state = {k: v for k, v in checkpoint["state_dict"].items() if k != "token_embeddings.weight"}
    if init.get("use_position_embedding"):
        raise ValueError(f"{source}: routers with use_position_embedding=True are not supported (no published router uses it).")
    if slm:
        _check_slm_name(init.get("pretrained_model_name"), slm)
    not_a_router = "so it is not an R2R router; pass the router file itself (e.g. default_router.pt)"
    blocks = sorted({int(k.split(".")[2]) for k in state if re.fullmatch(r"backbone\.blocks\.\d+\..+", k)})
    if not blocks:
        raise ValueError(f"{source}: the state dict holds no backbone.blocks.* tensors, {not_a_router}.")
    try:
        hidden, topk = state["logits_projection.weight"].shape
        width_in = state["combined_projection.weight"].shape[1]
        dims = [state[f"backbone.blocks.{i}.mlp.0.weight"].shape[1] for i in blocks]
        expansion = state[f"backbone.blocks.{blocks[0]}.mlp.0.weight"].shape[0] // dims[0]
    except KeyError as err:
        raise ValueError(f"{source}: the state dict lacks {err.args[0]!r}, {not_a_router}.") from None
    except (AttributeError, IndexError, TypeError, ValueError) as err:  # a tensor of another rank, or no tensor
        raise ValueError(f"{source}: the state dict does not have the R2R router layout ({err}), {not_a_router}.") \
            from None
    if init.get("hidden_states_size") not in (None, hidden):
        logger.warning(
            "%s: init_args.hidden_states_size=%s disagrees with the weights (%s); using the weights.",
            source, init.get("hidden_states_size"), hidden,
        )
    threshold = (checkpoint.get("common_args") or {}).get("threshold")
    if threshold is None:
        logger.warning("%s carries no calibrated threshold; using %s. Calibrate it or pass threshold=.", source,
                       DEFAULT_THRESHOLD)
    config = R2RConfig(
        slm_name_or_path=slm,
        llm_name_or_path=llm,
        slm_hidden_size=int(hidden),
        slm_embedding_size=int(width_in - 2 * hidden),
        num_topk_logits=int(topk),
        router_hidden_dims=[int(d) for d in dims],
        router_expansion=int(expansion),
        router_dropout=float(init.get("dropout_rate", 0.1)),
        normalize_input=bool(init.get("normalize_input", False)),
        threshold=DEFAULT_THRESHOLD if threshold is None else float(threshold),
    )
    record = {"calibration": {"method": "official R2R checkpoint", "source": source}} if threshold is not None else {}
    return config, {f"router.{k}": v for k, v in state.items()}, record


def resolve_pair(
    location: str | os.PathLike, subfolder: str | None, slm: Any, llm: Any, trained_for: str | None = None
) -> tuple[str | None, str | None]:
    """SLM and LLM names for an official router: given ones win, else the published table.

    A loaded model without a name keeps the name the checkpoint was trained for (SLM) or none (LLM).
    """
    table = published_pair(location, subfolder)
    names = []
    for given, index, fallback in ((slm, 0, trained_for), (llm, 1, None)):
        if isinstance(given, str):
            names.append(given)
        elif given is not None:
            names.append(getattr(given, "name_or_path", None) or fallback)
        else:
            names.append(table[index] if table else None)
    if (slm is None or llm is None) and table is None:
        known = ", ".join(sorted({f"{r}/{s}" if s else r for r, s in PUBLISHED_ROUTERS}))
        raise ValueError(
            f"{location} is not a published router location, so its SLM and LLM are unknown; pass "
            "slm= and llm= (each a Hub id, a folder or a loaded model). "
            f"Known locations: {known}."
        )
    return names[0], names[1]


def official_router(
    path: str, location: str | os.PathLike, subfolder: str | None, slm: Any, llm: Any
) -> tuple[R2RConfig, dict[str, torch.Tensor], dict[str, Any], str]:
    """Config, ``router.*`` weights, record and source name of the official router file at ``path``.

    Args:
        path: the ``.pt`` file (local, or downloaded from ``location``).
        location: what the user named: a file, a folder or a Hub repo.
        subfolder: folder inside the repo.
        slm, llm: names or loaded models given by the user (None: the published-router table).
    """
    checkpoint = read_official_checkpoint(path)
    trained_for = (checkpoint.get("init_args") or {}).get("pretrained_model_name")
    slm_name, llm_name = resolve_pair(location, subfolder, slm, llm, trained_for)
    local = os.path.exists(str(location))
    source = str(location) if local else "/".join(part for part in (str(location), subfolder, Path(path).name) if part)
    config, state, record = official_config_and_weights(checkpoint, slm_name, llm_name, source)
    return config, state, record, source
