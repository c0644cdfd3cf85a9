"""What each model of a pair can do on R2R's fast paths, probed once per model, and why not in one true sentence.

Every path R2R takes is exact; the fast ones need something of a model, and a model that lacks it gets the slower
path with the reason said. Each such "can it" is decided here and nowhere else (``probes.py`` holds the checks), on
the model's own weights, once per model (kept in the core's notes on it), and handed down as one value: a pair's
``PairAbilities`` travels on its ``RoutedPair`` (``R2RForCausalLM.routed_pair`` builds it), and the loop, the fast
path and the server read it instead of probing.

* ``slots``     it decodes in the server's slots: each row at its own length over one prepared mask
                (``layouts/slot_cache.py``); else the server decodes its answers one at a time on HF's caches;
* ``capture``   its reads can be captured with fixed shapes (the server's slots: ``fast/slot_reads.py``); else its
                steps run eagerly;
* ``static``    they can be captured over HF's static cache too (``generate``'s captured path:
                ``fast/static_reads.py``); else ``generate``'s steps run eagerly;
* ``fuse``      its decoder layers run as R2R's fused regions (``fast/fused.py``); else its captured reads are HF's
                forward;
* ``rollback``  its cache can be cut back to an earlier token exactly (speculation: ``speculation.py``); else the
                pair decodes without speculation (the same answers);
* ``continues`` its forward over several tokens continues the state its cache holds; else R2R reads it one token at
                a time past its prompt (transformers' Mamba and FalconMamba scans start such a read from zero).

Each is a ``str | None``: None where the model can, else the reason as a clause about the model ("its attention is
'flash_attention_2' ..."); ``PairAbilities`` says it as a sentence naming the model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .layouts.model_calls import layer_kinds
from .notes import notes
from .probes import capture_problem, continues_problem, fuse_problem, rollback_problem, slot_problem, static_problem

# Each ability, as a sentence says a model lacks it.
ABILITIES = {"slots": "cannot decode in slots", "capture": "cannot be captured",
             "static": "cannot be captured over HF's static cache", "fuse": "cannot be fused",
             "rollback": "cannot be cut back"}


@dataclass(frozen=True)
class Abilities:
    """One model's abilities (see the module docstring): None where it can, else why not.

    Args:
        model: the model as a sentence names it: its class and its ``model_type``.
        kinds: what its layers keep in a cache (``model_calls.layer_kinds``: "attention", "recurrent").
        measured: what the probes measured (``slot_read_max_rel``: the largest logit gap of a read in slots against
            a plain forward, over the largest logit; ``fuse_max_rel`` and ``fuse_tolerance``: the fused read's).
        module: the model itself, weakly (``fuse`` probes it when first asked).
    """

    model: str
    kinds: frozenset[str]
    slots: str | None
    capture: str | None
    static: str | None
    rollback: str | None
    continues: str | None
    measured: dict[str, float | None] = field(default_factory=dict, compare=False)
    module: weakref.ref | None = field(default=None, repr=False, compare=False)

    @property
    def fuse(self) -> str | None:
        """Why its reads cannot be fused, probed when a path first asks: the probe packs the model's projection
        weights into the layout fused reads run over (``fused.layer_weights``), which a model that is never fused
        should not have done to it."""
        model = self.module()
        known = notes(model)
        if "fuse_problem" not in known:
            known["fuse_problem"] = fuse_problem(model, self.measured, self.slots is None)
        return known["fuse_problem"]


def abilities(model: torch.nn.Module) -> Abilities:
    """``model``'s abilities, probed on first use and kept in the core's notes on it."""
    known = notes(model)
    if "abilities" not in known:
        measured: dict[str, float | None] = {}
        capture, continues = capture_problem(model), continues_problem(model)
        known["abilities"] = Abilities(
            model=f"{type(model).__name__} ({model.config.model_type!r})", kinds=layer_kinds(model),
            slots=slot_problem(model, measured, continues), capture=capture, static=capture or static_problem(model),
            rollback=rollback_problem(model, continues), continues=continues,
            measured=measured, module=weakref.ref(model))
    return known["abilities"]


@dataclass(frozen=True)
class PairAbilities:
    """What the pair can do: each path needs both models (see the module docstring)."""

    slm: Abilities
    llm: Abilities

    @classmethod
    def of(cls, slm: torch.nn.Module, llm: torch.nn.Module) -> PairAbilities:
        return cls(abilities(slm), abilities(llm))

    def why_not(self, ability: str) -> str | None:
        """Why the pair cannot take ``ability`` (one of ``ABILITIES``), naming the model that cannot, or None."""
        for role, model in (("SLM", self.slm), ("LLM", self.llm)):
            why = getattr(model, ability)
            if why is not None:
                return f"the {role}, {model.model}, {ABILITIES[ability]}: {why}"
        return None

    @property
    def stepwise(self) -> dict[str, str | None]:
        """Per model ("slm", "llm"), why it reads one token at a time past its prompt (``continues``), or None."""
        return {"slm": self.slm.continues, "llm": self.llm.continues}

    @property
    def slots(self) -> str | None:
        """Why the server cannot decode this pair in slots, or None."""
        return self.why_not("slots")

    def speculation(self, slots: bool = False) -> str | None:
        """Why the pair cannot speculate, as the sentence R2R says (once), or None where both models can: in ``slots``
        (the server's: a rollback there restores R2R's own checkpoints, exact wherever the models decode in slots:
        ``layouts/slot_state.py``), or on HF's caches (``generate``'s rectangle: its ``rollback``)."""
        if slots and self.slots is None:
            return None
        for model in (self.slm, self.llm):
            if model.rollback is not None:
                return (f"speculation is off for {model.model}: {model.rollback}; R2R decodes "
                        "it without speculation (the same answers), and a transformer SLM and LLM (Llama, Qwen, "
                        "Gemma, Mistral...) can speculate.")
        return None
