"""The installable packages: every directory of Python modules under them is a regular package (has an
__init__.py), since setuptools' package finder (pyproject.toml) leaves a directory without one out of a
wheel: a non-editable install would then miss it."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("toolkit", "export", "android_runner", "adapters")


def test_every_module_directory_is_a_package():
    missing = []
    for top in PACKAGES:
        for d in [REPO / top, *sorted(p for p in (REPO / top).rglob("*") if p.is_dir())]:
            if "__pycache__" in d.parts or not any(d.glob("*.py")):
                continue
            if not (d / "__init__.py").is_file():
                missing.append(str(d.relative_to(REPO)))
    assert not missing, f"directories of modules without __init__.py (left out of a wheel): {missing}"


def test_every_shipped_model_directory_is_package_data():
    """The shipped models' files (toolkit/embedded/<name>/) go into a wheel only if pyproject.toml's
    package-data names them."""
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["toolkit"]
    shipped = sorted(d.name for d in (REPO / "toolkit" / "embedded").iterdir()
                     if d.is_dir() and d.name != "__pycache__" and not any(d.glob("*.py")))
    assert shipped, "no shipped model directory found"
    missing = [n for n in shipped if f"embedded/{n}/*" not in data]
    assert not missing, f"toolkit/embedded/ directories left out of pyproject.toml's package-data: {missing}"
