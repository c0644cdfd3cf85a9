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

PROMPTS = ["the old man said that he was", "water"]
SMALL_ROUTER = dict(router_hidden_dims=[32, 32], router_expansion=2)


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
