"""R2RForCausalLM: a router plus the SLM and LLM it routes between, behind HF ``generate``.

Only the router is a registered submodule. The SLM and LLM are attached as plain
attributes, so ``.to()``, ``state_dict()``, ``save_pretrained`` and ``push_to_hub``
touch the router alone and a router checkpoint stays a few hundred MB at most.

``generate`` is HF's own: it prepares the processors, stopping criteria, streamer and
inputs, then calls ``_sample``, which this class replaces with the R2R loop
(``decoding.r2r_decode``). Greedy and sampling both go through ``_sample``.
"""

from __future__ import annotations

import contextvars
import copy
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.configuration_utils import CompileConfig, GenerationMode

from .config import R2RConfig
from .decoding import r2r_decode
from .hub import commit_folder
from .features import HiddenStateCapture, embed_tokens, lm_forward, output_device, topk_logits
from .loading import (
    HUB_KWARGS,
    check_router_fits,
    config_from_models,
    is_loaded_model,
    load_base_model,
    shared_vocab_size,
    split_loading_kwargs,
)
from .model_card import CARD_MARKER, render_model_card
from .official import find_official_file, official_config_and_weights, read_official_checkpoint, resolve_pair
from .outputs import R2RForwardOutput
from .router import MLPRouter, Router, build_router, init_router_module

# The threshold of the generate call in progress. A context variable (not an attribute) keeps
# concurrent generate calls from different threads apart.
_CALL_THRESHOLD: contextvars.ContextVar[float | None] = contextvars.ContextVar("r2r_threshold", default=None)

# Options of HF generate that R2R cannot honour, with the reason given to the user.
_UNSUPPORTED = {
    "num_beams": "beam search",
    "num_beam_groups": "group beam search",
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "prompt_lookup_num_tokens": "prompt lookup decoding",
    "guidance_scale": "classifier-free guidance",
    "output_attentions": "returning attentions (two models write the tokens)",
    "output_hidden_states": "returning hidden states (two models write the tokens)",
    "assistant_model": "assisted generation",
    "custom_generate": "a custom decoding loop would replace R2R's",
    "past_key_values": "R2R keeps one cache per model",
}
_NEUTRAL_VALUES = {"num_beams": 1, "num_beam_groups": 1, "guidance_scale": 1.0}
_CACHES = (None, "dynamic", "static")


def refuse_unsupported(options: dict[str, Any]) -> None:
    """Raise one ValueError naming every generate option R2R cannot honour."""
    problems = []
    for name, what in _UNSUPPORTED.items():
        value = options.get(name)
        if value is not None and value is not False and value != 0 and value != _NEUTRAL_VALUES.get(name):
            shown = type(value).__name__ if isinstance(value, torch.nn.Module) else repr(value)
            problems.append(f"{name}={shown} ({what})")
    if options.get("cache_implementation") not in _CACHES:
        problems.append(f"cache_implementation={options['cache_implementation']!r} (use 'dynamic' or 'static')")
    if problems:
        raise ValueError(
            f"R2RForCausalLM.generate cannot honour {', '.join(problems)}: R2R writes one token per step, "
            "greedy or sampled, with one cache per model. Remove the option."
        )


class R2RForCausalLM(PreTrainedModel, GenerationMixin):
    """Token-level routing between a small and a large causal LM (R2R, arXiv 2505.21600).

    Build one with ``from_pretrained(router_repo)`` (loads the SLM and LLM the config
    names), ``from_pretrained(router_repo, slm=..., llm=...)`` or ``from_models(slm, llm)``.

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
        object.__setattr__(self, "_slm", None)
        object.__setattr__(self, "_llm", None)
        object.__setattr__(self, "shared_vocab_size", None)
        object.__setattr__(self, "_compiled_router", None)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        init_router_module(module)

    # ----------------------------------------------------------------- the pair
    @property
    def slm(self) -> PreTrainedModel:
        """The small model: writes every token the router does not route."""
        if self._slm is None:
            raise ValueError(_NOT_ATTACHED)
        return self._slm

    @property
    def llm(self) -> PreTrainedModel:
        """The large model: writes the routed tokens."""
        if self._llm is None:
            raise ValueError(_NOT_ATTACHED)
        return self._llm

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
        vocab = shared_vocab_size(slm, llm)
        object.__setattr__(self, "_slm", slm)
        object.__setattr__(self, "_llm", llm)
        object.__setattr__(self, "shared_vocab_size", vocab)
        # The router lives where the SLM's features appear; it stays float32 (it is small).
        self.router.to(output_device(slm))
        # Defaults (EOS ids, pad, recommended sampling) are the LLM's, so always-routing
        # behaves exactly like llm.generate.
        self.generation_config = copy.deepcopy(llm.generation_config)

    @property
    def device(self) -> torch.device:
        param = next(self.router.parameters(), None)
        if param is not None:
            return param.device
        return output_device(self._slm) if self._slm is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        param = next(self.router.parameters(), None)
        return param.dtype if param is not None else torch.float32

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
        config = config_from_models(slm, llm, **config_kwargs)
        model = cls(config)
        model.eval()
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
            pretrained_model_name_or_path: Hub id or folder holding ``config.json`` and ``model.safetensors``.
            slm: a loaded model, or a Hub id / folder that replaces the config's SLM.
            llm: a loaded model, or a Hub id / folder that replaces the config's LLM.
            slm_kwargs: extra ``AutoModelForCausalLM.from_pretrained`` arguments for the SLM.
            llm_kwargs: the same for the LLM (e.g. ``device_map``, ``quantization_config``).
            load_pair: set False to load the router alone (to inspect, calibrate or push it).
            kwargs: router loading arguments (revision, subfolder, cache_dir, token...);
                ``dtype``, ``device_map`` and ``attn_implementation`` here apply to both models.
        """
        router_kwargs, slm_load, llm_load = split_loading_kwargs(kwargs, slm_kwargs, llm_kwargs)
        hub = {k: router_kwargs[k] for k in HUB_KWARGS + ("revision", "subfolder") if k in router_kwargs}
        config = router_kwargs.pop("config", None)
        official = None if config is not None else find_official_file(pretrained_model_name_or_path, hub.get("subfolder"), hub)
        if official:  # a router published as an official R2R .pt file: convert it on the fly
            model = cls._from_official_file(official, pretrained_model_name_or_path, hub.get("subfolder"), slm, llm)
            for key, value in router_kwargs.items():
                if key not in hub and hasattr(model.config, key):
                    setattr(model.config, key, value)
            config = model.config
            slm = slm if is_loaded_model(slm) else None
            llm = llm if is_loaded_model(llm) else None
        else:
            if config is None:
                config, router_kwargs = R2RConfig.from_pretrained(
                    pretrained_model_name_or_path, return_unused_kwargs=True, **router_kwargs
                )
                router_kwargs.update(hub)
            if config.router_type == "mlp":
                model = super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **router_kwargs)
            else:  # baseline routers have no weights to load
                model = cls(config).eval()
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
            source: a ``.pt`` file, a folder, or a Hub repo (e.g. ``"nics-efc/R2R_router"``).
            subfolder: folder inside the repo (e.g. ``"Qwen3-0.6B+Qwen3-8B"``).
            slm, llm: names or loaded models; default: the published-router table.
            hub_kwargs: revision, cache_dir, token, local_files_only.
        """
        path = find_official_file(source, subfolder, hub_kwargs)
        if path is None:
            raise ValueError(
                f"No official R2R router file (.pt) found at {source}"
                f"{'/' + subfolder if subfolder else ''} (it holds a config.json or no .pt file)."
            )
        return cls._from_official_file(path, source, subfolder, slm, llm)

    @classmethod
    def _from_official_file(cls, path: str, location: Any, subfolder: str | None, slm: Any, llm: Any) -> R2RForCausalLM:
        checkpoint = read_official_checkpoint(path)
        trained_for = (checkpoint.get("init_args") or {}).get("pretrained_model_name")
        slm_name, llm_name = resolve_pair(location, subfolder, slm, llm, trained_for)
        source = str(location) if os.path.exists(str(location)) else "/".join(
            part for part in (str(location), subfolder, Path(path).name) if part
        )
        config, state = official_config_and_weights(checkpoint, slm_name, llm_name, source)
        model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{source} does not match the R2R router layout: missing {sorted(missing)}, unexpected {sorted(unexpected)}."
            )
        return model.eval()

    # ------------------------------------------------------------ publishing
    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, repo_id: str | None = None, **kwargs: Any):
        """Save the router (``config.json``, ``model.safetensors``) and its model card ``README.md``.

        A README.md that r2r_hf did not write is left untouched.

        Args:
            save_directory: target folder.
            repo_id: Hub id shown in the card's usage snippet.
            kwargs: as ``PreTrainedModel.save_pretrained``.
        """
        result = super().save_pretrained(save_directory, *args, **kwargs)
        readme = Path(save_directory, "README.md")
        if not readme.exists() or CARD_MARKER in readme.read_text(encoding="utf-8"):
            readme.write_text(render_model_card(self.config, repo_id=repo_id), encoding="utf-8")
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
        """Upload the router and its model card to the Hub (the SLM and LLM stay in their own repos).

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

    # -------------------------------------------------------------- generation
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *args: Any,
        threshold: float | None = None,
        **kwargs: Any,
    ):
        """HF ``generate`` with R2R routing; every HF generate argument keeps its meaning.

        Args:
            inputs: prompt ids [B, P] (left-padded for batches), or pass ``input_ids=``.
            threshold: route to the LLM where the router's score >= threshold, for this call only
                (default: ``config.threshold``). ``0.0`` routes every token, ``float("inf")`` none.
            kwargs: anything HF ``generate`` accepts (max_new_tokens, do_sample, streamer,
                stop_strings with tokenizer, logits_processor, return_dict_in_generate...).

        Returns:
            The sequences, or with ``return_dict_in_generate=True`` an ``R2RGenerateOutput``
            that adds ``routed``, ``router_scores``, ``generated_mask`` and ``llm_token_rate``.
        """
        self.slm, self.llm  # noqa: B018 - raises a clear error when no models are attached
        if threshold is None:
            threshold = self.config.threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
            raise ValueError(f"threshold must be a number (route where score >= threshold), got {threshold!r}.")
        # HF diverts some modes (contrastive, DoLa, custom_generate) before its own validation.
        refuse_unsupported({**(generation_config.to_dict() if generation_config else {}), **kwargs})
        token = _CALL_THRESHOLD.set(float(threshold))
        try:
            return super().generate(inputs, generation_config, *args, **kwargs)
        finally:
            _CALL_THRESHOLD.reset(token)

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs) -> None:
        # Private HF hook (tests/test_hf_internals.py guards it): here the call's final generation
        # config is known, including options inherited from model.generation_config.
        options = {name: getattr(generation_config, name, None) for name in _UNSUPPORTED}
        options["cache_implementation"] = generation_config.cache_implementation
        options["assistant_model"] = generation_mode_kwargs.get("assistant_model")
        refuse_unsupported(options)
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _prepare_cache_for_generation(self, *args: Any, **kwargs: Any) -> None:
        # Private HF hook: the R2R loop builds one cache per model itself.
        return None

    def _sample(
        self,
        input_ids: torch.LongTensor,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus: bool = False,
        streamer=None,
        **model_kwargs: Any,
    ):
        # Private HF hook: generate() dispatches greedy and sampling here.
        if synced_gpus:
            raise ValueError("R2RForCausalLM.generate does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP).")
        threshold = _CALL_THRESHOLD.get()
        compiled_slm, router_fn = self._compiled_steps(generation_config)
        return r2r_decode(
            self.slm,
            self.llm,
            self.router,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            threshold=self.config.threshold if threshold is None else threshold,
            vocab_size=self.shared_vocab_size,
            num_topk_logits=self.config.num_topk_logits,
            attention_mask=model_kwargs.get("attention_mask"),
            position_ids=model_kwargs.get("position_ids"),
            streamer=streamer,
            compiled_slm=compiled_slm,
            router_scores_fn=router_fn,
        )

    def _compiled_steps(self, generation_config) -> tuple[Any, Any]:
        """Compiled SLM one-token step and router, when the call allows and asks for them.

        As in HF generate: only with a static cache, never with ``disable_compile``, automatically
        on CUDA/XPU, and on other devices when a ``compile_config`` is given. The LLM's catch-up
        (variable length) stays eager.
        """
        if generation_config.cache_implementation != "static" or generation_config.disable_compile:
            return None, None
        config = generation_config.compile_config
        if config is None and output_device(self.slm).type not in ("cuda", "xpu"):
            return None, None
        placements = set(getattr(self.slm, "hf_device_map", {}).values())
        if getattr(self.slm, "hf_quantizer", None) is not None or len(placements) > 1:
            return None, None
        config = config or CompileConfig()
        compiled_slm = self.slm.get_compiled_call(config)
        if not isinstance(self.router, MLPRouter):  # baselines are cheap (and the random one is stateful)
            return compiled_slm, None
        key = (config.fullgraph, config.dynamic, config.backend, config.mode, id(self.router))
        if self._compiled_router is None or self._compiled_router[0] != key:
            options = {k: v for k, v in config.to_dict().items() if k in ("fullgraph", "dynamic", "backend", "mode", "options")}
            object.__setattr__(self, "_compiled_router", (key, torch.compile(self.router.scores, **options)))
        return compiled_slm, self._compiled_router[1]

    # ------------------------------------------------------------ scoring
    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> R2RForwardOutput:
        """Teacher-forced scoring: the SLM's logits and the router's score at every position.

        The score at position i is for the SLM's greedy proposal of token i + 1, i.e. what
        the router would decide if the SLM proposed its argmax there.

        Args:
            input_ids: [B, T] token ids.
            attention_mask: [B, T], 0 on (left) padding.
            position_ids: [B, T]; derived from the mask when omitted.
        """
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        with HiddenStateCapture(self.slm) as capture:
            logits = lm_forward(self.slm, input_ids, attention_mask, position_ids, cache=None, logits_to_keep=0)
            hidden = capture.hidden
        proposal = logits[..., : self.shared_vocab_size].argmax(-1)
        batch, length = input_ids.shape
        flat = lambda x: x.reshape(batch * length, -1)  # noqa: E731
        device = self.device
        scores = self.router.scores(
            flat(topk_logits(logits, self.config.num_topk_logits)).to(device),
            flat(embed_tokens(self.slm, proposal)).to(device),
            flat(hidden).to(device),
        )
        return R2RForwardOutput(logits=logits, router_scores=scores.reshape(batch, length))


_NOT_ATTACHED = (
    "This R2RForCausalLM has no SLM/LLM attached; load it with R2RForCausalLM.from_pretrained(router, ...) "
    "or R2RForCausalLM.from_models(slm, llm), or call model.set_models(slm, llm)."
)
