"""The host's cost of decoding one more token of an answer (``r2r_hf/views/text.IncrementalText.add``), by length.

    python -m benchmarks.speed.detokenize                           # the tests' tiny byte-level BPE tokenizer
    python -m benchmarks.speed.detokenize --tokenizer DIR --label after   # a real one (tokenizer.json etc. in DIR)

The answer is deterministic text of every kind a model writes (English prose, code, and CJK and emoji, whose
characters span several byte-level tokens), encoded once and fed to one ``IncrementalText`` token by token, as the
server's decoding thread feeds a row. At each length (500, 2,000 and 8,000 tokens) the next ``--adds`` adds are timed
one by one; a length's figure is their median, the best of ``--repeats`` passes (the least disturbed by the other
work of this machine). Results go under ``--label`` (e.g. ``before`` and ``after`` a change, each run on its own code)
in benchmarks/results/detokenize.json, merged with what is there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.record import hardware, versions
from r2r_hf.views.text import IncrementalText

LENGTHS = (500, 2000, 8000)
OUT = Path(__file__).resolve().parents[1] / "results" / "detokenize.json"
TEXT = (
    "The router reads the small model's last hidden state and its top logits, and where a token would send the "
    "answer down another path, the large model writes it instead.\n"
    "def catch_up(rows, cache):\n    for r in rows:\n        cache.read(r, start=seen[r])  # one forward\n"
    "混合推理：小模型写大部分词元，大模型只在分歧处接手。 長い推論を書く利用者のために。 "
    "Ünïcödé ≥ 3.5× — “quoted” café naïve 🚀🧠✨ 👩‍💻\n"
)


def answer_ids(tokenizer, tokens: int) -> list[int]:
    """``tokens`` ids of ``TEXT`` repeated (no special tokens)."""
    one = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return (one * (tokens // len(one) + 1))[:tokens]


def next_token_ms(tokenizer, ids: list[int], lengths=LENGTHS, adds: int = 32) -> dict[int, float]:
    """Per length ``n``: the median ms of the adds of tokens ``n + 1 .. n + adds`` to an answer fed token by token."""
    text, out = IncrementalText(tokenizer), {}
    fed = 0
    for n in lengths:
        while fed < n:
            text.add(ids[fed])
            fed += 1
        spent = []
        for token in ids[fed : fed + adds]:
            begin = time.perf_counter()
            text.add(token)
            spent.append(time.perf_counter() - begin)
        fed += adds
        out[n] = 1e3 * statistics.median(spent)
    return out


def measure(tokenizer, repeats: int, adds: int) -> dict[str, float]:
    ids = answer_ids(tokenizer, max(LENGTHS) + adds)
    passes = [next_token_ms(tokenizer, ids, LENGTHS, adds) for _ in range(repeats)]
    return {str(n): round(min(p[n] for p in passes), 5) for n in LENGTHS}


def load_tokenizer(path: str | None):
    if path is None:
        from r2r_hf.testing.models import make_tokenizer

        return make_tokenizer(), "the tests' tiny byte-level BPE (r2r_hf/testing/models.py, Qwen2Tokenizer, 400 tokens)"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok, f"{type(tok).__name__}, {len(tok)} tokens, from {path}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a folder with a tokenizer (default: the tests' tiny one)")
    parser.add_argument("--name", help="the key of this tokenizer in the results (default: tiny, or the folder)")
    parser.add_argument("--label", default="after", help="the key of this run (before / after a change)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adds", type=int, default=32)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--about", help="where the tokenizer came from (recorded with it)")
    parser.add_argument("--note", help="what code this run measured (recorded with it)")
    args = parser.parse_args(argv)
    tokenizer, described = load_tokenizer(args.tokenizer)
    got = measure(tokenizer, args.repeats, args.adds)
    path = Path(args.out)
    results = json.loads(path.read_text()) if path.exists() else {}
    results["conditions"] = {**versions(), "cpu": hardware(),
                             "text": "TEXT of benchmarks/speed/detokenize.py, repeated",
                             "figure": "ms per add: the median of the timed adds, the best pass"}
    entry = results.setdefault(args.name or ("tiny" if args.tokenizer is None else Path(args.tokenizer).name), {})
    entry["tokenizer"] = described if args.about is None else f"{described.split(', from ')[0]}: {args.about}"
    entry[args.label] = {"ms_per_next_token_at": got, "adds_timed": args.adds, "passes": args.repeats,
                         **({"code": args.note} if args.note else {})}
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({args.label: got}))
    return results


if __name__ == "__main__":
    main()
