"""The LogitsProcessor form: routing inside a plain slm.generate call, with fresh records per call and HF's
processor order (sampling warpers shape routed rows, logits processors do not).

The last three tests come from issue 15's hostile probe (item 5)."""

import pytest
import torch

from r2r_hf import R2RLogitsProcessor
from r2r_hf.testing import make_tiny_llm

NO_SAMPLING = dict(do_sample=False, pad_token_id=0, eos_token_id=2)
GREEDY = dict(max_new_tokens=10, **NO_SAMPLING)


@pytest.mark.parametrize("inputs", ["single", "batch"])
def test_never_route_equals_plain_slm_generate(model, slm, llm, inputs, request):
    enc = request.getfixturevalue(inputs)
    with R2RLogitsProcessor(llm=llm, router=model, threshold=float("inf")) as proc:
        got = slm.generate(**enc, **GREEDY, logits_processor=[proc])
    assert torch.equal(got, slm.generate(**enc, **GREEDY))
    assert proc.llm_token_rate == 0.0 and not proc.routed.any()


@pytest.mark.parametrize("inputs", ["single", "batch"])
def test_always_route_equals_llm_generate(model, slm, llm, inputs, request):
    enc = request.getfixturevalue(inputs)
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        got = slm.generate(**enc, **GREEDY, logits_processor=[proc])
    assert torch.equal(got, llm.generate(**enc, **GREEDY))
    assert proc.llm_token_rate == 1.0


def test_processor_matches_r2r_generate_on_mixed_routing(model, slm, llm, single):
    probe = model.generate(**single, **GREEDY, threshold=float("inf"), return_dict_in_generate=True)
    threshold = probe.router_scores[probe.generated_mask].median().item()
    out = model.generate(**single, **GREEDY, threshold=threshold, return_dict_in_generate=True)
    with R2RLogitsProcessor(llm=llm, router=model, threshold=threshold) as proc:
        got = slm.generate(**single, **GREEDY, logits_processor=[proc])
    assert torch.equal(got, out.sequences)
    assert torch.equal(proc.routed, out.routed)


def test_records_reset_per_call(model, slm, llm, single, batch):
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        slm.generate(**batch, **GREEDY, logits_processor=[proc])
        first = proc.routed.shape
        slm.generate(**single, **{**GREEDY, "max_new_tokens": 4}, logits_processor=[proc])
        assert first[0] == 2 and proc.routed.shape == (1, 4)


def test_bare_router_needs_the_slm(model, llm):
    with pytest.raises(ValueError, match="slm="):
        R2RLogitsProcessor(llm=llm, router=model.router)


def test_closed_processor_refuses_to_run(model, slm, llm, single):
    proc = R2RLogitsProcessor(llm=llm, router=model, threshold=0.0)
    proc.close()
    with pytest.raises(ValueError, match="closed"):
        slm.generate(**single, **GREEDY, logits_processor=[proc])


# ------------------------------------------------------------------ issue 15, item 5
def test_processor_refuses_a_nan_threshold(model, llm):
    with pytest.raises(ValueError, match="threshold must be a number"):
        R2RLogitsProcessor(llm=llm, router=model, threshold=float("nan"))


def test_generating_again_from_the_output_starts_fresh_records(model, slm, llm, single):
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        first = slm.generate(**single, max_new_tokens=4, logits_processor=[proc], **NO_SAMPLING)
        assert proc.routed.shape == (1, 4)
        mask = torch.ones_like(first)
        second = slm.generate(first, attention_mask=mask, max_new_tokens=3, logits_processor=[proc], **NO_SAMPLING)
        assert proc.routed.shape == (1, 3)
        # A fresh LLM cache as well: always routing is exactly llm.generate on the longer prompt.
        assert torch.equal(second, llm.generate(first, attention_mask=mask, max_new_tokens=3, **NO_SAMPLING))
        # Without a cache a call on the previous output cannot be told from a continuation; reset() says it.
        slm.generate(second, max_new_tokens=2, logits_processor=[proc], use_cache=False, **NO_SAMPLING)
        assert proc.routed.shape == (1, 5)
        proc.reset()
        slm.generate(second, max_new_tokens=2, logits_processor=[proc], use_cache=False, **NO_SAMPLING)
        assert proc.routed.shape == (1, 2)


def test_sampling_warpers_shape_routed_rows_and_logits_processors_do_not(model, slm, single):
    """What the processor module's docstring says about HF's processor order (transformers 5.23)."""
    llm = make_tiny_llm(vocab_size=416)  # the SLM's width: both samplers draw from the same number of ids
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 8, "top_p": 0.9, "max_new_tokens": 8,
                "pad_token_id": 0, "eos_token_id": 2}
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        torch.manual_seed(7)
        routed = slm.generate(**single, logits_processor=[proc], **sampling)
    torch.manual_seed(7)
    assert torch.equal(routed, llm.generate(**single, **sampling)), "warpers run after the processor"
    penalised = {**NO_SAMPLING, "repetition_penalty": 5.0, "max_new_tokens": 12}
    with R2RLogitsProcessor(llm=llm, router=model, threshold=0.0) as proc:
        routed = slm.generate(**single, logits_processor=[proc], **penalised)
    plain = llm.generate(**single, **NO_SAMPLING, max_new_tokens=12)
    assert torch.equal(routed, plain), "the repetition penalty shaped the SLM's scores only"
    assert not torch.equal(plain, llm.generate(**single, **penalised))


# ------------------------------------------------------------------ issue 56
@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_mamba"])
def test_the_processor_runs_inside_a_pure_state_space_slm_generate(family):
    """f02: on 5.24 the processor asked the SLM's cache its length, which a cache of recurrent layers only refuses
    ("`get_seq_length` can only be called on Attention layers"); never- and always-route = each model's generate."""
    from r2r_hf import R2RForCausalLM
    from r2r_hf.testing.builds import build_pair

    slm, llm = build_pair(family)
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[16], router_expansion=1)
    prompt = torch.tensor([[17, 41, 99, 5, 230]])
    for threshold, hf in ((float("inf"), slm), (0.0, llm)):
        with R2RLogitsProcessor(llm=llm, router=model, threshold=threshold) as proc:
            got = slm.generate(prompt, **GREEDY, logits_processor=[proc])
        assert torch.equal(got, hf.generate(prompt, **GREEDY)), (family, threshold)


def test_the_processor_catches_up_a_state_space_llm_as_a_fresh_read_would():
    """The LLM's catch-up of several tokens continues its cache: a Mamba LLM reads them one at a time (its own forward
    over several tokens starts its scan afresh), so a mixed answer is what R2R's own generate writes."""
    from r2r_hf import R2RForCausalLM
    from r2r_hf.testing.builds import build_pair

    slm, llm = build_pair("mamba")
    model = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[16], router_expansion=1)
    prompt = torch.tensor([[17, 41, 99, 5, 230]])
    options = {**GREEDY, "max_new_tokens": 24}
    probe = model.generate(prompt, **options, threshold=float("inf"), return_dict_in_generate=True)
    threshold = probe.router_scores[probe.generated_mask].quantile(0.7).item()
    out = model.generate(prompt, **options, threshold=threshold, return_dict_in_generate=True)
    assert out.routed.any() and not out.routed.all()
    with R2RLogitsProcessor(llm=llm, router=model, threshold=threshold) as proc:
        got = slm.generate(prompt, **options, logits_processor=[proc])
    assert torch.equal(proc.routed, out.routed) and torch.equal(got, out.sequences)
