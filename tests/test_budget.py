"""``llm_budget``: at most ceil(b * t) of any answer's first t tokens from the LLM, spent where the router is surest.

The extremes reduce to each model on every path (eager, static cache, captured with emulated graphs),
the cap holds at every prefix of every row, and routed tokens are the answer's high scores so far.
"""

from fractions import Fraction
from math import ceil

import pytest
import torch
from transformers import GenerationConfig

from r2r_hf import R2RForCausalLM
from r2r_hf.testing.graphs import emulated_store

GREEDY = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=2)
SAMPLING = dict(max_new_tokens=24, do_sample=True, temperature=0.8, top_k=40, pad_token_id=0, eos_token_id=2)
PATHS = ["eager", "static", "captured"]


@pytest.fixture
def on_path(model, monkeypatch):
    """generate kwargs for a path; "captured" replays emulated CUDA graphs on the CPU."""

    def kwargs(path: str) -> dict:
        if path == "captured":
            monkeypatch.setattr(model, "capture_store", emulated_store())
        return {} if path == "eager" else {"cache_implementation": "static"}

    return kwargs


def _inputs(request, name):
    return request.getfixturevalue(name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("inputs", ["single", "batch"])
@pytest.mark.parametrize("sampling", [False, True])
def test_budget_0_is_the_slm_and_budget_1_at_threshold_0_is_the_llm(model, slm, llm, on_path, path, inputs, sampling,
                                                                   request):
    enc, kwargs = _inputs(request, inputs), (SAMPLING if sampling else GREEDY)
    extra = on_path(path)
    for budget, threshold, reference in ((0.0, 0.0, slm), (1.0, 0.0, llm)):
        torch.manual_seed(11)
        expected = reference.generate(**enc, **kwargs)
        torch.manual_seed(11)
        out = model.generate(**enc, **kwargs, **extra, threshold=threshold, llm_budget=budget,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected), f"budget {budget}"
        assert out.llm_budget == budget
        assert torch.equal(out.llm_tokens, (out.routed & out.generated_mask).sum(-1))


def _check_cap_and_rank(out, budget: float, threshold: float) -> int:
    """Every prefix of every row within ceil(b * t); every routed token above the threshold and in the top b share."""
    b = Fraction(budget).limit_denominator(10**6)
    routed_total = 0
    for row in range(out.routed.shape[0]):
        scores = out.router_scores[row][out.generated_mask[row]].tolist()
        routed = out.routed[row][out.generated_mask[row]].tolist()
        for t in range(1, len(routed) + 1):
            assert sum(routed[:t]) <= ceil(b * t), f"row {row}: {sum(routed[:t])} LLM tokens of the first {t}"
            if routed[t - 1]:
                higher = sum(s > scores[t - 1] for s in scores[: t - 1])
                assert higher < b * t and scores[t - 1] >= threshold
        routed_total += sum(routed)
    return routed_total


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("budget", [0.05, 0.1, 0.25])
def test_the_budget_is_never_exceeded_and_spent_on_the_answers_top_scores(model, batch, on_path, path, budget):
    out = model.generate(**batch, **GREEDY, **on_path(path), threshold=0.0, llm_budget=budget,
                         return_dict_in_generate=True)
    assert _check_cap_and_rank(out, budget, 0.0) > 0, "the budget was spent"


def test_threshold_and_budget_route_only_where_both_allow(model, batch):
    probe = model.generate(**batch, **GREEDY, threshold=float("inf"), return_dict_in_generate=True)
    threshold = probe.router_scores[probe.generated_mask].quantile(0.5).item()
    plain = model.generate(**batch, **GREEDY, threshold=threshold, return_dict_in_generate=True)
    both = model.generate(**batch, **GREEDY, threshold=threshold, llm_budget=0.1, return_dict_in_generate=True)
    _check_cap_and_rank(both, 0.1, threshold)
    assert both.llm_tokens.sum() < plain.llm_tokens.sum(), "the budget binds where the threshold alone routes more"


def test_rows_of_a_batch_keep_their_own_budgets(model, tok):
    prompts = ["the old man said that he was", "water"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    together = model.generate(**enc, **GREEDY, threshold=0.0, llm_budget=0.2, return_dict_in_generate=True)
    for row, prompt in enumerate(prompts):
        alone = model.generate(**tok([prompt], return_tensors="pt"), **GREEDY, threshold=0.0, llm_budget=0.2,
                               return_dict_in_generate=True)
        n = alone.routed.shape[1]
        assert together.routed[row, :n].tolist() == alone.routed[0].tolist(), f"row {row}"


def test_the_budget_comes_from_a_generation_config_and_survives_saving(model, slm, llm, single, tmp_path):
    by_kwarg = model.generate(**single, **GREEDY, threshold=0.0, llm_budget=0.1, return_dict_in_generate=True)
    config = GenerationConfig(**GREEDY, llm_budget=0.1, threshold=0.0, return_dict_in_generate=True)
    by_config = model.generate(**single, generation_config=config)
    assert torch.equal(by_config.routed, by_kwarg.routed) and by_config.llm_budget == 0.1
    saved = R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[32, 32], router_expansion=2)
    saved.router.load_state_dict(model.router.state_dict())
    saved.generation_config.llm_budget = 0.1
    saved.save_pretrained(tmp_path)
    loaded = R2RForCausalLM.from_pretrained(tmp_path, slm=slm, llm=llm)
    assert loaded.generation_config.llm_budget == 0.1
    again = loaded.generate(**single, **GREEDY, threshold=0.0, return_dict_in_generate=True)
    assert torch.equal(again.routed, by_kwarg.routed) and again.llm_budget == 0.1


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.1", True, float("nan")])
def test_a_bad_budget_is_one_sentence(model, single, value):
    with pytest.raises(ValueError, match="llm_budget must be a share"):
        model.generate(**single, **GREEDY, llm_budget=value)


def test_without_a_budget_nothing_is_recorded_as_spent_against_one(model, single):
    out = model.generate(**single, **GREEDY, threshold=0.0, return_dict_in_generate=True)
    assert out.llm_budget is None and out.llm_tokens.tolist() == [int(out.generated_mask.sum())]


def test_any_budget_above_0_allows_the_first_token_and_the_cap_is_exact_at_whole_products():
    from r2r_hf.core.budget import Budget

    def routed_positions(share: float, tokens: int) -> list[int]:
        state, positions = Budget.start(share, 1, tokens, torch.device("cpu")), []
        for t in range(tokens):
            score = torch.tensor([1.0 + t])  # each score the highest so far: only the cap decides
            allowed = state.allows(score)
            positions += [t] if bool(allowed) else []
            state.spend(score, allowed, torch.tensor([True]))
        return positions

    assert routed_positions(1e-10, 50) == [0], "a tiny budget still has its first-token allowance"
    assert routed_positions(0.0, 50) == []
    # 0.07 * 100 = 7.000000000000001 in floats: still at most 7 LLM tokens among the first 100
    assert len([p for p in routed_positions(0.07, 100) if p < 100]) == 7
    assert routed_positions(0.25, 12) == [0, 4, 8]  # fewer than b * t before: t = 1, 5, 9
