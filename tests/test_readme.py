"""The README's own lines run as written, after what `make demo` leaves behind, on a tiny pair; and the README stays
a page a newcomer reads in minutes, with every docs/ page linked from it.

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
DOCS = ROOT / "docs"
ROUTER = "hub_cards/r2r-qwen2.5-coder-0.5b-1.5b"
PAIR = ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")


def _section(title: str, text: str = README) -> str:
    """From ``title`` to the next heading of any level (of the README, or of ``text``)."""
    start = text.index(title)
    found = re.search(r"\n#{2,4} ", text[start + len(title):])
    return text[start : start + len(title) + found.start() if found else len(text)]


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


def test_the_quickstart_and_the_other_ways_to_load_run_as_written(after_demo):
    env, work = after_demo
    generate_page = (DOCS / "generate.md").read_text(encoding="utf-8")
    blocks = _blocks(_section("## Quickstart"), "python") + _blocks(_section("## Other ways to load", generate_page),
                                                                   "python")
    assert len(blocks) == 2 and f'router = "{ROUTER}"' in blocks[0] and "from_models(slm, llm)" in blocks[1]
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


def test_the_layout_page_names_every_module_in_its_folders_row():
    """docs/layout.md is the module-by-module map: each package row names every module of that package (a module
    added, moved or renamed without the map changing fails here)."""
    rows = {}
    for line in (DOCS / "layout.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `((?:r2r_hf|benchmarks)/[\w/]*?)/?` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    assert {"r2r_hf/core", "r2r_hf/core/layouts", "r2r_hf/core/fast", "r2r_hf/serve", "benchmarks/gpu"} <= set(rows)
    missing = []
    for folder, text in rows.items():
        for path in sorted((ROOT / folder).glob("*.py")) + sorted((ROOT / folder).glob("*.sh")):
            if path.name != "__init__.py" and f"`{path.name}`" not in text:
                missing.append(f"{folder}/{path.name}")
    assert not missing, f"docs/layout.md does not name {missing}"


def test_the_readme_is_short_and_links_every_docs_page():
    lines = README.splitlines()
    assert len(lines) <= 250, f"the README has {len(lines)} lines: move detail to a docs/ page (at most 250)"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > 300]
    assert not long, f"README lines {long} are over 300 characters"
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if f"](docs/{page.name})" not in README]
    assert not unlinked, f"the README does not link {unlinked}"


def test_the_readme_layout_has_one_line_per_package():
    tree = _blocks(_section("## Layout"), "")[0]
    listed = {line.split()[0].rstrip("/") for line in tree.splitlines() if line.strip()}
    packages = {str(init.parent.relative_to(ROOT)) for top in ("r2r_hf", "benchmarks")
                for init in (ROOT / top).rglob("__init__.py")}
    assert packages <= listed, f"the README's Layout has no line for {sorted(packages - listed)}"


def test_every_relative_link_of_the_readme_and_docs_names_a_file_there():
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(ROOT.glob("benchmarks/results/*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to nothing: {broken}"
