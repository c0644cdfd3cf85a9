"""The shape of the code, held: the core's import graph (no cycle, few layers, nothing above it imported), module
and function sizes, and where the step's decisions and its rollback live. Each check reads the source (``ast``);
none imports a model."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "r2r_hf" / "core"
WINGS = ("layouts", "fast")  # the core's subpackages, each one node of its graph (their modules import each other)
BELOW_CORE = {"r2r_hf.compat", "r2r_hf.router"}  # what the core may import from outside it


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from x import y`` also names ``x.y``)."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


def _node(module: str) -> str:
    """A core module's node in the graph: its wing where it lives in one."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 and parts[2] in WINGS else module


def core_graph() -> dict[str, set[str]]:
    """The core's import graph, each wing one node (the package's own ``__init__`` left out: it only documents)."""
    modules = {_module(p): p for p in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if name == "r2r_hf.core":
            continue
        targets = {_node(m) for m in _imports(path) if m in modules and m != "r2r_hf.core"}
        graph.setdefault(_node(name), set()).update(targets - {_node(name)})
    return graph


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's layer: 1 + the deepest layer it imports (a cycle raises)."""
    depth: dict[str, int] = {}

    def visit(node: str, path: tuple[str, ...]) -> int:
        if node in path:
            raise AssertionError(f"an import cycle: {' -> '.join(path[path.index(node):] + (node,))}")
        if node not in depth:
            depth[node] = 1 + max((visit(t, path + (node,)) for t in graph[node]), default=0)
        return depth[node]

    for node in graph:
        visit(node, ())
    return depth


def _function(path: Path, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)


def _class(path: Path, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name == name)


def _calls(node: ast.AST) -> list[str]:
    """The names of the functions and methods ``node`` calls, in order."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.append(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_the_core_has_no_cycle_at_most_six_layers_and_imports_nothing_above_it():
    depth = layers(core_graph())
    assert max(depth.values()) <= 6, sorted(depth.items(), key=lambda kv: kv[1])
    for path in CORE.rglob("*.py"):
        outside = {m for m in _imports(path) if m.startswith("r2r_hf.") and not m.startswith("r2r_hf.core")}
        assert outside <= BELOW_CORE | {f"{m}.{n}" for m in BELOW_CORE for n in _names(m)}, (path, outside)


def _names(module: str) -> set[str]:
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def test_modules_stay_near_one_idea():
    """One idea per module: about 350 lines is the guide, and a module that grows past it is split where an idea ends
    (never by moving code into a room it does not belong to, to fit). The bound is the guide with room, so a change
    can finish before its split."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "r2r_hf").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_the_step_shows_both_decisions_and_the_ledger_is_its_one_writer():
    step = _function(CORE / "turn.py", "decode_step")
    calls = _calls(step)
    order = [c for c in calls if c in {"propose", "sync", "plan_step", "read_llm", "settle", "commit", "apply"}]
    assert order == ["propose", "sync", "plan_step", "read_llm", "settle", "commit", "apply"], order
    progress = re.compile(r"(\brow|\brows\[[^\]]+\])\.(written|confirmed|pending|tail|waiting_since|max_new)\s*[-+]?=")
    for path in [*(ROOT / "r2r_hf").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        text = path.read_text()
        assert "settled is None" not in text, path
        if path.name != "ledger.py":  # a row's progress is written by ``Ledger.apply`` (and its helpers) only; rows
            # join, get ready and leave through ``admit``, ``ready`` and ``release``
            assert not progress.search(text), (path, progress.search(text))
            assert not re.search(r"ledger\.rows(\[[^\]]+\])?\s*=[^=]|\.prefilling\s*=[^=]", text), path


def test_who_goes_on_and_who_waits_is_written_once_on_the_host_and_once_on_the_device():
    """``moves.move`` is the rule: ``plan_step`` decides every step's moves with it, and the host's form of a draft
    block (``draft_on_host``, the replay's) too; ``drafts.device_move`` is its device form, the one place
    ``draft_fn`` decides a move (tests/test_moves.py holds the two equal). A block is planned once and each drafted
    step's plan is made from the moves the device made, never planned again to check them."""
    assert "move" in _calls(_function(CORE / "plan.py", "plan_step"))
    assert "move" in _calls(_function(CORE / "moves.py", "draft_on_host"))
    assert "device_move" in _calls(_function(CORE / "fast" / "drafts.py", "draft_fn"))
    assert "draft_on_host" in _calls(_function(ROOT / "benchmarks" / "serving" / "replay.py", "drafted_block"))
    block = _calls(_function(CORE / "turn.py", "decode_block"))
    assert {"plan_block", "plan_moves", "apply"} <= set(block) and "plan_step" not in block, block
    clause = re.compile(r"pending\)?\s*(\+\s*1\s*)?(<|>=|>|<=)\s")  # a pending count held against a bound
    homes = {p.relative_to(ROOT).as_posix() for p in [*(ROOT / "r2r_hf").rglob("*.py"), *(ROOT / "benchmarks").rglob(
        "*.py")] if clause.search(p.read_text())}
    assert homes == {"r2r_hf/core/moves.py", "r2r_hf/core/fast/drafts.py"}, homes


def test_the_device_side_of_a_rollback_is_one_function_called_from_one_place():
    cutters = [p for p in (ROOT / "r2r_hf").rglob("*.py") if "layout.cut(" in p.read_text()]
    assert [p.name for p in cutters] == ["speculation.py"], cutters
    roll_back = _function(CORE / "speculation.py", "roll_back")
    assert {"restore", "cut"} <= set(_calls(roll_back))
    callers = [p for p in (ROOT / "r2r_hf").rglob("*.py") if "roll_back(" in p.read_text().replace("def roll_back(", "")]
    assert [p.name for p in callers] == ["batch.py"], callers
    assert "def restore(" in (CORE / "budget.py").read_text() and "budget_log" not in (CORE / "batch.py").read_text()


def test_the_batch_and_the_replay_do_what_the_plan_decided_and_decide_nothing():
    """``RunningBatch`` (the device side of a step) and the replay's ``ReplayBatch`` (its priced stand-in) hold rows,
    caches and counts; what a step does is decided in ``plan``/``moves`` and applied by the ledger. Neither has a
    base class to hide a rule in, and ``generate``'s loop reads in one screen."""
    decisions = {"plan_step", "settle", "move", "plan_block", "plan_moves", "depth"}
    for path, name in ((CORE / "batch.py", "RunningBatch"), (ROOT / "benchmarks" / "serving" / "replay.py",
                                                                 "ReplayBatch")):
        cls = _class(path, name)
        assert cls.bases == [] and not decisions & set(_calls(cls)), (name, decisions & set(_calls(cls)))
    decode = _function(CORE / "decoding.py", "r2r_decode")
    assert decode.end_lineno - decode.lineno + 1 <= 35
