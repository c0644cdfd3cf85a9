"""Hybrid and state-space models in the server's slots (issue 56): each slot keeps its rows' conv and recurrent states
beside its keys and values (``core/layouts/slot_state.py``), a row is never padded inside a read, an idle slot keeps
its state, a join starts from zero and a rollback restores a checkpoint. Served answers equal ``generate`` alone,
speculating or not, eager or captured (CUDA graphs emulated on the CPU), with draft blocks.

The pairs are what users bring: a small and a large Qwen3.5-style hybrid (Gated DeltaNet + attention) of different
width, depth and layer pattern, and a Mamba SLM with a transformer LLM.
"""

import pytest
import torch
from conftest import SMALL_ROUTER

from r2r_hf import R2RForCausalLM
from r2r_hf.core.fast.slot_reads import capture_slots
from r2r_hf.core.fast.static_reads import BUCKETS
from r2r_hf.core.layouts.slot_book import SlotBook
from r2r_hf.core.layouts.slot_state import SlotStates
from r2r_hf.core.policy import WaitPolicy
from r2r_hf.testing import make_tiny_llm
from r2r_hf.testing.graphs import EmulatedGraphStep
from test_batching import Driver, _alone

transformers = pytest.importorskip("transformers")
NEW = 40  # answer tokens: long enough for several rollbacks and re-reads per answer
PROMPTS = ["water", "the old man said that he was a good", "write a new line", "he", "x = 1 + 2 * y"]


def _qwen3_5(hidden: int, layers: list[str], vocab: int, seed: int):
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, layer_types=layers,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _mamba(vocab: int, seed: int):
    config = transformers.MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                                      conv_kernel=4)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=["qwen3_5", "mamba+llama"])
def hybrid(request):
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5")
    if request.param == "qwen3_5":
        slm = _qwen3_5(32, ["linear_attention", "full_attention"] * 2, 416, 0)
        llm = _qwen3_5(64, ["linear_attention", "linear_attention", "full_attention"] * 2, 416, 1)
    else:  # (one vocabulary, as a real pair's: threshold 0 is then the LLM's own answer)
        slm, llm = _mamba(416, 0), make_tiny_llm(vocab_size=416)
    return R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)


def _threshold(model, tok) -> float:
    """A threshold that routes about a third of the never-routed answers' tokens."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=16, do_sample=False, threshold=float("inf"),
                         return_dict_in_generate=True)
    return float(out.router_scores[out.generated_mask].quantile(0.66))


def _serve(model, tok, policy: WaitPolicy, jobs: dict, slots: int = 3, capture: dict | None = None) -> Driver:
    run = Driver(model, tok, slots=slots, policy=policy, capacity=128)
    if capture is not None:
        pool = EmulatedGraphStep.new_pool(torch.device("cpu"))
        capture_slots(run.batch.layout, lambda fn, example: EmulatedGraphStep(fn, example, pool), **capture)
    pending = list(jobs.items())
    while pending or run.batch.ledger.occupied():  # rows join as slots free up, mid-answer of the others
        while pending and run.batch.ledger.free_slots():
            name, (prompt, options) = pending.pop(0)
            run.join(name, prompt, **options)
        run.run(steps=3)
    return run


def _jobs(tau: float) -> dict:
    greedy = dict(max_new_tokens=NEW, do_sample=False, threshold=tau)
    sampled = dict(greedy, do_sample=True, temperature=1.0, top_k=20, seed=7)
    return {i: (i, sampled if i == 1 else greedy) for i in range(len(PROMPTS))}


def test_a_hybrid_pair_decodes_in_slots_and_speculates_there(hybrid):
    able = hybrid.routed_pair().abilities
    assert able.slots is None, able.slots
    assert able.speculation(slots=True) is None
    assert "recurrent" in able.slm.kinds


@pytest.mark.parametrize("policy", [WaitPolicy(), WaitPolicy((2,), 4)], ids=["immediate", "waiting"])
def test_hybrid_rows_joining_waiting_and_leaving_answer_as_generate_alone(hybrid, tok, policy):
    tau = _threshold(hybrid, tok)
    run = _serve(hybrid, tok, policy, _jobs(tau))
    for i, (prompt, options) in _jobs(tau).items():
        assert run.out[i] == _alone(hybrid, tok, prompt, **options), i
    c = run.batch.counters
    assert c.llm_tokens > 0 and c.llm_forwards > 0


def test_hybrid_rows_speculating_in_slots_roll_back_exactly(hybrid, tok):
    tau = _threshold(hybrid, tok)
    run = _serve(hybrid, tok, WaitPolicy((2,), 6, speculate=4), _jobs(tau))
    for i, (prompt, options) in _jobs(tau).items():
        assert run.out[i] == _alone(hybrid, tok, prompt, **options), i
    c = run.batch.counters
    assert c.rejected > 0 and c.thrown > 0, "no rollback happened: the checkpoints were not exercised"


def test_lossless_decoding_on_a_hybrid_pair_is_the_llms_answer(hybrid, tok):
    options = dict(max_new_tokens=NEW, do_sample=False, threshold=0.0)
    run = _serve(hybrid, tok, WaitPolicy((2,), 8, speculate=4), {i: (i, options) for i in range(3)})
    for i in range(3):
        enc = tok([PROMPTS[i]], return_tensors="pt")
        want = hybrid.llm.generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=2)
        assert [t for t, _ in run.out[i]] == want[0, enc["input_ids"].shape[1]:].tolist(), i
    assert run.batch.counters.agreed > 0


@pytest.mark.parametrize("block", [1, 4])
def test_captured_hybrid_slots_speculating_in_draft_blocks_answer_as_generate_alone(hybrid, tok, block):
    tau = _threshold(hybrid, tok)
    capture = dict(warm=False, fuse="plain", speculate=4, block=block)
    run = _serve(hybrid, tok, WaitPolicy((2,), 6, speculate=4, block=block), _jobs(tau), capture=capture)
    assert run.batch.layout.static
    for i, (prompt, options) in _jobs(tau).items():
        assert run.out[i] == _alone(hybrid, tok, prompt, **options), i
    assert run.batch.counters.rejected > 0


def test_a_recurrent_read_never_pads_a_row():
    """Every row of a forward reads as many tokens (one of the widths), so no padding ever reaches a state."""
    book = SlotBook(4)
    for row, tokens in enumerate((3, 5, 1, 12)):
        book.place(row, tokens)
    for widths in (BUCKETS, tuple(range(1, 257))):
        for role in ("slm", "llm"):
            book.seen[role] = [0] * 4
        forwards = book.read("slm", [0, 1, 2, 3], widths=widths)
        assert all(len({n for _, _, n in forward}) == 1 and forward[0][2] in widths for forward in forwards)
        read = {r: sum(n for forward in forwards for row, _, n in forward if row == r) for r in range(4)}
        assert read == {0: 3, 1: 5, 2: 1, 3: 12} and book.seen["slm"] == [3, 5, 1, 12]
        starts = {}
        for forward in forwards:  # each row's pieces follow each other
            for r, start, n in forward:
                assert start == starts.get(r, 0)
                starts[r] = start + n


def test_an_idle_slot_keeps_its_state_and_a_rollback_restores_the_checkpoint():
    states = SlotStates(3)
    rows = torch.tensor([0, 1, 2])
    states.plan(rows, None)
    states.update_recurrent(torch.ones(3, 2), layer=0, state=0)
    states.real = torch.tensor([True, True, True])
    states.finish()
    states.keep([1])
    states.plan(rows, None)
    assert torch.equal(states.get(0, "recurrent", 0), torch.ones(3, 2))
    states.update_recurrent(torch.full((3, 2), 5.0), layer=0, state=0)
    states.real = torch.tensor([True, False, True])  # slot 1 read no real token (a captured read's idle row)
    states.finish()
    assert states.buffers[(0, "recurrent", 0)][:, 0].tolist() == [5.0, 1.0, 5.0]
    states.plan(rows, None)
    states.update_recurrent(torch.full((3, 2), 9.0), layer=0, state=0)
    states.real = torch.tensor([True, True, True])
    states.finish()
    states.restore(1)
    assert states.buffers[(0, "recurrent", 0)][:, 0].tolist() == [9.0, 1.0, 9.0]
    states.reset(0)
    assert states.buffers[(0, "recurrent", 0)][0].abs().sum() == 0


def test_a_cut_past_a_recurrent_state_without_its_checkpoint_is_refused():
    book = SlotBook(1)
    book.place(0, 4)
    book.length[0], book.seen["slm"][0] = 8, 8
    assert book.cut(0, 2) == ["slm"]
    with pytest.raises(RuntimeError, match="without a checkpoint"):
        book.restore("slm", 0)


@pytest.mark.parametrize("cache", [None, "static"], ids=["dynamic", "static"])
def test_generate_speculating_on_a_hybrid_pair_equals_generate(hybrid, tok, cache):
    """``generate``'s rectangle on HF's caches cuts every row back together: its recurrent layers go back to a
    checkpoint kept before any row's first pending token (``compat.hold_states``) and read again from there."""
    enc = tok(PROMPTS[:3], return_tensors="pt", padding=True)
    tau = _threshold(hybrid, tok)
    options = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=2, threshold=tau,
                   return_dict_in_generate=True, cache_implementation=cache)
    base = hybrid.generate(**enc, **options)
    fast = hybrid.generate(**enc, **options, speculate=4, llm_max_wait=16)
    assert torch.equal(fast.sequences, base.sequences)
    assert fast.counters["speculative_rejected"] > 0 and fast.counters["thrown"] > 0, "rollbacks happened"
    lossless = hybrid.generate(**enc, **dict(options, threshold=0.0), speculate=8, llm_max_wait=64)
    want = hybrid.llm.generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=2)
    assert torch.equal(lossless.sequences, want) and lossless.counters["agreement_at_routed"] is not None
