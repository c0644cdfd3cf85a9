"""The R2R decoding loop, read top to bottom.

Every step, for the whole batch:

1. ``propose``   the SLM's next token, through HF's logits processors and sampling;
2. ``route``     the router scores that proposal from the SLM's features;
3. ``catch up``  where any row routes, the LLM reads every token committed since its
                 last call in ONE forward and writes that row's token instead;
4. ``commit``    the chosen token is appended (pad for finished rows);
5. ``SLM step``  the SLM reads the committed token, whichever model wrote it;
6. ``record``    the token is recorded, streamed and checked against the stopping criteria.

Nothing is rolled back: the SLM's cache only ever holds committed tokens and the
LLM's cache only grows, so both can be static and the fixed-shape calls captured
(``capture.py``). Sampling keeps HF's random stream: it advances once per committed
token, because the LLM redraws from the state the SLM's draw started from (``sampling.py``).
Hence never-route equals ``slm.generate`` and always-route equals ``llm.generate``, token for
token, under the same seed. The host waits on the device once per step: for the
routing decision (which also tells whether every row finished at the previous step).

Where a call gives an LLM budget, step 2 routes only where the row's budget allows too
(``budget.py``: never more than ceil(b * t) of t tokens, spent where the router is surest).

Steps 1-5 are small functions over one explicit ``Batch`` (what the batch decodes over between
steps) and the batch's ``Routing``; ``r2r_decode`` adds HF's records, streaming and stopping, and
the server's engine (``r2r_hf/serve``) adds rows joining and leaving between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .budget import Budget
from .outputs import R2RGenerateOutput, RoutingAwareStreamer
from .routing import Routing, call_length
from .steps import Committed, propose


@dataclass
class Batch:
    """What a batch decodes over between steps.

    Args:
        seq: the committed tokens.
        llm_seen: columns of ``seq`` already in the LLM's cache (one lag shared by the batch).
        slm_logits: [B, V] the SLM's next-token logits after reading ``seq``.
        slm_hidden: [B, H] its post-norm hidden state there.
        budget: the rows' LLM budgets and what they spent (None when the batch has none).
    """

    seq: Committed
    llm_seen: int
    slm_logits: torch.Tensor
    slm_hidden: torch.Tensor
    budget: Budget | None = None


@dataclass(frozen=True)
class Proposal:
    """Steps 1-2 of one step: the SLM's token, its processed scores, the router's scores and decision.

    ``rng`` is where the random stream stood before the SLM's draw (None when greedy).
    """

    token: torch.Tensor
    scores: torch.Tensor
    router_scores: torch.Tensor
    routed: torch.Tensor
    rng: object


def start(routing: Routing, seq: Committed, new_tokens: int) -> Batch:
    """The SLM prefills the prompt: the batch is ready for its first proposal (of at most ``new_tokens``)."""
    logits, hidden = routing.steps.slm_read(seq, 0)
    budget = None
    if routing.llm_budget is not None:
        budget = Budget.start(routing.llm_budget, seq.ids.shape[0], new_tokens, seq.ids.device)
    return Batch(seq, 0, logits, hidden, budget)


def propose_and_route(routing: Routing, batch: Batch, running: torch.Tensor) -> Proposal:
    """1. The SLM proposes; 2. the router scores the proposal. Routes only running rows, within their budgets."""
    rng = routing.sampler.state()  # kept so the LLM can redraw in the SLM's place
    scores, token = propose(batch.slm_logits, batch.seq, routing.processors, routing.vocab_size, routing.sampler)
    routing.router.step()
    router_scores = routing.steps.route_scores(batch.slm_logits, batch.slm_hidden, token).to(token.device)
    routed = (router_scores >= routing.threshold) & running
    if batch.budget is not None:
        routed &= batch.budget.allows(router_scores)
        batch.budget.spend(router_scores, routed, running)
    return Proposal(token, scores, router_scores, routed, rng)


def catch_up(routing: Routing, batch: Batch, proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """3. The LLM reads every token since its last call in one chunk and writes the routed rows' token.

    Returns the tokens [B], the writers' processed scores [B, V] and the LLM's raw logits [B, V'].
    """
    llm_logits = routing.steps.llm_read(batch.seq, batch.llm_seen)
    batch.llm_seen = batch.seq.length
    routing.sampler.restore(proposal.rng)
    llm_scores, llm_token = propose(llm_logits, batch.seq, routing.processors, routing.vocab_size, routing.sampler)
    token = torch.where(proposal.routed, llm_token, proposal.token)
    scores = torch.where(proposal.routed[:, None], llm_scores, proposal.scores)
    return token, scores, llm_logits


def commit(routing: Routing, batch: Batch, token: torch.Tensor, read: bool = True) -> None:
    """4. Append the chosen tokens; 5. the SLM reads them (launched at once so the device works while the
    host keeps its records). ``read=False`` when no step follows."""
    batch.seq.append(token)
    if read:
        batch.slm_logits, batch.slm_hidden = routing.steps.slm_read(batch.seq, batch.seq.length - 1)


def r2r_decode(
    routing: Routing,
    input_ids: torch.Tensor,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    streamer: BaseStreamer | None = None,
) -> R2RGenerateOutput | torch.Tensor:
    """Generate with token-level routing, once HF ``generate`` has prepared everything.

    Args:
        routing: the call's router, threshold, processors, sampler and engine.
        input_ids: [B, P] left-padded prompts.
        stopping_criteria, generation_config: as prepared by HF ``generate``.
        attention_mask: [B, P], or None when nothing is padded.
        position_ids: [B, P] positions of the prompt tokens.
        streamer: an HF streamer (it already received the prompt); a ``RoutingAwareStreamer``
            is also told which rows the LLM wrote.
    """
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    return_dict = bool(generation_config.return_dict_in_generate)
    keep_scores = return_dict and bool(generation_config.output_scores)
    keep_logits = return_dict and bool(generation_config.output_logits)
    pad = generation_config._pad_token_tensor
    pad_finished = pad is not None and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    max_len = call_length(generation_config, prompt_len)
    vocab, new_max = routing.vocab_size, max_len - prompt_len

    running = torch.ones(rows, dtype=torch.bool, device=device)
    routed_record = torch.zeros(rows, new_max, dtype=torch.bool, device=device)
    score_record = torch.full((rows, new_max), float("nan"), device=device)
    generated_record = torch.zeros(rows, new_max, dtype=torch.bool, device=device)
    scores_out: tuple[torch.Tensor, ...] | None = () if keep_scores else None
    logits_out: tuple[torch.Tensor, ...] | None = () if keep_logits else None

    batch = start(routing, Committed.from_prompt(input_ids, attention_mask, position_ids, routing.steps.capacity),
                  new_max)
    step = 0
    while True:
        # 1-2. Propose and route. The step's one host synchronisation reads the routing decision
        #      together with whether every row had finished at the previous step.
        proposal = propose_and_route(routing, batch, running)
        any_routed, all_finished = torch.stack((proposal.routed.any(), ~running.any())).tolist()
        if all_finished:
            routing.sampler.restore(proposal.rng)  # this step's draw is not committed
            break
        token, scores = proposal.token, proposal.scores
        raw = batch.slm_logits[:, :vocab] if keep_logits else None

        # 3. Routed rows: the LLM catches up in one chunk, then writes their token.
        if any_routed:
            token, scores, llm_logits = catch_up(routing, batch, proposal)
            if keep_logits:
                raw = torch.where(proposal.routed[:, None], llm_logits[:, :vocab].to(raw.device), raw)

        # 4-5. Commit (finished rows get the pad token); the SLM reads the committed token.
        if pad_finished:
            token = torch.where(running, token, pad)
        commit(routing, batch, token, read=batch.seq.length + 1 < max_len)

        # 6. Record, stream, check stopping.
        routed_record[:, step] = proposal.routed
        score_record[:, step] = torch.where(running, proposal.router_scores, float("nan"))
        generated_record[:, step] = running
        if keep_scores:
            scores_out += (scores,)
        if keep_logits:
            logits_out += (raw.float(),)
        if streamer is not None:
            if isinstance(streamer, RoutingAwareStreamer):
                streamer.put_routing(proposal.routed.cpu(),
                                     torch.where(running, proposal.router_scores, float("nan")).cpu())
            streamer.put(token.cpu())
        running = running & ~stopping_criteria(batch.seq.view(), scores_out)
        step += 1
        if batch.seq.length >= max_len:
            break

    if streamer is not None:
        streamer.end()
    sequences = batch.seq.view().clone()
    if not return_dict:
        return sequences
    generated, routed_out = generated_record[:, :step], routed_record[:, :step]
    llm_tokens = (routed_out & generated).sum(-1)
    return R2RGenerateOutput(
        sequences=sequences,
        scores=scores_out,
        logits=logits_out,
        routed=routed_out,
        router_scores=score_record[:, :step],
        generated_mask=generated,
        llm_token_rate=routed_out.sum().item() / max(generated.sum().item(), 1),
        threshold=routing.threshold,
        llm_budget=None if routing.llm_budget is None else float(routing.llm_budget),
        llm_tokens=llm_tokens,
    )
