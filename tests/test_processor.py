"""The LogitsProcessor form: routing inside a plain slm.generate call."""

import pytest
import torch

from r2r_hf import R2RLogitsProcessor

GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)


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
