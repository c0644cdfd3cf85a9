"""Everything users pass to HF generate keeps working with R2R."""

import threading

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)

GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)


def test_text_streamer_gets_prompt_each_token_then_end(model, tok, single, capsys):
    out = model.generate(**single, **GREEDY, streamer=TextStreamer(tok), threshold=0.5)
    printed = capsys.readouterr().out
    assert printed.strip() == tok.decode(out[0]).strip()


def test_text_iterator_streamer_consumed_from_another_thread(model, tok, single):
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(out=model.generate(**single, **GREEDY, streamer=streamer, threshold=0.5))
    )
    worker.start()
    pieces = list(streamer)
    worker.join(timeout=60)
    prompt = single["input_ids"].shape[1]
    assert "".join(pieces).strip() == tok.decode(result["out"][0, prompt:]).strip()


class _RecordingStreamer:
    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.clone()))

    def end(self):
        self.calls.append(("end", None))


def test_streamer_protocol_prompt_then_one_put_per_token(model, batch):
    streamer = _RecordingStreamer()
    out = model.generate(**batch, **GREEDY, streamer=streamer, threshold=0.5)
    prompt = batch["input_ids"].shape[1]
    kinds = [kind for kind, _ in streamer.calls]
    assert kinds == ["put"] * (1 + out.shape[1] - prompt) + ["end"]
    assert torch.equal(streamer.calls[0][1], batch["input_ids"])
    steps = torch.stack([value for _, value in streamer.calls[1:-1]], dim=1)
    assert torch.equal(steps, out[:, prompt:])


def test_stop_strings_with_tokenizer(model, tok, slm, single):
    free = model.generate(**single, **{**GREEDY, "eos_token_id": 10_000}, threshold=0.5)
    prompt = single["input_ids"].shape[1]
    stop_word = tok.decode(free[0, prompt + 3])
    out = model.generate(**single, **GREEDY, threshold=0.5, stop_strings=[stop_word], tokenizer=tok)
    assert out.shape[1] <= prompt + 4 and tok.decode(out[0, -1]) == stop_word


def test_stop_strings_without_tokenizer_is_a_clear_error(model, single):
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(**single, **GREEDY, stop_strings=["x"])


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_custom_stopping_criteria(model, single):
    prompt = single["input_ids"].shape[1]
    out = model.generate(**single, **GREEDY, stopping_criteria=StoppingCriteriaList([_StopAfter(prompt + 4)]))
    assert out.shape[1] == prompt + 4


def test_several_eos_ids(model, slm, single):
    free = slm.generate(**single, **{**GREEDY, "eos_token_id": 10_000})
    prompt = single["input_ids"].shape[1]
    eos = [999, int(free[0, prompt + 2])]
    kwargs = {**GREEDY, "eos_token_id": eos}
    assert torch.equal(model.generate(**single, **kwargs, threshold=float("inf")), slm.generate(**single, **kwargs))


class _BanToken(LogitsProcessor):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] = -float("inf")
        return scores


@pytest.mark.parametrize("threshold", [float("inf"), 0.0])
def test_processors_apply_to_both_models(model, slm, llm, batch, threshold):
    reference = slm if threshold else llm
    free = reference.generate(**batch, **{**GREEDY, "eos_token_id": 10_000})
    banned = int(free[0, -1])
    kwargs = dict(**GREEDY, repetition_penalty=1.3, logits_processor=LogitsProcessorList([_BanToken(banned)]))
    expected = reference.generate(**batch, **kwargs)
    got = model.generate(**batch, **kwargs, threshold=threshold)
    assert torch.equal(got, expected)
    prompt = batch["input_ids"].shape[1]
    assert banned not in got[:, prompt:].tolist()[0]


@pytest.mark.parametrize("threshold", [float("inf"), 0.0])
def test_min_p_sampling_matches_reference(model, slm, llm, batch, threshold):
    reference = slm if threshold else llm
    kwargs = dict(max_new_tokens=10, do_sample=True, min_p=0.05, temperature=1.2, top_k=0, pad_token_id=0)
    torch.manual_seed(3)
    expected = reference.generate(**batch, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(model.generate(**batch, **kwargs, threshold=threshold), expected)


def test_output_scores_are_the_writers_scores(model, slm, llm, single):
    kwargs = dict(**GREEDY, return_dict_in_generate=True, output_scores=True, output_logits=True)
    for threshold, reference in ((float("inf"), slm), (0.0, llm)):
        expected = reference.generate(**single, **kwargs)
        got = model.generate(**single, **kwargs, threshold=threshold)
        vocab = model.shared_vocab_size
        assert len(got.scores) == len(expected.scores) == len(got.logits)
        for mine, theirs in zip(got.scores, expected.scores):
            torch.testing.assert_close(mine, theirs[:, :vocab])
        for mine, theirs in zip(got.logits, expected.logits):
            torch.testing.assert_close(mine, theirs[:, :vocab])


def test_num_return_sequences_with_sampling(model, slm, single):
    kwargs = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3, pad_token_id=0)
    torch.manual_seed(1)
    expected = slm.generate(**single, **kwargs)
    torch.manual_seed(1)
    got = model.generate(**single, **kwargs, threshold=float("inf"))
    assert got.shape[0] == 3 and torch.equal(got, expected)


def test_pipeline_text_generation(model, tok):
    generator = pipeline("text-generation", model=model, tokenizer=tok)
    result = generator("the old man said", max_new_tokens=5, do_sample=False, return_tensors=True)
    direct = model.generate(**tok("the old man said", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert result[0]["generated_token_ids"] == direct[0].tolist()
    text = generator("the old man said", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith("the old man said") and len(text) > len("the old man said")


def test_chat_pipeline_with_messages(model, tok):
    generator = pipeline("text-generation", model=model, tokenizer=tok)
    result = generator([{"role": "user", "content": "the water"}], max_new_tokens=4, do_sample=False)
    assert result[0]["generated_text"][-1]["role"] == "assistant"


@pytest.mark.parametrize(
    "option, name",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "output_hidden_states"),
        (dict(cache_implementation="offloaded"), "cache_implementation"),
        (dict(custom_generate=lambda *a, **k: None), "custom_generate"),
        (dict(dola_layers="high"), "dola_layers"),
    ],
)
def test_unsupported_modes_raise_naming_the_option(model, single, option, name):
    with pytest.raises(ValueError, match=name):
        model.generate(**single, max_new_tokens=3, **option)


def test_assistant_model_raises(model, slm, single):
    with pytest.raises(ValueError, match="assistant_model"):
        model.generate(**single, max_new_tokens=3, assistant_model=slm)


@pytest.mark.parametrize("bad", ["high", float("nan"), True])
def test_bad_threshold_is_refused(model, single, bad):
    with pytest.raises(ValueError, match="threshold"):
        model.generate(**single, max_new_tokens=3, threshold=bad)


def test_generate_argument_typo_is_reported(model, single):
    with pytest.raises(ValueError, match="threshhold"):
        model.generate(**single, max_new_tokens=3, threshhold=0.3)


def test_watermarking_is_refused_by_name(model, single, monkeypatch):
    """Issue 41, item 9: HF's watermark processor reads config.vocab_size, which a router's config lacks, so
    watermarking_config failed with an internal AttributeError; it is refused by name, as the other modes are."""
    from transformers import WatermarkingConfig

    from r2r_hf.model.row_settings import resolve_row

    for given in ({"bias": 2.0}, WatermarkingConfig(bias=2.0)):
        with pytest.raises(ValueError, match=r"cannot honour watermarking_config=\w+ \(watermarking") as caught:
            model.generate(**single, max_new_tokens=3, watermarking_config=given)
        assert len(str(caught.value).splitlines()) == 1
    monkeypatch.setattr(model.generation_config, "watermarking_config", WatermarkingConfig(bias=2.0))
    with pytest.raises(ValueError, match="watermarking_config"):  # inherited from the model's generation config
        model.generate(**single, max_new_tokens=3)
    with pytest.raises(ValueError, match="watermarking_config"):  # a served answer resolves the same way
        resolve_row(model, single["input_ids"][0].tolist(), max_new_tokens=3)
