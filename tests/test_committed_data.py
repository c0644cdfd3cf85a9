"""Committed data carries nothing of the machine that made it (issue 52, item 7).

The shipped router's training prompts once rendered ``os.environ`` as a default argument by its repr: the whole
environment of the generating machine (paths, variables, container name) in two prompts; a results file named the
judge by its path in a home directory. Every tracked data, results and documentation file is scanned for an
environment dump, a home directory, a container's name or id and this machine's host name; the prompt generator
writes ``os.environ`` as ``os.environ``.
"""

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from benchmarks.router.stdlib_prompts import _code

ROOT = Path(__file__).resolve().parents[1]
# Data, results and documentation: what a run writes or a person commits as text (source code is reviewed as such).
SCANNED = (".json", ".jsonl", ".md", ".csv", ".txt", ".log", ".yaml", ".yml", ".html")
LEAKS = {
    "an environment dump": r"environ\(\{|['\"](?:PATH|HOME|SHELL|PWD|USER|HOSTNAME)['\"]\s*:\s*['\"]",
    "an environment variable": r"\b(?:HOME|HOSTNAME|USER|PWD|SHELL)=[/\w]",
    "a home directory": r"(?<![\w.~])/(?:root|home/[^/\s\"']+|Users/[^/\s\"']+)(?=[/\s\"']|$)|[A-Za-z]:\\\\Users\\\\",
    "a container's name or id": r"(?i)\bcontainer[_ -]?(?:name|id)\b",
}


def leaks(text: str, host: str | None = None) -> list[str]:
    """What of the machine ``text`` holds: each kind found, with the first match."""
    found = [f"{kind}: {m.group(0)!r}" for kind, pattern in LEAKS.items() if (m := re.search(pattern, text))]
    if host and len(host) >= 4 and re.search(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", text):
        found.append(f"this machine's host name: {host!r}")
    return found


def tracked_files() -> list[Path]:
    """Every file git tracks here, with a scanned suffix."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an installed wheel's copy of the tests): no tracked files to scan")
    return [ROOT / name for name in out.decode().split("\0") if name.endswith(SCANNED)]


def test_the_scan_finds_each_kind_of_leak():
    assert leaks("def parse(fp=None, environ=environ({'SHELL': '/bin/bash'}))")
    assert leaks('{"PATH": "/usr/bin"}') and leaks("HOSTNAME=builder-7")
    assert leaks('"judge": "/root/.cache/r2r_hf/qwen"') and leaks("/home/alice/work") and leaks("C:\\\\Users\\\\bob")
    assert leaks("CONTAINER_NAME") and leaks("made on buildhost-42", host="buildhost-42")
    assert not leaks("def parse(fp=None, environ=os.environ): see ~/.cache/r2r_hf and /tmp/x; route_scores")


def test_no_committed_file_carries_the_machine_that_made_it():
    files = tracked_files()
    assert any(f.name == "stdlib_prompts.jsonl" for f in files) and len(files) > 50
    host = socket.gethostname()
    found = {}
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if hits := leaks(line, host):
                found[f"{path.relative_to(ROOT)}:{n}"] = hits
    assert not found, found


def test_the_prompt_generator_writes_os_environ_as_such():
    def parse(fp=None, environ=os.environ, keep_blank_values=0):
        """Parse a query in the environment or from a file (the default file is sys.stdin); a long enough
        docstring for the generator to take it."""

    code = _code("parse", parse)
    assert not leaks(code), leaks(code)  # (the code itself is not shown: it could hold this machine's environment)
    assert code.startswith("def parse(fp=None, environ=os.environ, keep_blank_values=0):\n")
