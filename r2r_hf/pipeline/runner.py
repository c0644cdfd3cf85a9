"""``label``: run the labeling steps over a prompts file, resumably, on one or many processes.

Prompts are cut into shards of ``batch_size``; shard k always holds the same prompts, so
its results do not depend on how many processes share the work. Under ``accelerate
launch`` process i takes shards i, i + n, ... for steps 0-3; the main process then writes
the labels and the summary. Every shard is written atomically and skipped on a rerun.

Steps 0-2 (responses, features, continuations) depend only on the run's settings (the
manifest); steps 3-4 (verdicts, labels) on the verifier chain, and write a label set of their
own. Relabeling a run with other verifiers reuses steps 0-2 and every verifier's earlier verdicts.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..model.loading import load_base_model
from ..model.sources import Unavailable, resolve
from ..model.tokens import check_same_tokenizer, special_ids, tokenizer_fingerprint
from .dataset import check_label_set, write_label_set
from .prompts import Prompt, check_context, read_prompts
from .sentences import compare_sentences, mismatch_texts, sentence_end_ids
from .settings import RUN_FIELDS, LabelSettings  # noqa: F401 - LabelSettings is imported from here too
from .shards import plan_shards
from .steps import BY_NAME, CONTINUATIONS, LABELS, NAMES, RESPONSES, VERDICTS, Step
from .store import FORMAT, WorkDir, read_json
from .stream import STEPS as STREAMED, Stream
from .verifiers import MODEL_FREE, JudgeVerifier, Mismatch
from .verifiers.chain import ShardDecisions, judge_shard, read_decisions

@functools.lru_cache(maxsize=16)
def _where(name: str, role: str) -> tuple[str, tuple]:
    """Where a model of the run is read from (a folder, the cache, a registered copy; ``model.sources``), once per name.

    Raises ``Unavailable`` (the caller says what could not be loaded).
    """
    found, hub = resolve(name, f"the {role}", {})
    return str(found), tuple(sorted(hub.items()))


def _load_tokenizer(name: str, role: str):
    try:
        path, hub = _where(name, role)
        return AutoTokenizer.from_pretrained(path, **dict(hub))
    except Unavailable as err:
        raise OSError(f"Could not load the {role} tokenizer from {name!r}: {err.reason}; pass {role.lower()}= a local "
                      "folder or a Hub id.") from None
    except (OSError, ValueError) as err:
        raise OSError(f"Could not load the {role} tokenizer from {name!r}: {str(err).splitlines()[0]}") from err


def _text_config(name: str, role: str):
    """A model's (text) config, read without loading its weights."""
    try:
        path, hub = _where(name, role)
        return AutoConfig.from_pretrained(path, **dict(hub)).get_text_config()
    except Unavailable as err:
        raise OSError(f"Could not read the config of {name!r}: {err.reason}.") from None
    except (OSError, ValueError) as err:
        raise OSError(f"Could not read the config of {name!r}: {str(err).splitlines()[0]}") from err


def _process_state():
    """(index, count, barrier, device) of this process; accelerate when launched by it, else a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import PartialState

        # Without GPUs accelerate forms a process group only when told it is on the CPU (gloo).
        # Steps take hours and processes may reach a barrier far apart: wait up to a day, not 30 minutes.
        state = PartialState(cpu=not torch.cuda.is_available(), timeout=datetime.timedelta(hours=24))
        return state.process_index, state.num_processes, state.wait_for_everyone, state.device
    return 0, 1, (lambda: None), None


class _Models:
    """Loads each model once, on first use."""

    def __init__(self, settings: LabelSettings, device) -> None:
        self.settings, self.device, self._cache = settings, device, {}

    def get(self, name: str, role: str = "model"):
        if name not in self._cache:
            try:
                path, hub = _where(name, role)  # resolved once per name (a registered copy says so once)
            except Unavailable:
                path, hub = name, ()  # load_base_model says it in its own words
            model = load_base_model(role.lower(), path, None, {"dtype": getattr(torch, self.settings.dtype), **dict(hub)},
                                    hint=f"pass {role.lower()}= a local folder or a Hub id")
            model.eval()
            if self.device is not None:
                model.to(self.device)
            self._cache[name] = model
        return self._cache[name]


def label(
    settings: LabelSettings,
    prompts_path: str | os.PathLike,
    out: str | os.PathLike,
    limit: int | None = None,
    steps: tuple[str, ...] = NAMES,
    progress: bool = True,
) -> dict | None:
    """Label the SLM/LLM disagreements on a prompts file; returns the label set's summary (main process).

    Args:
        settings: models and settings of the run and of its verifiers.
        prompts_path: ``prompts.jsonl`` (``{"id", "prompt"}`` or ``{"id", "messages"}`` per line).
        out: the run folder; an existing one with the same run settings is resumed (or relabeled).
        limit: label only the first ``limit`` prompts.
        steps: which of ``responses, features, continuations, verdicts, labels`` to run.
        progress: show tqdm bars.
    """
    unknown = [s for s in steps if s not in BY_NAME]
    if unknown:
        raise ValueError(f"Unknown step(s) {unknown}; choose from {', '.join(NAMES)}.")
    chosen = [BY_NAME[s] for s in steps]
    # Everything that can be wrong with the input is checked before anything is written.
    slm_tok = _load_tokenizer(settings.slm, "SLM")
    llm_tok = _load_tokenizer(settings.llm, "LLM")
    prompts = read_prompts(prompts_path, limit, tokenizer=llm_tok)
    configs = [_text_config(settings.slm, "SLM"), _text_config(settings.llm, "LLM")]
    vocab = min(int(c.vocab_size) for c in configs)  # what both can write: the SLM's proposal is its argmax over it
    check_same_tokenizer(slm_tok, llm_tok, vocab, settings.slm, settings.llm)
    contexts = [c.max_position_embeddings for c in configs if getattr(c, "max_position_embeddings", None)]
    check_context(prompts, llm_tok, settings.max_new_tokens, min(contexts, default=None), prompts_path)
    judge_tok = _load_tokenizer(settings.judge, "judge") if settings.judge and "llm" in settings.chain else llm_tok
    answers = answer_ids(llm_tok, settings.llm)
    index, count, barrier, device = _process_state()
    work = WorkDir(out)
    if RESPONSES not in chosen and not work.manifest_path.exists():
        raise ValueError(f"{out} holds no labeling run yet; run the 'responses' step first (it is in the default "
                         "steps).")
    manifest = {**settings.run(), "tokenizer_hash": tokenizer_fingerprint(llm_tok), "format": FORMAT}
    # One run per folder: the main process holds the lock (the others run under it), checks the run and only
    # then records it; the others read what it recorded.
    with work.lock() if index == 0 else contextlib.nullcontext():
        if index != 0:
            barrier()
        work.check_manifest(manifest)
        shards = plan_shards(work, prompts, settings.batch_size)
        context = _Context(settings, work, llm_tok, judge_tok, _Models(settings, device), shards, answers, vocab)
        if index == 0:
            if LABELS in chosen:  # verdicts alone decide no label set (a judge's scores serve any threshold)
                check_label_set(work, settings.label_set, context.chain_settings())
            work.record_manifest(manifest)
            barrier()
        mine = [k for k in range(len(shards)) if k % count == index]
        # Steps 0-2 of this process's shards through one continuous batch, then step 3; the labels step is the main
        # process's, after all.
        early = {s for s in chosen if s in STREAMED}
        todo = [k for k in mine if any(not context.done(s, k) for s in early)]
        if todo:
            name = "answers, features, continuations"
            Stream(context, early).run(todo, f"{name} (process {index})" if count > 1 else name, progress)
        if VERDICTS in chosen:
            todo = [k for k in mine if not context.done(VERDICTS, k)]
            for k in tqdm(todo, desc=f"verdicts (process {index})" if count > 1 else "verdicts", unit="shard",
                          disable=not progress or not todo):
                context.verdicts(k)
        barrier()
        if index != 0 or LABELS not in chosen:
            return None
        missing = [k for k in range(len(shards)) if not context.done(VERDICTS, k)]
        if missing:
            raise ValueError(f"Cannot write labels: shards {missing[:5]}... lack verdicts; run the earlier steps first.")
        # Recorded only now: a judge that failed to load leaves no label set a corrected rerun would conflict with.
        check_label_set(work, settings.label_set, context.chain_settings(), record=True)
        return write_label_set(work, settings.label_set, context.chain, len(shards), context.decisions,
                               progress=progress)


class _Context:
    """Runs one step on one shard, reading the previous steps' shards."""

    def __init__(self, settings: LabelSettings, work: WorkDir, tokenizer, judge_tokenizer, models: _Models,
                 shards: list[list[Prompt]], answers: tuple[int, list[int]], vocab: int) -> None:
        self.settings, self.work, self.tokenizer, self.judge_tokenizer = settings, work, tokenizer, judge_tokenizer
        self.models, self.shards, self.vocab = models, shards, vocab
        self.pad_id, self.eos_ids = answers  # answer_ids(...)
        self._ends: frozenset[int] | None = None
        self._chain: list | None = None
        self._decisions: dict[int, ShardDecisions] = {}
        self._samples: dict[int, list[dict]] = {}

    @property
    def ends(self) -> frozenset[int]:
        if self._ends is None:
            self._ends = sentence_end_ids(self.tokenizer)
        return self._ends

    def chain_settings(self) -> list[dict[str, Any]]:
        """What decides the label set, without loading a judge: each verifier's settings."""
        s = self.settings
        return [MODEL_FREE[name](s).settings() if name in MODEL_FREE else
                {"name": "llm", "judge": s.judge or s.llm, "threshold": s.judge_threshold} for name in s.chain]

    @property
    def chain(self) -> list:
        """The verifiers of the label set (the judge is loaded on first use)."""
        if self._chain is None:
            s, chain = self.settings, []
            for name in s.chain:
                if name in MODEL_FREE:
                    chain.append(MODEL_FREE[name](s))
                else:
                    judge = s.judge or s.llm
                    chain.append(JudgeVerifier(self.models.get(judge, "judge"), self.judge_tokenizer, s.judge_threshold,
                                               s.batch_size, model_name=judge))
            self._chain = chain
        return self._chain

    def done(self, step: Step, k: int) -> bool:
        """Whether shard k needs no work for ``step`` (for verdicts: every verifier answered what it is asked)."""
        return self.decisions(k).complete if step is VERDICTS else self.work.done(step, k)

    def decisions(self, k: int) -> ShardDecisions:
        """The chain's decisions on shard k, read off its verdicts; kept once complete (they no longer change)."""
        if k not in self._decisions:
            found = read_decisions(self.work, k, self.chain, self.identical(k))
            if not found.complete:
                return found
            self._decisions[k] = found
        return self._decisions[k]

    def samples(self, k: int) -> list[dict]:
        """Shard k's responses (read once while steps 1-3 run on it)."""
        if k not in self._samples:
            path = self.require(RESPONSES, k)
            # plan_shards checked an answered shard's prompts against this prompts file; this run wrote the others.
            self._samples = {k: read_json(path, RESPONSES)["samples"]}  # the shard at hand only: steps 1-3 read it in turn
        return self._samples[k]

    def identical(self, k: int) -> list[bool]:
        return [m["identical"] for m in self.work.read(CONTINUATIONS, k)["mismatches"]]

    @torch.no_grad()
    def verdicts(self, k: int) -> None:
        """Step 3 on shard k: each verifier of the chain asked what the ones before it passed on."""
        self.require(CONTINUATIONS, k)
        items = shard_mismatches(self.work, k, self.samples(k), self.tokenizer, self.ends, self.eos_ids,
                                 self.settings.context_tokens)
        judge_shard(self.work, k, self.chain, items, self.identical(k))

    def require(self, step: Step, k: int):
        path = self.work.shard(step, k)
        if not path.exists():
            raise ValueError(f"Shard {k} has no {step} yet; run the '{step}' step first.")
        return path


def answer_ids(tokenizer, llm: str) -> tuple[int, list[int]]:
    """(pad id, end-of-answer ids) of the LLM's answers: its generation config's, else the tokenizer's."""
    try:
        generation = GenerationConfig.from_pretrained(llm)
    except OSError:  # no generation_config.json: the tokenizer's ids
        generation = None
    pad, eos = special_ids(tokenizer, generation)
    if not eos:
        raise ValueError(f"{llm!r} defines no EOS token; R2R labeling needs one to end answers.")
    return pad, eos


def shard_mismatches(work: WorkDir, k: int, samples: list[dict], tokenizer, ends: frozenset[int],
                     eos_ids: list[int], context_tokens: int) -> list[Mismatch]:
    """Shard k's mismatches as the text a verifier reads (rebuilt from the token ids a continuations shard keeps).

    Args:
        work: the run.
        k: the shard.
        samples: its step-0 samples.
        tokenizer: the pair's tokenizer.
        ends, eos_ids: sentence-end and end-of-answer ids.
        context_tokens: how much of the answer before the sentence a judge sees (the run's setting).
    """
    out, eos = [], frozenset(eos_ids)
    for i, m in enumerate(work.read(CONTINUATIONS, k)["mismatches"]):
        sample = samples[m["sample"]]
        texts = mismatch_texts(tokenizer, sample, m, ends, eos)
        sentences = compare_sentences(tokenizer, sample["response_ids"], m["position"], m["slm_token"],
                                      m["continuation"], ends, eos, context_tokens)
        out.append(Mismatch(index=i, context=sentences.context, slm_sentence=sentences.slm_sentence,
                            llm_sentence=sentences.llm_sentence, llm_logprob=m.get("llm_logprob"),
                            llm_own_logprob=m.get("llm_own_logprob"), **texts))
    return out
