"""Every repository path that the docs, the README and the code's comments name exists in the repository
(a file moved or removed leaves no pointer behind), and nothing points outside the repository at notes it
does not hold."""
from __future__ import annotations

import fnmatch
import functools
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("toolkit", "export", "android_runner", "adapters", "tests", "docs", ".ci")
# a path under one of the top-level directories, not inside a longer word or path
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*{},-]*[\w*}])")
# (pyproject.toml is left out: its package-data paths are relative to each package)
SCANNED = (".py", ".md", ".cpp", ".h", ".txt", ".cmake", ".sh", "Makefile", "run")
PLACEHOLDERS = {"FILE", "TEST", "CLASS"}


@functools.lru_cache(maxsize=1)
def _tracked() -> tuple[str, ...]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git work tree")
    return tuple(f for f in out.decode().split("\0") if f)


@functools.lru_cache(maxsize=1)
def _known() -> frozenset[str]:
    """Every tracked file and every directory holding one."""
    out = set()
    for f in _tracked():
        parts = f.split("/")
        out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(out)


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def _exists(name: str, where: str) -> bool:
    known = _known()
    for n in _expand(name):
        bases = [""] + ([where.rsplit("/", 1)[0] + "/"] if where.endswith(("CMakeLists.txt", ".cmake")) else [])
        ok = False
        for base in bases:  # as given, or (CMake's own paths) relative to the naming file
            p = base + n
            if "*" in p:
                ok = any(fnmatch.fnmatch(k, p) for k in known)
            else:  # a file or a directory (a stem such as docs/img/x is no name of a file)
                ok = p in known
            if ok:
                break
        if not ok:
            return False
    return True


@functools.lru_cache(maxsize=1)
def _scanned() -> tuple[tuple[str, str], ...]:
    return tuple((f, (REPO / f).read_text(encoding="utf-8", errors="replace")) for f in _tracked()
                 if f.endswith(SCANNED) and (REPO / f).is_file() and (REPO / f).resolve() != Path(__file__).resolve())


def test_every_named_repository_path_exists():
    missing = []
    for f, text in _scanned():
        for m in PATH.finditer(text):
            name = m.group(1)
            if Path(name).stem in PLACEHOLDERS:  # tests/FILE.py::TEST
                continue
            if not _exists(name, f):
                missing.append(f"{f}:{text.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


@functools.lru_cache(maxsize=None)
def _test_names(path: Path) -> frozenset[str]:
    """The pytest node names a test file defines: `test_x` (module level) and `TestC`, `TestC::test_x`."""
    import ast

    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}::{f.name}" for f in node.body
                         if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return frozenset(names)


# `tests/x.py` (optionally `::test_y` or `::TestC::test_y`), and the shorthand `::TestC::test_y` / `::test_y`
# for a test of the file named last before it on the same line
NODE = re.compile(r"(tests/\w+\.py)(?:::(\w+(?:::\w+)?))?|(?<![\w:])::(\w+(?:::\w+)?)")


def test_named_tests_exist():
    """Every test docs/reliability.md (and any doc or comment) names, as `tests/x.py::test_y`,
    `tests/x.py::TestClass::test_y` or the shorthand `::...` for the file named last on its line, is a
    test that file defines, at that place (a method of a class is not a module-level test)."""
    missing = []
    for f, text in _scanned():
        for line in text.splitlines():
            last = None
            for m in NODE.finditer(line):
                if m.group(1):
                    last, name = REPO / m.group(1), m.group(2)
                else:
                    name = m.group(3)
                if name is None or last is None or not last.is_file():
                    continue
                if set(name.split("::")) <= PLACEHOLDERS:
                    continue
                if name not in _test_names(last):
                    missing.append(f"{f}: {m.group(0)} ({last.relative_to(REPO)})")
    assert not missing, "tests named but not defined:\n" + "\n".join(missing)


def test_no_pointer_outside_the_repository():
    bad = []
    for f, text in _scanned():
        for i, ln in enumerate(text.splitlines(), 1):
            if "../shared/" in ln or re.search(r"\b(ANCHORS|RUNNER-ANCHORS|BENCHMARKING|SEEDS)\.md\b", ln):
                bad.append(f"{f}:{i}")
    assert not bad, "pointers at notes that are not in the repository: " + ", ".join(bad)
