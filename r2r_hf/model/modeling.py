"""R2RForCausalLM: a router plus the SLM and LLM it routes between, behind HF ``generate``.

Only the router is a registered submodule. The SLM and LLM are held as one ``core.pair.ModelPair``
value (why: that module's docstring), so ``.to()``, ``state_dict()``, ``save_pretrained`` and
``push_to_hub`` touch the router alone and a router checkpoint stays a few hundred MB at most.

Generation is HF's own ``generate`` with the R2R loop in ``_sample`` (``hf_generate.R2RGenerationMixin``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

from ..compat import warn_if_untested
from ..config import R2RConfig
from ..core.abilities import PairAbilities
from ..core.fast.store import CaptureStore
from ..core.features import output_device
from ..core.pair import ModelPair, RoutedPair
from ..router import Router, build_router, init_router_module
from .generation import pair_generation_config, saved_router_entries
from .hf_generate import R2RGenerationMixin
from .hub import HUB_KWARGS, check_is_router, check_router_location, commit_folder, split_hub_path, staging_folder
from .loading import (
    check_router_fits,
    config_from_models,
    is_loaded_model,
    load_base_model,
    shared_vocab_size,
    split_loading_kwargs,
)
from .model_card import CARD_MARKER, render_model_card
from .official import find_official_file, official_router
from .record import RouterRecord, from_legacy_config, read_record, write_record
from .sources import Unavailable, resolve
from .weights import load_router_state, load_strictly, refuse_baseline_weights


class R2RForCausalLM(PreTrainedModel, R2RGenerationMixin):
    """Token-level routing between a small and a large causal LM (R2R, arXiv 2505.21600).

    Build one with ``from_pretrained(router_repo)`` (loads the SLM and LLM the config
    names), ``from_pretrained(router_repo, slm=..., llm=...)`` or ``from_models(slm, llm)``.

    Attributes:
        record: how the router was trained, calibrated and evaluated (``router_metrics.json``).
        capture_store: captured decoding steps and their static caches, kept between calls
            (filled only by ``cache_implementation="static"`` calls on CUDA or with a ``compile_config``).

    Args:
        config: the router and pair description.
    """

    config_class = R2RConfig
    base_model_prefix = "r2r"
    main_input_name = "input_ids"
    _supported_generation_modes = [GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE]
    _no_split_modules: list[str] = []

    def __init__(self, config: R2RConfig) -> None:
        super().__init__(config)
        self.router: Router = build_router(config)
        self._pair: ModelPair | None = None  # the SLM and LLM (core/pair.py: why they are not submodules)
        self.record: RouterRecord = from_legacy_config(getattr(config, "legacy_record", {}))
        self.capture_store = CaptureStore()
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        init_router_module(module)

    # ----------------------------------------------------------------- the pair
    @property
    def slm(self) -> PreTrainedModel:
        """The small model: writes every token the router does not route."""
        if self._pair is None:
            raise ValueError(_NOT_ATTACHED)
        return self._pair.slm

    @property
    def llm(self) -> PreTrainedModel:
        """The large model: writes the routed tokens."""
        if self._pair is None:
            raise ValueError(_NOT_ATTACHED)
        return self._pair.llm

    @property
    def shared_vocab_size(self) -> int | None:
        """The ids both models can write (the smaller head's width); None before a pair is attached."""
        return None if self._pair is None else self._pair.vocab_size

    def routed_pair(self) -> RoutedPair:
        """The pair with this router: what a call's steps run (``core.routing.Routing.for_call``), with what the
        models can do (``core.abilities``: probed once per model, on the first call)."""
        return RoutedPair(self.slm, self.llm, self.router, self.config.num_topk_logits, self.shared_vocab_size,
                          PairAbilities.of(self.slm, self.llm))

    def set_models(self, slm: PreTrainedModel, llm: PreTrainedModel) -> None:
        """Attach (or replace) the SLM and LLM after checking they fit this router.

        Args:
            slm: the small causal LM the router reads features from.
            llm: the large causal LM; must share the SLM's tokenizer.
        """
        for role, model in (("slm", slm), ("llm", llm)):
            if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
                raise ValueError(f"{role} must be a transformers causal LM (with an lm_head), got {type(model).__name__}.")
        check_router_fits(self.config, slm)
        warn_if_untested()
        self._pair = ModelPair(slm, llm, shared_vocab_size(slm, llm))  # a value, not submodules (core/pair.py)
        self.capture_store.clear()
        # The router lives where the SLM's features appear; it stays float32 (it is small).
        self.router.to(output_device(slm))
        # Defaults (EOS ids, pad, recommended sampling) are the LLM's, so always-routing
        # behaves exactly like llm.generate; the router's own entries (its threshold) stay.
        self.generation_config = pair_generation_config(llm.generation_config, self.generation_config)

    @property
    def device(self) -> torch.device:
        param = next(self.router.parameters(), None)
        if param is not None:
            return param.device
        return output_device(self._pair.slm) if self._pair is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        param = next(self.router.parameters(), None)
        return param.dtype if param is not None else torch.float32

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs: Any):
        """Not a model of its own: ``generate`` runs the SLM, the router and the LLM. The signature is what HF's
        ``generate`` reads to prepare a call's inputs: the attention mask from the pad token and each row's
        positions from its first real token, as it prepares them for ``slm.generate``."""
        raise TypeError("R2RForCausalLM has no forward of its own; call model.generate(...), or model.slm / "
                        "model.llm for a plain forward of one model.")

    def extra_repr(self) -> str:
        return f"slm={self.config.slm_name_or_path!r}, llm={self.config.llm_name_or_path!r}, threshold={self.config.threshold}"

    # ---------------------------------------------------------------- building
    @classmethod
    def from_models(cls, slm: PreTrainedModel, llm: PreTrainedModel, **config_kwargs: Any) -> R2RForCausalLM:
        """A fresh (untrained) router sized from ``slm``, with both models attached.

        Args:
            slm: the small model; its hidden and embedding widths size the router.
            llm: the large model.
            config_kwargs: any ``R2RConfig`` field (threshold, router_hidden_dims...).
        """
        model = cls(config_from_models(slm, llm, **config_kwargs)).eval()
        model.set_models(slm, llm)
        return model

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args: Any,
        slm: str | PreTrainedModel | None = None,
        llm: str | PreTrainedModel | None = None,
        slm_kwargs: dict[str, Any] | None = None,
        llm_kwargs: dict[str, Any] | None = None,
        load_pair: bool = True,
        **kwargs: Any,
    ) -> R2RForCausalLM:
        """Load a router, then the SLM and LLM its config names (or the ones given).

        Args:
            pretrained_model_name_or_path: Hub id or folder holding ``config.json`` and ``model.safetensors``
                (loaded strictly: every tensor the config describes, nothing else), or an official R2R ``.pt``
                router (file, folder, Hub repo, or ``"org/repo/folder/file.pt"`` as the official configs write it).
            slm: a loaded model, or a Hub id / folder that replaces the config's SLM.
            llm: a loaded model, or a Hub id / folder that replaces the config's LLM.
            slm_kwargs: extra ``AutoModelForCausalLM.from_pretrained`` arguments for the SLM.
            llm_kwargs: the same for the LLM (e.g. ``device_map``, ``quantization_config``).
            load_pair: set False to load the router alone (to inspect, calibrate or push it).
            kwargs: router loading arguments (revision, subfolder, cache_dir, token...);
                ``dtype``, ``device_map`` and ``attn_implementation`` here apply to both models.
        """
        # The official configs name a router as "org/repo/folder/file.pt".
        location, subfolder, filename = split_hub_path(pretrained_model_name_or_path, kwargs.get("subfolder"))
        if subfolder:
            kwargs["subfolder"] = subfolder
        # A name the Hub cannot serve here: the cache, a registered local copy, or one sentence now (no retries).
        asked = {k: kwargs.pop(k) for k in ("local_files_only", "revision", "cache_dir") if k in kwargs}
        try:
            location, found = resolve(location, "the router", asked, filename=None)
        except Unavailable as err:
            check_router_location(location)  # a missing local path says so in its own words
            raise OSError(f"Could not load the router {location!r}: {err.reason}; pass a local router folder, or run "
                          "once where the Hub is reachable to cache it.") from None
        kwargs.update(found)
        check_router_location(location)
        router_kwargs, slm_load, llm_load = split_loading_kwargs(kwargs, slm_kwargs, llm_kwargs)
        hub = {k: router_kwargs[k] for k in HUB_KWARGS + ("revision", "subfolder") if k in router_kwargs}
        config = router_kwargs.pop("config", None)
        official = None if config is not None else find_official_file(location, hub.get("subfolder"), hub, filename)
        if official:  # a router published as an official R2R .pt file: convert it on the fly
            model = cls._from_official_file(official, location, hub.get("subfolder"), slm, llm)
            for key, value in router_kwargs.items():
                if key not in hub and hasattr(model.config, key):
                    setattr(model.config, key, value)
            config = model.config
            slm = slm if is_loaded_model(slm) else None
            llm = llm if is_loaded_model(llm) else None
        else:
            if config is None:
                check_is_router(R2RConfig.get_config_dict(location, **dict(router_kwargs))[0], location)
                config, router_kwargs = R2RConfig.from_pretrained(location, return_unused_kwargs=True, **router_kwargs)
                router_kwargs.update(hub)
            if config.router_type == "mlp":
                model = load_strictly(super().from_pretrained, location, *model_args, config=config, **router_kwargs)
            else:  # baseline routers have no weights to load
                refuse_baseline_weights(location, config.router_type, hub)
                model = cls(config).eval()
            model.record.update(read_record(location, hub))
            for name, value in saved_router_entries(location, hub).items():
                if name not in kwargs:  # from_pretrained(router, threshold=0.3) means 0.3
                    setattr(model.generation_config, name, value)
        if not load_pair:
            return model
        if not is_loaded_model(slm):
            slm = load_base_model("slm", slm or config.slm_name_or_path, None if slm else config.slm_revision, slm_load)
        if not is_loaded_model(llm):
            llm = load_base_model("llm", llm or config.llm_name_or_path, None if llm else config.llm_revision, llm_load)
        model.set_models(slm, llm)
        return model

    @classmethod
    def from_official(
        cls,
        source: str | os.PathLike,
        subfolder: str | None = None,
        slm: str | PreTrainedModel | None = None,
        llm: str | PreTrainedModel | None = None,
        **hub_kwargs: Any,
    ) -> R2RForCausalLM:
        """A router (no models attached) converted from an official R2R ``.pt`` checkpoint.

        The file is read with ``torch.load(weights_only=True)`` only. Use
        ``from_pretrained`` to also load the pair, or ``save_pretrained`` to keep the conversion.

        Args:
            source: a ``.pt`` file, a folder, a Hub repo (e.g. ``"nics-efc/R2R_router"``) or a file in one
                (``"nics-efc/R2R_router_collections/Qwen3-0.6B+Qwen3-32B/default_router.pt"``).
            subfolder: folder inside the repo (e.g. ``"Qwen3-0.6B+Qwen3-8B"``).
            slm, llm: names or loaded models; default: the published-router table.
            hub_kwargs: revision, cache_dir, token, local_files_only.
        """
        source, subfolder, filename = split_hub_path(source, subfolder)
        path = find_official_file(source, subfolder, hub_kwargs, filename)
        if path is None:
            raise ValueError(
                f"No official R2R router file (.pt) found at {source}"
                f"{'/' + subfolder if subfolder else ''} (it holds an r2r router config.json, or no .pt file)."
            )
        return cls._from_official_file(path, source, subfolder, slm, llm)

    @classmethod
    def _from_official_file(cls, path: str, location: Any, subfolder: str | None, slm: Any, llm: Any) -> R2RForCausalLM:
        config, state, record, source = official_router(path, location, subfolder, slm, llm)
        model = cls(config)
        load_router_state(model, state, source)
        model.record = RouterRecord(record)
        return model.eval()

    # ------------------------------------------------------------ publishing
    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, repo_id: str | None = None, **kwargs: Any):
        """Save the router (``config.json``, ``model.safetensors``), its record and its model card ``README.md``.

        A README.md that r2r_hf did not write is left untouched, and no file is deleted.

        Args:
            save_directory: target folder.
            repo_id: Hub id shown in the card's usage snippet.
            kwargs: as ``PreTrainedModel.save_pretrained`` (use ``push_to_hub()`` to upload).
        """
        if kwargs.get("push_to_hub"):
            raise ValueError("save_pretrained(push_to_hub=True) is not supported; call model.push_to_hub(repo_id).")
        # HF deletes weight shards (model-0000x-of-0000y.safetensors) it does not rewrite; the folder may hold
        # files r2r_hf did not write, so HF saves into a private folder whose files are then moved in.
        # Every file is written there and renamed into place: a file that is a link (a Hugging Face cache
        # snapshot's) is replaced, never written through.
        with staging_folder(save_directory) as staging:
            result = super().save_pretrained(staging, *args, **kwargs)
            write_record(staging, self.record)
            readme = Path(save_directory, "README.md")
            if not readme.exists() or CARD_MARKER in readme.read_text(encoding="utf-8"):
                card = render_model_card(self.config, self.record, repo_id=repo_id)
                Path(staging, "README.md").write_text(card, encoding="utf-8")
        return result

    def push_to_hub(
        self,
        repo_id: str,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        **save_kwargs: Any,
    ) -> Any:
        """Upload the router, its record and its model card to the Hub (the SLM and LLM stay in their own repos).

        Args:
            repo_id: ``"org/name"``; created if missing.
            commit_message: defaults to "Upload R2R router".
            private: visibility of a newly created repo.
            token: Hub token (default: the logged-in one).
            revision: branch to push to.
            create_pr: open a pull request instead of committing.
        """
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, repo_id=repo_id, **save_kwargs)
            return commit_folder(folder, repo_id, commit_message or "Upload R2R router", private=private,
                                 token=token, revision=revision, create_pr=create_pr)


_NOT_ATTACHED = (
    "This R2RForCausalLM has no SLM/LLM attached; load it with R2RForCausalLM.from_pretrained(router, ...) "
    "or R2RForCausalLM.from_models(slm, llm), or call model.set_models(slm, llm)."
)


# ``AutoModelForCausalLM.from_pretrained(router)`` gives an R2RForCausalLM once this module is loaded
# (``import r2r_hf`` loads it).
AutoConfig.register("r2r", R2RConfig, exist_ok=True)
AutoModel.register(R2RConfig, R2RForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(R2RConfig, R2RForCausalLM, exist_ok=True)
