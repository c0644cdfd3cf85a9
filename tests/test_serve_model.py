"""The server's cost model (benchmarks/serving/cost_model.py) replays recorded routing through the engine's own schedule
(benchmarks/serving/replay.py: the real turn and plan): the same steps and the same forwards, each of the same rows and
tokens, as the real running batch, under every waiting policy."""

from dataclasses import replace

import pytest
import torch

from benchmarks.serving.replay import replay
from benchmarks.serving.cost_model import Costs, llm_alone, simulate, synthetic
from r2r_hf.core.policy import WaitPolicy
from test_batching import POLICIES, PROMPTS, Driver, _threshold

FLAT = Costs(slm=(0.01, 0.0, 0.0), llm=(0.1, 0.0, 0.0), router=(0.001, 0.0), step=0.0)


def test_an_answer_that_never_routes_costs_its_prefill_and_one_step_per_token():
    got = simulate([(10, [False] * 20)], 1, WaitPolicy(), FLAT)
    # the prefill (SLM and LLM, chunked), then 20 steps that commit a token each (the SLM reads each but the last:
    # no proposal follows it) and one that only reads the last
    want = 0.01 + 0.1 + 20 * 0.001 + 19 * 0.01 + 0.0
    assert got["wall_s"] == pytest.approx(want) and got["llm_forwards"] == 1 and got["llm_calls"] == 0


def test_the_llm_alone_reads_the_prompts_then_every_token_once_per_step():
    answers = [(10, [False] * 8)] * 4
    assert llm_alone(answers, 4, FLAT) == pytest.approx(32 / (9 * 0.1))  # one prefill forward, 8 steps


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"m{p.min_rows[0]}-w{p.max_wait}")
def test_the_replay_schedules_as_the_running_batch_does(model, tok, policy):
    tau = _threshold(model, tok, 0.7)
    run = Driver(model, tok, slots=6, policy=policy, prefill=8)  # chunked prefill: prompts read over several turns
    run.batch.counters.shapes = []
    for i in range(6):
        run.join(i, i, max_new_tokens=12, do_sample=False, threshold=tau)
    run.run()
    counters = run.batch.counters
    answers = [(len(tok(PROMPTS[i])["input_ids"]), [by_llm for _, by_llm in run.out[i]]) for i in range(6)]
    assert any(r for _, routed in answers for r in routed), "the LLM wrote some tokens"
    batch, _ = replay(answers, 6, policy, FLAT, slots=6, chunk=8, trace=True)
    assert batch.counters.steps == counters.steps
    assert batch.counters.shapes == counters.shapes, "every forward of the same model, rows and tokens, in order"
    assert (batch.counters.llm_calls, batch.counters.llm_rows) == (counters.llm_calls, counters.llm_rows)
    assert batch.counters.waits == counters.waits


def test_waiting_pays_where_a_forward_reads_weights_and_a_synthetic_share_routes_as_asked():
    answers = synthetic([(100, [False] * 256)] * 32, 0.1, seed=1)
    share = sum(sum(r) for _, r in answers) / sum(len(r) for _, r in answers)
    assert abs(share - 0.1) < 0.02
    gpu = Costs(slm=(2.5e-3, 0.0, 6e-6), llm=(19e-3, 0.0, 1.3e-4), router=(2e-4, 0.0), step=1e-4)
    at_once = simulate(answers, 8, WaitPolicy(), gpu)
    waiting = simulate(answers, 8, WaitPolicy((3,), 16), gpu)
    assert waiting["llm_forwards_per_token"] < 0.5 * at_once["llm_forwards_per_token"]
    assert waiting["tokens_per_s"] > 1.3 * at_once["tokens_per_s"]


def test_captured_shapes_price_a_read_as_the_graph_it_replays():
    """The first H200 run: at 16 users the replay priced R2R 1.4-1.7x above what the server measured, while the LLM
    alone matched; a captured read of slots 0 and 9 of 16 replays the 16-row graph (its rows bucket holds the
    highest slot). Priced so, the replay came within 16 % of every served configuration."""
    from benchmarks.serving.replay import Answer, ReplayBatch

    def priced(**flags) -> float:
        costs = Costs(slm=(0.0, 0.0, 0.0), llm=(0.0, 1.0, 0.0), router=(0.0, 0.0), step=0.0, **flags)  # 1 s per row
        batch = ReplayBatch(16, costs)
        for _ in range(10):
            batch.join(Answer(4, [False] * 8))
        batch.clock.read("llm", [0, 9])
        return batch.clock.spent["llm"]

    assert priced() == 2.0, "the rows it reads"
    assert priced(captured_shapes=True) == 16.0, "the rows bucket of slot 9"
    assert priced(captured_shapes=True, gathered_rows=True) == 2.0, "the LLM's reads gather their rows (the SLM's do not)"


def test_the_replay_with_the_h200s_measured_costs_stays_near_what_the_h200_served(tmp_path):
    """benchmarks/serving/calibrated.py on the committed device results: every served configuration of the serving
    phase (R2R waiting and m = 1, the LLM alone, 8 and 16 users) replayed within 20 % of its measured tokens/s."""
    from benchmarks.serving import calibrated as gpu_calibrated

    result = gpu_calibrated.main(["--out", str(tmp_path / "calibrated.json")])
    assert len(result["against_measured"]) == 6
    for row in result["against_measured"]:
        assert 0.8 <= row["replayed_over_measured"] <= 1.2, row


@pytest.mark.parametrize("policy", [WaitPolicy((1,), 1), WaitPolicy((2,), 4), WaitPolicy((4,), 64)],
                         ids=["m1", "m2-w4", "m4-w64"])
def test_the_replay_packs_the_llms_reads_as_the_running_batch_does(model, tok, policy):
    """With the LLM's reads packed (``core/layouts/packed.py``: the fused regions run plain here), the batch's
    forwards and the token-rows they compute, real and padded, are the replay's, the prompts' pieces riding in the
    LLM's reads in both; each answer is ``generate``'s alone. (Speculative policies replay a rejected tail with the
    recorded continuation: not forward for forward, ``replay.py`` says why.)"""
    from r2r_hf.core.fast.slot_reads import capture_slots
    from r2r_hf.testing.graphs import EmulatedGraphStep
    from test_batching import _alone

    tau = _threshold(model, tok, 0.7)
    run = Driver(model, tok, slots=6, policy=policy, capacity=96, prefill=8)
    pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
    report = capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), warm=False,
                           fuse="plain", speculate=policy.speculate)
    assert report["packed"]
    run.batch.counters.shapes = []
    for i in range(6):
        run.join(i, i, max_new_tokens=12, do_sample=False, threshold=tau)
    run.run()
    counters = run.batch.counters
    for i in range(6):
        assert run.out[i] == _alone(model, tok, i, max_new_tokens=12, do_sample=False, threshold=tau), i
    answers = [(len(tok(PROMPTS[i])["input_ids"]), [by_llm for _, by_llm in run.out[i]]) for i in range(6)]
    batch, _ = replay(answers, 6, policy, replace(FLAT, packed=True), slots=6, chunk=8, trace=True)
    got, want = batch.counters, counters
    assert got.shapes == want.shapes, "every forward of the same model, rows and tokens, in order"
    assert (got.llm_rows_real, got.llm_rows_read) == (want.llm_rows_real, want.llm_rows_read)
    assert want.llm_rows_real <= want.llm_rows_read < 2 * want.llm_rows_real


def test_the_replay_drafts_blocks_with_one_host_step_each():
    """Draft blocks (``WaitPolicy.block``) replayed through the real ``turn.decode_block``: the same answers and LLM
    tokens as one step at a time, one host step (synchronisation) per block rather than per step."""
    answers = synthetic([(12, [False] * 40)] * 6, 0.1, seed=3, agreement=1.0)
    host = Costs(slm=(0.01, 0.0, 0.0), llm=(0.1, 0.0, 0.0), router=(0.0, 0.0), step=0.05, packed=True)
    runs = {}
    for block in (1, 4):
        batch, done = replay(answers, 6, WaitPolicy((3,), 16, speculate=4, block=block), host, slots=6, chunk=8)
        runs[block] = (batch, sorted((a.prompt, tuple(a.routed), len(a.times)) for a in done))
    (one, done_one), (four, done_four) = runs[1], runs[4]
    assert done_one == done_four, "every answer served whole either way"
    assert one.counters.llm_tokens == four.counters.llm_tokens > 0 and four.counters.resolutions > 0
    assert four.counters.host_syncs < 0.6 * one.counters.host_syncs, "a synchronisation per block"
    assert four.clock.spent["host"] < 0.6 * one.clock.spent["host"] and four.clock.now < one.clock.now


def test_a_recurrent_models_uneven_catch_up_takes_a_forward_per_width_and_its_state_bytes_are_priced():
    """A model with recurrent layers never pads a row (``slot_state.py``): every row of one forward reads as many
    tokens, one of the captured widths (``SlotBook.read``), so rows 3 and 5 tokens behind take three forwards (4 of
    row 1; 2 of row 0; 1 of each) where a transformer takes one; each forward reads and writes each of its rows'
    recurrent state once, and a checkpoint or a restore copies it once."""
    from benchmarks.serving.shape_costs import Constants, Shape, ShapeCosts
    from benchmarks.serving.replay import Answer, ReplayBatch

    tiny = Shape("tiny", hidden=4, intermediate=8, layers=4, heads=1, kv_heads=1, head_dim=2, vocab=8, tied=True,
                 linear=3, linear_k_heads=1, linear_v_heads=2, linear_k_dim=2, linear_v_dim=2, conv_kernel=4)
    assert tiny.state_bytes() == 3 * (2 * 2 * 2 * 4 + 8 * 4 * 2)  # 3 layers x (fp32 recurrent + bf16 conv, 8 channels)
    one_byte_a_second = Constants(bandwidth=1.0, layer=0.0, row=0.0, flop=0.0, fused_layer=0.0)

    def caught_up(**flags):
        costs = ShapeCosts(tiny, tiny, one_byte_a_second, router=(0.0, 0.0), step=0.0, capacity=256,
                           recurrent=("llm",), gathered_rows=False, **flags)
        batch = ReplayBatch(2, costs)
        batch.counters.shapes = []
        for prompt in (10, 12):
            batch.join(Answer(prompt, [False] * 4))
        batch.book.seen["llm"][:] = [7, 7]  # rows 0 and 1 are 3 and 5 tokens behind
        batch.clock.read("llm", [0, 1])
        return batch

    hybrid, padded = caught_up(), caught_up(split=False)
    assert hybrid.counters.shapes == [("llm", 1, 4), ("llm", 1, 2), ("llm", 2, 1)]
    assert padded.counters.shapes == [("llm", 2, 5)]
    # each forward at its captured rows bucket (the bucket of its highest slot: 2, 1, 2 rows): the weights, the KV of
    # the attended span and twice each row's state
    forward = lambda k, state: tiny.weight_bytes() + k * 256 * tiny.kv_bytes() + 2 * k * state  # noqa: E731
    assert hybrid.clock.spent["llm"] == sum(forward(k, tiny.state_bytes()) for k in (2, 1, 2))
    assert caught_up(state=False).clock.spent["llm"] == sum(forward(k, 0) for k in (2, 1, 2))
    clock, book = hybrid.clock, hybrid.book
    before = clock.spent["llm"]
    clock.keep("llm", [0, 1])  # a resolution's checkpoint of both rows: each row's state read and written once
    assert book.saved["llm"] == [10, 12] and clock.spent["llm"] - before == 2 * 2 * tiny.state_bytes()
    book.length[1] += 3  # row 1 commits 3 answer tokens, which the LLM reads
    clock.read("llm", [1])
    before = clock.spent["llm"]
    clock.cut(1, 1)  # row 1 back to its prompt and 1 answer token: the LLM goes back to its checkpoint
    assert book.seen["llm"][1] == 12 and clock.copies["llm"] == 3
    assert clock.spent["llm"] - before == 2 * tiny.state_bytes()
    assert caught_up(rewind=False).clock.rewinds("llm") is False  # (a transformer's cut: no checkpoint)


def test_a_speculating_hybrid_replays_with_its_checkpoints_and_costs_more_than_a_transformer_of_its_shape():
    """The whole schedule with recurrent models: the same answers served; the SLM's state checkpointed when a row
    first speculates, the LLM's at each resolution; a rejected tail sends the recurrent models back to their
    checkpoints, which they read again from; priced at zero, the split and the state leave the transformer's."""
    answers = synthetic([(12, [False] * 40)] * 6, 0.2, seed=3, agreement=0.6)
    policy = WaitPolicy((3,), 16, speculate=4)
    hybrid = replace(FLAT, recurrent=("slm", "llm"))
    runs = {name: replay(answers, 6, policy, costs, slots=6, chunk=8)
            for name, costs in {"plain": FLAT, "hybrid": hybrid}.items()}
    (plain, done_plain), (rec, done_rec) = runs["plain"], runs["hybrid"]
    key = lambda done: sorted((a.prompt, tuple(a.routed), len(a.times)) for a in done)  # noqa: E731
    assert key(done_plain) == key(done_rec), "every answer served whole either way"
    assert rec.counters.rejected > 0 and rec.clock.copies["slm"] > 0 and rec.clock.copies["llm"] > 0
    assert plain.clock.copies == {"slm": 0, "llm": 0}
    assert rec.counters.llm_forwards > plain.counters.llm_forwards, "uneven catch-ups split"
    assert rec.counters.slm_forwards > plain.counters.slm_forwards, "re-reads from a checkpoint"
    assert rec.clock.now > plain.clock.now


def test_the_shape_model_counts_what_hfs_own_qwen3_5_holds():
    """``shape_costs.Shape``: the parameters HF's Qwen3.5 builds, and a row's state as HF's own cache keeps it after
    a forward of a bf16 model (the recurrent state in fp32, the conv state in the model's dtype, ``kernel`` columns)."""
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from benchmarks.serving.shape_costs import Shape

    shape = Shape("tiny", hidden=32, intermediate=64, layers=4, heads=2, kv_heads=1, head_dim=16, vocab=64,
                  tied=False, linear=3, linear_k_heads=2, linear_v_heads=4, linear_k_dim=8, linear_v_dim=8,
                  conv_kernel=4, gated=True, qk_norm=True)
    config = Qwen3_5TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, vocab_size=64, tie_word_embeddings=False,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    model = qwen3_5.Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    assert sum(p.numel() for p in model.parameters()) == shape.params()
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for store in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
               for t in store.values())
    assert held == shape.state_bytes()
