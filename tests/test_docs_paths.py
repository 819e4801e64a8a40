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
PLACEHOLDERS = {"FILE", "TEST"}


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


def test_named_tests_exist():
    """`tests/x.py::test_y` or `tests/x.py::TestClass::test_y` (docs/reliability.md names one per guarantee) names a
    test in that file (in that class)."""
    missing = []
    for f, text in _scanned():
        for m in re.finditer(r"(tests/\w+\.py)::(\w+)(?:::(\w+))?", text):
            p = REPO / m.group(1)
            if not p.is_file():
                continue
            src = p.read_text(encoding="utf-8")
            if m.group(3):  # tests/x.py::TestClass::test_y
                cls = re.search(rf"^class {m.group(2)}\b.*?(?=^class |\Z)", src, re.S | re.M)
                ok = cls is not None and re.search(rf"\bdef {m.group(3)}\b", cls.group(0))
            else:
                ok = re.search(rf"\b(def|class) {m.group(2)}\b", src)  # a test, or a class of them
            if not ok:
                missing.append(f"{f}: {m.group(0)}")
    assert not missing, "tests named but not defined:\n" + "\n".join(missing)


def test_no_pointer_outside_the_repository():
    bad = []
    for f, text in _scanned():
        for i, ln in enumerate(text.splitlines(), 1):
            if "../shared/" in ln or re.search(r"\b(ANCHORS|RUNNER-ANCHORS|BENCHMARKING|SEEDS)\.md\b", ln):
                bad.append(f"{f}:{i}")
    assert not bad, "pointers at notes that are not in the repository: " + ", ".join(bad)
