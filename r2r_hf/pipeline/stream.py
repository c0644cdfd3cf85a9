"""Steps 0-2 of many shards through one continuous batch of the LLM: answers, their features, their continuations.

Prompts join the batch shard after shard; when an answer ends, the SLM reads it (its features, step 1), and a
continuation row joins for each mismatch, starting from the answer's own cache cut there (the answer is not read
again). Continuations go before new prompts, so shards finish in order and their caches are freed. A shard is
written (each step's file atomically, responses first) once its answers and continuations have all ended; a killed
run loses only the shards in flight. Steps whose shard is already written are not redone: answers on disk are read
once (a prefill) to start their continuations, features on disk are read instead of computed.

Seconds are booked per shard and step: a batch step's time is shared equally among the rows it advanced.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from ..core.features import HiddenStateCapture, lm_forward
from .batching import KV, Batch, Row, read_alone
from .continuation import continuation_row, logprobs, mismatch_positions, record
from .prefill import slm_features
from .shards import prompt_hash
from .steps import CONTINUATIONS, FEATURES, RESPONSES, Step
from .store import read_tensors, write_json, write_tensors

STEPS = (RESPONSES, FEATURES, CONTINUATIONS)
FEATURE_KEYS = ("topk_logits", "hidden", "token_embedding", "slm_token", "real_token", "sample", "position")


@dataclass
class Shard:
    """What one shard has gathered so far, and what it still waits for."""

    k: int
    prompts: list
    needed: set[Step]
    samples: list[dict | None] = field(default_factory=list)
    features: list[dict | None] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    open: int = 0  # rows of this shard (answers, continuations) that have not ended
    seconds: dict[str, float] = field(default_factory=lambda: {s.name: 0.0 for s in STEPS})
    tokens: dict[str, int] = field(default_factory=lambda: {s.name: 0 for s in STEPS})

    @property
    def complete(self) -> bool:
        return self.open == 0 and all(s is not None for s in self.samples)


@dataclass(frozen=True)
class Job:
    """What a row of the batch is for (its ``Row.key``): answer ``i`` of ``shard``, or a continuation of it at
    ``position`` after ``slm_token`` (with the LLM's log-probabilities there: of the SLM's token, of its own)."""

    shard: Shard
    i: int
    prompt_ids: tuple[int, ...] = ()
    position: int | None = None
    slm_token: int | None = None
    logprob: tuple[float, float] | None = None

    @property
    def step(self) -> str:
        return RESPONSES.name if self.position is None else CONTINUATIONS.name


def read_answer(llm, tokens: list[int], at: list[int]) -> tuple[KV, torch.Tensor]:
    """One read of an answer on disk: its cache, and the LLM's hidden states at the positions ``at``."""
    cache = DynamicCache(config=llm.config)
    with HiddenStateCapture(llm) as capture:
        lm_forward(llm, torch.tensor([tokens]), None, None, cache, logits_to_keep=torch.tensor(at or [0]))
        hidden = capture.hidden[0]
    return [(layer.keys, layer.values) for layer in cache.layers], hidden[: len(at)]


class Stream:
    """Runs steps 0-2 of a run's shards (see the module docstring). ``context`` is the runner's ``_Context``."""

    def __init__(self, context, steps: set[Step]) -> None:
        self.c, self.s, self.steps = context, context.settings, steps
        self._batch: Batch | None = None
        self.eos = frozenset(context.eos_ids)
        self.stops = self.eos | context.ends  # a continuation ends with its sentence (or the answer)
        self.waiting: deque[tuple[Row, KV]] = deque()  # continuation rows waiting for a place
        self.on_disk: deque[tuple[Shard, int]] = deque()  # answers read from disk whose continuations are to start
        self.prompts: deque[tuple[Shard, int]] = deque()
        self.ended = {RESPONSES.name: 0, CONTINUATIONS.name: 0}  # rows ended so far (the progress bar's detail)

    @property
    def llm(self):
        """The LLM, loaded on first use: features alone (a fresh copy of committed labels) need only the SLM."""
        return self.c.models.get(self.s.llm, "LLM")

    @property
    def batch(self) -> Batch:
        if self._batch is None:
            self._batch = Batch(self.llm, self.s.batch_size)
        return self._batch

    @torch.no_grad()
    def run(self, shard_ids: list[int], desc: str, progress: bool) -> None:
        pending = deque(self._open(k) for k in shard_ids)
        bar = tqdm(total=len(pending), desc=desc, unit="shard", disable=not progress or not pending)
        while pending:
            while pending and pending[0].complete:
                self._write(pending.popleft())
                bar.update(1)
            if pending:
                self._fill()
                if pending[0].complete:
                    continue
                if not self.batch.rows:
                    raise RuntimeError(f"Labeling stalled: shard {pending[0].k} waits for rows that are not queued.")
                self._step()
                bar.set_postfix({"answers": self.ended[RESPONSES.name], "continuations": self.ended[CONTINUATIONS.name]},
                                refresh=True)
        bar.close()

    def _step(self) -> None:
        """One batch step; its seconds shared equally among the rows it advanced."""
        jobs = [row.key for row in self.batch.rows]
        start = time.perf_counter()
        ended = self.batch.step(keep_cache=CONTINUATIONS in self.steps)
        share = (time.perf_counter() - start) / len(jobs)
        for job in jobs:
            job.shard.seconds[job.step] += share
        for row in ended:
            self.ended[row.key.step] += 1
            self._ended(row)

    def _open(self, k: int) -> Shard:
        """A shard's state: what it needs, its answers and features where they are on disk, its rows queued."""
        work, prompts = self.c.work, self.c.shards[k]
        needed = {s for s in self.steps if not work.done(s, k)}
        shard = Shard(k, prompts, needed, [None] * len(prompts), [None] * len(prompts))
        if not needed:
            shard.samples = [{}] * len(prompts)  # nothing to do: complete, and written as nothing
            return shard
        if RESPONSES in needed:
            self.prompts.extend((shard, i) for i in range(len(prompts)))
            shard.open += len(prompts)
            return shard
        shard.samples = list(self.c.samples(k))
        if FEATURES not in needed:
            tensors, _ = read_tensors(self.c.require(FEATURES, k), ["sample", "slm_token", "real_token"])
            for i in range(len(prompts)):
                rows = tensors["sample"] == i
                shard.features[i] = {"slm_token": tensors["slm_token"][rows], "real_token": tensors["real_token"][rows]}
        self.on_disk.extend((shard, i) for i in range(len(prompts)))
        shard.open += len(prompts)  # an answer on disk is open until its continuations are queued
        return shard

    def _fill(self) -> None:
        """Give every free place a row: continuations first, then answers read from disk, then new prompts."""
        while self.on_disk:
            shard, i = self.on_disk[0]  # its continuations wait for room; features alone never reach the batch
            if CONTINUATIONS in shard.needed and (self.waiting or not self.batch.free):
                break
            self.on_disk.popleft()
            shard.open -= 1
            self._answered(shard, i, None, None)
        while (self.waiting or self.prompts) and self.batch.free:
            if self.waiting:
                row, kv = self.waiting.popleft()
                start = time.perf_counter()
                self.batch.join(row, kv)
                row.key.shard.seconds[CONTINUATIONS.name] += time.perf_counter() - start
            else:
                shard, i = self.prompts.popleft()
                start = time.perf_counter()
                ids = shard.prompts[i].ids(self.c.tokenizer)
                row = Row(Job(shard, i, tuple(ids)), ids[-1], self.s.max_new_tokens, self.eos,
                          keep_hidden=CONTINUATIONS in self.steps)
                self.batch.join(row, read_alone(self.llm, ids[:-1]))
                shard.seconds[RESPONSES.name] += time.perf_counter() - start

    def _ended(self, row: Row) -> None:
        job, shard = row.key, row.key.shard
        shard.open -= 1
        if job.position is not None:
            sample = shard.samples[job.i]
            shard.records.append(record(self.c.tokenizer, sample, job.i, job.position, job.slm_token, row.written,
                                        self.c.ends, self.eos, self.s.context_tokens, job.logprob))
            shard.tokens[CONTINUATIONS.name] += len(row.written) + 1
            return
        shard.samples[job.i] = {"id": shard.prompts[job.i].id, "prompt_ids": list(job.prompt_ids),
                                "response_ids": row.written, "finished": row.written[-1] in self.eos}
        shard.tokens[RESPONSES.name] += len(row.written)
        self._answered(shard, job.i, row.kv, torch.stack(row.hidden) if row.hidden else None)
        row.kv, row.hidden = None, []

    def _answered(self, shard: Shard, i: int, kv: KV | None, hidden: torch.Tensor | None) -> None:
        """An answer is known: its features (read or computed), then a continuation row queued per mismatch."""
        sample = shard.samples[i]
        if shard.features[i] is None:
            start = time.perf_counter()
            slm = self.c.models.get(self.s.slm, "SLM")
            shard.features[i], meta = slm_features(slm, [sample], self.s.num_topk_logits, self.c.vocab)
            shard.seconds[FEATURES.name] += time.perf_counter() - start
            shard.tokens[FEATURES.name] += meta["tokens"]
        features, prompt, response = shard.features[i], sample["prompt_ids"], sample["response_ids"]
        at = mismatch_positions(features["slm_token"], features["real_token"]) if response else []
        if CONTINUATIONS not in shard.needed or not at:
            return
        start = time.perf_counter()
        slm_tokens = [int(features["slm_token"][j]) for j in at]
        if kv is None:  # an answer on disk: read once
            kv, hidden = read_answer(self.llm, prompt + response[:-1], [len(prompt) - 1 + j for j in at])
            shard.tokens[CONTINUATIONS.name] += len(prompt) + len(response) - 1
        else:
            hidden = hidden[at]
        theirs, own = logprobs(self.llm, hidden, slm_tokens), logprobs(self.llm, hidden, [response[j] for j in at])
        for j, token, lp in zip(at, slm_tokens, zip(theirs, own)):
            if token in self.eos:  # the SLM would end the answer here: nothing to continue
                shard.records.append(record(self.c.tokenizer, sample, i, j, token, [], self.c.ends, self.eos,
                                            self.s.context_tokens, lp))
                continue
            job = Job(shard, i, position=j, slm_token=token, logprob=lp)
            self.waiting.append(continuation_row(job, kv, len(prompt) + j, token, self.stops,
                                                 self.s.continuation_max_tokens))
            shard.open += 1
        shard.seconds[CONTINUATIONS.name] += time.perf_counter() - start

    def _write(self, shard: Shard) -> None:
        """Write what the shard needed, each step's file atomically, in the steps' order."""
        k, work = shard.k, self.c.work
        if RESPONSES in shard.needed:
            write_json(work.shard(RESPONSES, k), {"samples": shard.samples, "tokens": shard.tokens[RESPONSES.name],
                                                  "seconds": shard.seconds[RESPONSES.name],
                                                  "prompt_hash": prompt_hash(shard.prompts)})
        if FEATURES in shard.needed:
            tensors = features_tensors(shard.features)
            write_tensors(work.shard(FEATURES, k), tensors, {"ids": [p.id for p in shard.prompts],
                                                             "tokens": shard.tokens[FEATURES.name],
                                                             "seconds": shard.seconds[FEATURES.name]})
        if CONTINUATIONS in shard.needed:
            offsets, total = [], 0
            for sample in shard.samples:
                offsets.append(total)
                total += len(sample["response_ids"])
            records = sorted(shard.records, key=lambda m: (m["sample"], m["position"]))
            for m in records:
                m["row"] = offsets[m["sample"]] + m["position"]
            write_json(work.shard(CONTINUATIONS, k), {"mismatches": records, "tokens": shard.tokens[CONTINUATIONS.name],
                                                      "seconds": shard.seconds[CONTINUATIONS.name]})


def features_tensors(parts: list[dict]) -> dict[str, torch.Tensor]:
    """One shard's features from its answers' (each read alone: ``sample`` 0), ``sample`` set to the answer's index."""
    kept = [(i, p) for i, p in enumerate(parts) if len(p["slm_token"])]
    if not kept:
        return parts[0] if parts else {}
    out = {key: torch.cat([p[key] for _, p in kept]) for key in FEATURE_KEYS if key != "sample"}
    out["sample"] = torch.cat([torch.full((len(p["slm_token"]),), i, dtype=torch.int32) for i, p in kept])
    return out
