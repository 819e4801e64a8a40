"""Every repository path that the docs, the README and the code's comments name exists (a file moved or
removed leaves no pointer behind), and nothing points outside the repository at notes it does not hold."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = ("toolkit", "export", "android_runner", "adapters", "tests", "docs", ".ci")
# a path under one of the top-level directories, not inside a longer word or path
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*{}-]*[\w*}])")
SUFFIXES = (".py", ".md", ".cpp", ".h", ".toml", ".txt", ".cmake", ".sh", "Makefile", "run")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / f for f in out.split() if f.endswith(SUFFIXES)]


def _exists(name: str, where: Path) -> bool:
    if any(c in name for c in "*{"):  # a pattern: some tracked file starts as it does
        prefix = re.split(r"[*{]", name)[0]
        return any(str(t.relative_to(REPO)).startswith(prefix) for t in _tracked())
    for base in (REPO, where.parent):  # as given, or relative to the naming file (CMake's own paths)
        p = base / name
        # a file, a directory, a stem whose files differ by extension (docs/img/x.*), or a build target
        # named after its source (android_runner/tests/check_kernels <- check_kernels.cpp)
        if p.exists() or any(p.parent.glob(p.name + ".*")):
            return True
    return False


def test_every_named_repository_path_exists():
    missing = []
    for f in _tracked():
        if f.resolve() == Path(__file__).resolve():
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in PATH.finditer(text):
            name = m.group(1).rstrip(".")
            if re.search(r"/[A-Z][A-Z_]+(\.\w+)?$", name):  # a placeholder (tests/FILE.py)
                continue
            if not _exists(name, f):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{f.relative_to(REPO)}:{line}: {name}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_no_pointer_outside_the_repository():
    bad = []
    for f in _tracked():
        if f.resolve() == Path(__file__).resolve():
            continue
        for i, ln in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if "../shared" in ln or re.search(r"\b(ANCHORS|RUNNER-ANCHORS|BENCHMARKING|SEEDS)\.md\b", ln):
                bad.append(f"{f.relative_to(REPO)}:{i}")
    assert not bad, "pointers at notes that are not in the repository: " + ", ".join(bad)
