"""The cost model's replay of speculative routing (benchmarks/serving/replay.py): the real plan, settle and advance over
priced forwards. Where the LLM confirms every pending position it takes exactly the running batch's steps and
forwards; where it rejects one, the rollbacks throw away what a hand count says; and on the H200's estimated costs
speculation beats every waiting policy where users share the GPU (the reason for the feature)."""

import pytest
import torch

from benchmarks.serving.replay import Routed, replay
from benchmarks.serving.cost_model import H200_CAPTURED, Costs, answers_of, simulate, synthetic
from benchmarks.serving.speculative import RECOMMENDED_DEPTH, WAITING_GRID, shipped
from r2r_hf import R2RForCausalLM
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing import make_related_llm, make_tiny_slm
from test_batching import PROMPTS, Driver, _threshold

FLAT = Costs(slm=(0.01, 0.0, 0.0), llm=(0.1, 0.0, 0.0), router=(0.001, 0.0), step=0.0)
SPECULATIVE = [WaitPolicy((3,), 16, speculate=4), WaitPolicy((2,), 64, speculate=8), WaitPolicy((7,), 4, speculate=2)]


@pytest.fixture(scope="module")
def agreeing():
    """A pair that agrees where the router routes: the LLM is the SLM with each weight moved by 2 % of its
    parameter's spread (seeded: at these settings the LLM confirms every pending position)."""
    slm = make_tiny_slm()
    torch.manual_seed(0)  # the router's initial weights
    return R2RForCausalLM.from_models(slm, make_related_llm(slm, noise=0.02, seed=7), router_hidden_dims=[32, 32],
                                      router_expansion=2)


@pytest.mark.parametrize("policy", SPECULATIVE, ids=lambda p: f"m{p.min_rows[0]}-w{p.max_wait}-d{p.speculate}")
def test_where_the_llm_confirms_everything_the_replay_takes_the_batchs_steps_and_forwards(agreeing, tok, policy):
    tau = _threshold(agreeing, tok, 0.7)  # ~30 % of tokens routed
    run = Driver(agreeing, tok, slots=6, policy=policy, prefill=8)
    run.batch.counters.shapes = []
    for i in range(6):
        run.join(i, i, max_new_tokens=12, do_sample=False, threshold=tau)
    run.run()
    real = run.batch.counters
    assert real.rejected == 0 and real.agreed > real.resolutions > 0, "the setup: several confirmed per forward"
    answers = [(len(tok(PROMPTS[i])["input_ids"]), Routed([b for _, b in run.out[i]], [True] * len(run.out[i])))
               for i in range(6)]
    batch, _ = replay(answers, 6, policy, FLAT, slots=6, chunk=8, trace=True)
    got = batch.counters
    assert got.steps == real.steps
    assert got.shapes == real.shapes, "every forward of the same model, rows and tokens, in order"
    assert (got.llm_calls, got.llm_rows, got.resolutions, got.agreed) == (real.llm_calls, real.llm_rows,
                                                                          real.resolutions, real.agreed)
    assert (got.generated, got.llm_tokens, got.thrown) == (real.generated, real.llm_tokens, 0)
    assert got.waits == real.waits


def _one(routed: list[bool], agrees: list[bool], policy: WaitPolicy):
    batch, done = replay([(10, Routed(routed, agrees))], 1, policy, FLAT, trace=True)
    return batch.counters, batch.clock.now, done


def test_a_rejected_pending_position_throws_away_the_tail_after_it():
    # One row, prompt 10, 8 tokens; position 1 routes and goes on pending (depth 4); no count trigger for one row
    # (m = 2); the LLM runs when it is 3 steps old, at step 4: it reads the 2 prompt/answer tokens before position
    # 1, rejects it, and the row is cut back to 1 answer token: tokens 1-3 thrown (3), the LLM's token written at 1,
    # then 6 more SLM steps and the step that delivers the last token: 5 + 6 + 1 = 12 steps.
    policy = WaitPolicy((2,), 3, speculate=4)
    counters, clock, done = _one([False, True] + [False] * 6, [True, False] + [True] * 6, policy)
    assert (counters.steps, counters.thrown, counters.rejected, counters.agreed) == (12, 3, 1, 0)
    assert (counters.generated, counters.llm_tokens, counters.resolutions, counters.llm_calls) == (8, 1, 1, 1)
    slm_reads = [("slm", 1, 1)] * 4 + [("llm", 1, 2)] + [("slm", 1, 1)] * 6  # (the last token is not read)
    assert counters.shapes == [("llm", 1, 9), ("slm", 1, 10)] + slm_reads
    assert clock == pytest.approx(11 * 0.01 + 2 * 0.1 + 11 * 0.001) and len(done[0].times) == 8
    # the same routing where the LLM agrees: nothing thrown, one token per step, the LLM reading the same 2 tokens
    counters, clock, _ = _one([False, True] + [False] * 6, [True] * 8, policy)
    assert (counters.steps, counters.thrown, counters.agreed, counters.rejected) == (9, 0, 1, 0)
    assert counters.shapes.count(("llm", 1, 2)) == 1 and counters.slm_forwards == 1 + 7


def test_the_first_rejection_counts_and_a_rollback_touches_its_row_only():
    # Two pending positions (1 agrees, 2 does not): cut back to 2, tokens 2-3 thrown, one agreed.
    counters, _, _ = _one([False, True, True] + [False] * 5, [True, True, False] + [True] * 5,
                          WaitPolicy((2,), 3, speculate=4))
    assert (counters.steps, counters.thrown, counters.agreed, counters.rejected) == (11, 2, 1, 1)
    assert ("llm", 1, 3) in counters.shapes
    # Two rows: A goes past position 1 (rejected), B routes at 2; two holders run the LLM at step 2: one forward reads
    # A up to position 1 and B up to 2 (3 tokens from the prefill's 9), A is cut back to 1 (one token thrown), B's
    # token is the LLM's; both go on (6 tokens each), B ends a step before A.
    answers = [(10, Routed([False, True] + [False] * 4, [True, False] + [True] * 4)),
               (10, Routed([False, False, True] + [False] * 3, [True] * 6))]
    batch, _ = replay(answers, 2, WaitPolicy((2,), 8, speculate=4), FLAT, trace=True)
    c = batch.counters
    assert (c.steps, c.thrown, c.rejected, c.agreed, c.generated, c.llm_tokens) == (8, 1, 1, 0, 12, 2)
    assert c.shapes == [("llm", 2, 9), ("slm", 2, 10), ("slm", 2, 1), ("slm", 2, 1), ("llm", 2, 3), ("slm", 2, 1),
                        ("slm", 2, 1), ("slm", 2, 1), ("slm", 1, 1)]


def test_speculation_beats_every_waiting_policy_on_the_h200_where_users_share_it():
    """p = 0.1, 32 answers of 256 tokens, H200 captured-step costs (estimates): the shipped server default at the
    recommended depth against the best of the waiting grid, at concurrency 8 and 16."""
    answers = synthetic([(100 + 7 * (i % 5), [False] * 256) for i in range(32)], 0.1, seed=3)
    default = shipped(RECOMMENDED_DEPTH)[f"server default, d{RECOMMENDED_DEPTH}"]
    for concurrency in (8, 16):
        waiting = max(simulate(answers, concurrency, p, H200_CAPTURED)["tokens_per_s"] for p in WAITING_GRID.values())
        speculating = simulate(answers, concurrency, default, H200_CAPTURED)
        assert speculating["tokens_per_s"] > 1.05 * waiting, concurrency
        assert speculating["rejected"] > 0 and speculating["thrown_per_token"] < 0.25


def test_answers_carry_the_llms_agreement_recorded_or_drawn_at_routed_positions(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"answer": {"prompt": 5, "routed": [0, 1, 1], "agrees": [1, 0, 1]}}\n{"turn": [0, 1]}\n'
                     '{"answer": {"prompt": 7, "routed": [1, 0, 1, 1]}}\n')
    (p1, first), (p2, second) = answers_of(trace, agreement=0.0)
    assert (p1, list(first), first.agrees) == (5, [False, True, True], [True, False, True]), "as recorded"
    assert (p2, list(second), second.agrees) == (7, [True, False, True, True], [False, True, False, False])
    drawn = synthetic([(10, [False] * 4000)], 0.25, seed=2)[0][1]
    routed = [a for r, a in zip(drawn, drawn.agrees) if r]
    assert abs(sum(routed) / len(routed) - 0.876) < 0.03 and all(a for r, a in zip(drawn, drawn.agrees) if not r)
