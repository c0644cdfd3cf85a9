"""The README's own lines run as written, after what `make demo` leaves behind, on a tiny pair.

`make demo` registers the shipped router's folder under the path the README writes and the converted
pair under its Hub ids (``r2r_hf.model.sources``). Here the same registry points at a tiny router that
names the same Hub ids and at tiny models, so the README's code blocks and shell lines run verbatim,
from a folder outside the clone, without a network.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from r2r_hf import R2RForCausalLM
from r2r_hf.testing import save_tiny_pair

from conftest import SMALL_ROUTER

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
ROUTER = "hub_cards/r2r-qwen2.5-coder-0.5b-1.5b"
PAIR = ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")


def _section(title: str) -> str:
    """From ``title`` to the next heading of any level."""
    start = README.index(title)
    found = re.search(r"\n#{2,4} ", README[start + len(title):])
    return README[start : start + len(title) + found.start() if found else len(README)]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def after_demo(tmp_path_factory):
    """Environment of a machine after `make demo`: the registry, the tiny pair as the Qwen ids; a folder to run in."""
    root = tmp_path_factory.mktemp("after-demo")
    slm_dir, llm_dir = save_tiny_pair(root / "models", related=True)  # related: they agree on many tokens
    slm, llm = AutoModelForCausalLM.from_pretrained(slm_dir), AutoModelForCausalLM.from_pretrained(llm_dir)
    router = R2RForCausalLM.from_models(slm, llm, slm_name_or_path=PAIR[0], llm_name_or_path=PAIR[1], threshold=0.5,
                                        **SMALL_ROUTER)
    router.save_pretrained(root / "router")
    env = {**os.environ, "R2R_HF_CACHE": str(root / "home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    register = ("from r2r_hf.model.sources import register_local_copy as r; import sys; "
                "r(sys.argv[1], sys.argv[2], 'the tiny test router', fallback=False); "
                "[r(n, p, 'a tiny test model') for n, p in zip(sys.argv[3:5], sys.argv[5:7])]")
    subprocess.run([sys.executable, "-c", register, ROUTER, str(root / "router"), *PAIR, slm_dir, llm_dir], env=env,
                   check=True)
    work = root / "elsewhere"  # outside the clone: the relative router path names nothing here
    work.mkdir()
    return env, work


def _run(command: list[str], env: dict, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(command, env=env, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{shlex.join(command)}\n{result.stderr[-3000:]}"
    return result


def test_the_quickstart_blocks_run_as_written(after_demo):
    env, work = after_demo
    blocks = _blocks(_section("## Quickstart"), "python")
    assert len(blocks) == 2 and f'router = "{ROUTER}"' in blocks[0]
    out = _run([sys.executable, "-c", "\n".join(blocks)], env, work)
    assert "def fibonacci(n):" in out.stdout
    assert "using the local copy" in out.stderr, "the use of a registered copy is said"
    assert (work / "my-router" / "generation_config.json").exists()


def test_the_shell_lines_after_make_demo_run_from_any_folder(after_demo):
    env, work = after_demo
    lines = [line for line in _blocks(_section("## Two commands on a fresh machine"), "bash")[1].splitlines()
             if line.strip() and not line.startswith("source ")]
    assert lines == [f'r2r-hf generate --router {ROUTER} "Write a function that reverses a list."',
                     "python examples/quickstart.py"]
    generated = _run(shlex.split(lines[0]), env, work)
    assert "LLM token rate" in generated.stderr
    assert f"The router {ROUTER}: using the local copy" in generated.stderr
    assert f"The SLM {PAIR[0]}: using the local copy" in generated.stderr
    example = _run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--max-new-tokens", "8"], env, work)
    assert "LLM token rate" in example.stdout


def test_the_chat_line_runs_and_exits(after_demo):
    env, work = after_demo
    line = next(line for line in _blocks(_section("### From the shell"), "bash")[0].splitlines()
                if line.startswith("r2r-hf chat"))
    command = shlex.split(line.split("#")[0]) + ["--max-new-tokens", "6"]
    out = _run(command, env, work, stdin="hello\n/exit\n")
    assert "LLM token rate" in out.stderr


def test_every_example_runs_with_no_arguments_after_make_demo(after_demo):
    env, work = after_demo
    scripts = ["quickstart.py", "streaming_chat.py", "pipeline_usage.py"]
    try:
        import bitsandbytes  # noqa: F401
        scripts.append("quantized_llm.py")
    except ImportError:
        pass
    for script in scripts:
        _run([sys.executable, str(ROOT / "examples" / script)], env, work)


def test_training_a_router_runs_on_its_defaults_after_make_demo(after_demo):
    env, work = after_demo
    # The defaults: the demo's pair (by Hub id), the shipped training prompts, ./my-run; kept small here.
    out = _run([sys.executable, str(ROOT / "examples" / "train_your_router.py"), "--limit", "4", "--max-new-tokens",
                "16", "--epochs", "1", "--dtype", "float32", "--llm-rate", "0.2"], env, work)
    assert "threshold" in out.stdout and (work / "my-run" / "router" / "config.json").exists()


def test_the_layout_section_names_every_module_in_its_folders_row():
    """The README's Layout table is the map a newcomer reads: each package row names every module of that package
    (a module added, moved or renamed without the map changing fails here)."""
    layout = README[README.index("## Layout"):README.index("## Citation")]
    rows = {}
    for line in layout.splitlines():
        match = re.match(r"\| `(r2r_hf/[\w/]+)/` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    assert {"r2r_hf/core", "r2r_hf/core/layouts", "r2r_hf/core/fast", "r2r_hf/serve"} <= set(rows)
    missing = []
    for folder, text in rows.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name != "__init__.py" and f"`{path.name}`" not in text:
                missing.append(f"{folder}/{path.name}")
    assert not missing, f"the README's Layout table does not name {missing}"
