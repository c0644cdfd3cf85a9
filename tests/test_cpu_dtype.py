"""`--dtype auto` on a CPU: bfloat16 or float32 by a measured decode step (injected here, never this machine's speed),
kept per process and per machine, overridden by a forced --dtype, and said in one line by every command that loads."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import r2r_hf.model.loading as loading

TINY_WIDTH = 64  # the tiny SLM's hidden size (r2r_hf.testing)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """r2r_hf's folder for this test alone, and no measurement left from another test in this process."""
    monkeypatch.setenv("R2R_HF_CACHE", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "_CHOICES", {})
    return tmp_path / "home"


def _timings(monkeypatch, bf16: float, fp32: float) -> list:
    calls = []

    def fake(width, dtypes, rounds=6):
        calls.append(width)
        return {"bfloat16": bf16, "float32": fp32}

    monkeypatch.setattr(loading, "decode_step_seconds", fake)
    return calls


@pytest.fixture(scope="module")
def bf16_router(tmp_path_factory):
    """A router naming a tiny pair stored in bfloat16, as the real pair's folders are."""
    from transformers import AutoModelForCausalLM

    from r2r_hf import R2RForCausalLM
    from r2r_hf.testing import save_tiny_pair

    root = tmp_path_factory.mktemp("bf16-pair")
    slm_dir, llm_dir = save_tiny_pair(root)
    for folder in (slm_dir, llm_dir):
        AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    slm, llm = (AutoModelForCausalLM.from_pretrained(p) for p in (slm_dir, llm_dir))
    R2RForCausalLM.from_models(slm, llm, router_hidden_dims=[16]).save_pretrained(root / "router")
    return root / "router", Path(slm_dir), Path(llm_dir)


@pytest.mark.parametrize("bf16, fp32, expected", [(0.030, 0.010, torch.float32), (0.004, 0.010, torch.bfloat16)])
def test_the_faster_dtype_is_chosen_and_said(home, monkeypatch, bf16, fp32, expected):
    calls = _timings(monkeypatch, bf16, fp32)
    choice = loading.cpu_dtype_choice(896)
    assert choice.dtype == expected and calls == [896]
    assert f"{bf16 * 1e3:.1f} ms in bfloat16 and {fp32 * 1e3:.1f} ms in float32" in choice.line
    assert f"loading the models in {str(expected)[6:]}" in choice.line and "width 896" in choice.line
    assert loading.bf16_is_slow_here() == (expected == torch.float32)
    assert loading.bf16_is_slow_here("cuda") is False, "an accelerator keeps the checkpoints' dtype"


def test_a_measurement_is_kept_for_the_process_and_on_disk(home, monkeypatch):
    calls = _timings(monkeypatch, 0.030, 0.010)
    first = loading.cpu_dtype_choice(896)
    assert loading.cpu_dtype_choice(896) is first and calls == [896], "measured once per process"
    stored = json.loads((home / loading.CPU_DTYPE_FILE).read_text())
    assert stored[loading.machine_key(896, torch.bfloat16)]["dtype"] == "float32"
    monkeypatch.setattr(loading, "_CHOICES", {})  # a later command on this machine
    calls.clear()
    again = loading.cpu_dtype_choice(896)
    assert calls == [] and again.dtype == torch.float32 and again.cached == str(home / loading.CPU_DTYPE_FILE)
    assert "cached in" in again.line
    loading.cpu_dtype_choice(1536)
    assert calls == [1536], "another width (or thread count, CPU, torch) is measured anew"


@pytest.mark.parametrize("entry", [
    {"dtype": "float32", "seconds": {"bfloat16": "fast", "float32": 0.01}},  # a bare ValueError before
    {"dtype": "float32", "seconds": {"bfloat16": None, "float32": 0.01}},  # a bare TypeError before
    {"dtype": "float32", "seconds": {"bfloat16": [0.03], "float32": 0.01}},
    {"dtype": "float32", "seconds": {}},  # printed "took  (2 threads)" before
    {"dtype": "float32", "seconds": {"float32": 0.01}},
    {"dtype": "float32", "seconds": {"bfloat16": float("nan"), "float32": 0.01}},
    {"dtype": "float32", "seconds": {"bfloat16": -1.0, "float32": 0.01}},
    {"dtype": "float32", "seconds": {"bfloat16": True, "float32": 0.01}},
    {"dtype": "float32", "seconds": {"bfloat16": 0.03, "float32": 0.01, "float16": 0.02}},
    {"dtype": "int8", "seconds": {"bfloat16": 0.03, "float32": 0.01}},
    "float32",
], ids=["text", "null", "list", "empty", "one-dtype", "nan", "negative", "bool", "a-third-dtype", "int8", "no-dict"])
def test_a_damaged_cache_entry_is_measured_again(home, monkeypatch, entry):
    """Issue 41, item 10: a damaged entry of cpu_dtype.json crashed --dtype auto or printed an empty measurement."""
    key = loading.machine_key(896, torch.bfloat16)
    home.mkdir(parents=True)
    (home / loading.CPU_DTYPE_FILE).write_text(json.dumps({key: entry}))
    calls = _timings(monkeypatch, 0.004, 0.010)
    choice = loading.cpu_dtype_choice(896)
    assert calls == [896] and choice.cached is None, "measured again, as if the entry were absent"
    assert choice.dtype == torch.bfloat16 and "took 4.0 ms in bfloat16 and 10.0 ms in float32" in choice.line
    stored = json.loads((home / loading.CPU_DTYPE_FILE).read_text())[key]
    assert stored["dtype"] == "bfloat16" and stored["seconds"] == {"bfloat16": 0.004, "float32": 0.010}, "replaced"


def test_an_unwritable_folder_keeps_the_choice_for_the_process(home, monkeypatch):
    home.parent.mkdir(parents=True, exist_ok=True)
    home.write_text("not a folder")
    _timings(monkeypatch, 0.030, 0.010)
    assert loading.cpu_dtype_choice(896).dtype == torch.float32


def test_the_probe_times_both_dtypes_quickly():
    seconds = loading.decode_step_seconds(TINY_WIDTH, (torch.bfloat16, torch.float32), rounds=2)
    assert set(seconds) == {"bfloat16", "float32"} and all(0 < s < 5 for s in seconds.values())


def test_auto_follows_the_measurement_and_a_forced_dtype_wins(home, monkeypatch, bf16_router, caplog):
    from r2r_hf.serve import load_for_serving

    router, slm_dir, llm_dir = (str(p) for p in bf16_router)
    for bf16, fp32, expected in ((0.030, 0.010, torch.float32), (0.004, 0.010, torch.bfloat16)):
        monkeypatch.setattr(loading, "_CHOICES", {})
        (home / loading.CPU_DTYPE_FILE).unlink(missing_ok=True)
        calls = _timings(monkeypatch, bf16, fp32)
        caplog.clear()
        model, _ = load_for_serving(router, slm_dir, llm_dir, "cpu", "auto")
        assert model.slm.dtype == expected and model.llm.dtype == expected
        assert calls == [TINY_WIDTH], "measured at the SLM's own width"
        assert sum("dtype 'auto' on this CPU: one decode step" in r.message for r in caplog.records) == 1
    for forced in ("bfloat16", "float32"):
        calls.clear()
        model, _ = load_for_serving(router, slm_dir, llm_dir, "cpu", forced)
        assert model.slm.dtype == model.llm.dtype == getattr(torch, forced) and calls == [], "--dtype wins, unmeasured"


def test_auto_keeps_float32_checkpoints(home, monkeypatch, router_dir, caplog):
    from r2r_hf.serve import load_for_serving

    calls = _timings(monkeypatch, 0.001, 0.010)
    model, _ = load_for_serving(str(router_dir))
    assert model.slm.dtype == torch.float32 and calls == [], "auto never lowers a checkpoint's precision"
    assert any("the checkpoints are float32, kept" in r.message for r in caplog.records)


# ------------------------------------------------------------------ the line each command prints
def _seeded_env(home: Path, dtype: str) -> dict:
    """A machine whose earlier measurement (1 thread, the tiny width) chose ``dtype``: the command reads it."""
    key = loading.machine_key(TINY_WIDTH, torch.bfloat16, threads=1)
    home.mkdir(parents=True, exist_ok=True)
    (home / loading.CPU_DTYPE_FILE).write_text(json.dumps(
        {key: {"dtype": dtype, "seconds": {"bfloat16": 0.0123, "float32": 0.0045}}}))
    return {**os.environ, "R2R_HF_CACHE": str(home), "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1"}


LINE = ("dtype 'auto' on this CPU: one decode step at the SLM's width 64 took 12.3 ms in bfloat16 and 4.5 ms in "
        "float32 (1 threads)")


@pytest.mark.parametrize("command, stdin", [("generate", None), ("chat", "/exit\n")])
def test_generate_and_chat_print_the_choice(tmp_path, bf16_router, command, stdin):
    router, slm_dir, llm_dir = bf16_router
    args = ["--router", str(router), "--slm", str(slm_dir), "--llm", str(llm_dir), "--max-new-tokens", "4"]
    result = subprocess.run([sys.executable, "-m", "r2r_hf.cli", "--quiet", command, *args,
                             *(["the old man"] if command == "generate" else [])],
                            env=_seeded_env(tmp_path / "home", "float32"), input=stdin, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert LINE in result.stderr and "loading the models in float32" in result.stderr and "cached in" in result.stderr
    assert result.stderr.count("dtype 'auto'") == 1


def test_serve_prints_the_choice(tmp_path, bf16_router):
    pytest.importorskip("uvicorn")
    router, slm_dir, llm_dir = bf16_router
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "r2r_hf.cli", "--quiet", "serve", str(router), "--slm",
                             str(slm_dir), "--llm", str(llm_dir), "--port", str(port)],
                            env=_seeded_env(tmp_path / "home", "bfloat16"), stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        for line in proc.stderr:  # the choice comes before the server's own first line
            seen += line
            if line.startswith("serving "):
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert LINE in seen and "loading the models in bfloat16" in seen


def test_the_demo_prints_the_choice(tmp_path, home, monkeypatch, bf16_router, caplog):
    import benchmarks.demo as demo

    router, slm_dir, llm_dir = bf16_router
    monkeypatch.setattr(demo, "fetch", lambda role: str(slm_dir if role == "slm" else llm_dir))
    monkeypatch.setattr(demo, "ROUTER", str(router))
    calls = _timings(monkeypatch, 0.030, 0.010)
    assert demo.main(["--threads", "1", "--max-new-tokens", "4", "--prompt", "hi", "--html",
                      str(tmp_path / "demo.html")]) == 0
    assert calls == [TINY_WIDTH], "the demo leaves the dtype to --dtype auto"
    assert any("loading the models in float32" in r.message for r in caplog.records)
