"""Every example runs, on tiny local models."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from pipeline_helpers import make_models, write_prompts
from r2r_hf import R2RForCausalLM

from conftest import SMALL_ROUTER

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    slm, llm, verifier = make_models(root)
    router = root / "router"
    model = R2RForCausalLM.from_models(AutoModelForCausalLM.from_pretrained(slm),
                                       AutoModelForCausalLM.from_pretrained(llm), threshold=0.5, **SMALL_ROUTER)
    model.save_pretrained(router)
    return {"root": root, "slm": slm, "llm": llm, "verifier": verifier, "router": str(router)}


def _run(script, *args):
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _pair(tiny):
    return ["--router", tiny["router"], "--slm", tiny["slm"], "--llm", tiny["llm"], "--max-new-tokens", "12"]


def test_quickstart(tiny):
    assert "LLM token rate" in _run("quickstart.py", *_pair(tiny))


def test_streaming_chat(tiny):
    out = _run("streaming_chat.py", *_pair(tiny))
    assert out.count("assistant: ") == 2


def test_pipeline_usage(tiny):
    out = _run("pipeline_usage.py", *_pair(tiny))
    assert "def is_prime(n):" in out


def test_quantized_llm(tiny):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes cannot be imported here")
    out = _run("quantized_llm.py", *_pair(tiny), "--bits", "8")
    assert "Linear8bitLt" in out and "LLM token rate" in out


def test_train_your_router(tiny):
    prompts = write_prompts(tiny["root"] / "prompts.jsonl", 20)
    out = _run("train_your_router.py", "--slm", tiny["slm"], "--llm", tiny["llm"], "--judge", tiny["verifier"],
               "--prompts", prompts, "--out", str(tiny["root"] / "run"), "--limit", "20", "--max-new-tokens", "32",
               "--epochs", "2", "--dtype", "float32")
    assert "expected LLM token rate" in out and "threshold" in out
    assert (tiny["root"] / "run" / "router" / "router_metrics.json").exists()
