"""Shared tiny fixtures: a Qwen2 SLM (hidden 64) and a Llama LLM (hidden 128) with one byte-level BPE tokenizer."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network; set before huggingface_hub loads
# r2r_hf's own folder (registered local copies: `make demo` writes one) is the tests' own, never the user's.
os.environ["R2R_HF_CACHE"] = tempfile.mkdtemp(prefix="r2r-hf-tests-")

import pytest  # noqa: E402
import torch  # noqa: E402

from r2r_hf import R2RForCausalLM
from r2r_hf.testing import make_tiny_llm, make_tiny_slm, make_tokenizer, save_tiny_pair

torch.set_num_threads(1)
pytest.register_assert_rewrite("serving")  # its helpers' asserts explain themselves as the tests' own do

PROMPTS = ["the old man said that he was", "water"]
SMALL_ROUTER = dict(router_hidden_dims=[32, 32], router_expansion=2)
QUICK_TRAIN = ["--epochs", "1", "--batch-size", "256", "--hidden-dims", "32"]  # `r2r-hf train` in seconds


def one_line_error(capsys, rc, *expected):
    """The command returned 2 and wrote one line, ``error: ...``, holding each of ``expected``; returns it."""
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err
    return err


@pytest.fixture(scope="session")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="session")
def slm():
    return make_tiny_slm()


@pytest.fixture(scope="session")
def llm():
    return make_tiny_llm()


@pytest.fixture(scope="session")
def model(slm, llm):
    return R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER)


@pytest.fixture(scope="session")
def pair_dir(tmp_path_factory):
    """Tiny SLM and LLM saved as local folders (with the tokenizer), as a Hub download would be."""
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="session")
def router_dir(pair_dir, tmp_path_factory):
    """A saved untrained router naming the tiny pair's folders (loads with from_pretrained alone)."""
    from transformers import AutoModelForCausalLM

    slm, llm = (AutoModelForCausalLM.from_pretrained(p) for p in pair_dir)
    path = tmp_path_factory.mktemp("router")
    R2RForCausalLM.from_models(slm, llm, **SMALL_ROUTER).save_pretrained(path)
    return path


@pytest.fixture
def batch(tok):
    return tok(PROMPTS, return_tensors="pt", padding=True)


@pytest.fixture
def single(tok):
    return tok(PROMPTS[:1], return_tensors="pt")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A labeling run with a learnable rule (``synthetic_labels``), written once per test module."""
    from synthetic_labels import write_synthetic_run

    root = tmp_path_factory.mktemp("synthetic")
    write_synthetic_run(root)
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The labeling tests' tiny related SLM and LLM and a judge, as local folders, once per test module."""
    from pipeline_helpers import make_models

    return make_models(tmp_path_factory.mktemp("models"))


@pytest.fixture
def serve_process(router_dir, pair_dir):
    """Starts ``r2r-hf serve`` over the tiny router as processes (``serving.Server``); all stopped after the test."""
    from serving import Server

    started = []

    def start(*flags, **kwargs):
        started.append(Server(router_dir, pair_dir, *flags, **kwargs))
        return started[-1]

    yield start
    failures = []
    for s in started:  # every one, even after one fails to stop
        try:
            s.stop()
        except Exception as err:  # noqa: BLE001 - raised once the others are stopped
            failures.append(err)
    if failures:
        raise failures[0]
