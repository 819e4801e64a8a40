"""No import cycles between the project's modules or packages, function-level imports included.

Every module under toolkit/, export/, adapters/ and android_runner/ is parsed with `ast`; every
`import` and `from ... import` anywhere in it (module level, inside functions, under
TYPE_CHECKING) is an edge to the project module it names, relative imports resolved. Packages are
the first two dotted parts under toolkit (toolkit.runtime, toolkit.models, ...) and the top-level
folder otherwise (export, adapters, android_runner); the root modules directly in toolkit/
(toolkit.cli, toolkit.errors, ...) are left out of the package graph.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("toolkit", "export", "adapters", "android_runner")


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the project's packages."""
    mods = {}
    for top in TOPS:
        for p in sorted((root / top).rglob("*.py")):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The project module that `name` (a module, or a name inside one) resolves to."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in its file)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level-1 packages
                    pkg = m.split(".") if is_pkg else m.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in TOPS:
                    continue
                target = _owner(name, mods)
                # a package importing its own submodule is not an edge back to itself
                if target and target != m and not m.startswith(target + "."):
                    graph[m].add(target)
    return graph


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "toolkit":
        return ".".join(parts[:2]) if len(parts) > 2 else None  # toolkit root modules: no package
    return parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            pa, pb = package_of(a), package_of(b)
            if pa and pb and pa != pb:
                out.setdefault(pa, set()).add(pb)
                out.setdefault(pb, set())
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 1000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _edges_within(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    return "; ".join(f"{a} -> {', '.join(sorted(graph[a] & members))}" for a in comp if graph[a] & members)


def _report(kind: str, graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return f"{len(found)} {kind} import cycle(s):\n" + "\n".join(
        f"  {' <-> '.join(c)}  (edges: {_edges_within(graph, c)})" for c in found)


def test_no_module_cycles():
    graph = import_graph(project_modules(ROOT))
    found = cycles(graph)
    assert not found, _report("module", graph, found)


def test_no_package_cycles():
    graph = package_graph(import_graph(project_modules(ROOT)))
    found = cycles(graph)
    assert not found, _report("package", graph, found)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a cycle closed by a function-level relative import is found, and so is
    the package cycle it makes; a package importing its own submodule is not a cycle."""
    for d in ("toolkit/models", "toolkit/runtime", "export"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "toolkit" / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "models" / "__init__.py").write_text("from . import spec\n")
    (tmp_path / "toolkit" / "models" / "spec.py").write_text("def f():\n    from ..runtime.store import S\n")
    (tmp_path / "toolkit" / "runtime" / "__init__.py").write_text("")
    (tmp_path / "toolkit" / "runtime" / "store.py").write_text("from toolkit.models.spec import f\nS = 1\n")
    (tmp_path / "export" / "__init__.py").write_text("")
    (tmp_path / "export" / "bundle.py").write_text("import toolkit.runtime.store\n")
    graph = import_graph(project_modules(tmp_path))
    assert graph["toolkit.models.spec"] == {"toolkit.runtime.store"}
    assert graph["toolkit.runtime.store"] == {"toolkit.models.spec"}
    assert graph["toolkit.models"] == {"toolkit.models.spec"}
    assert cycles(graph) == [["toolkit.models.spec", "toolkit.runtime.store"]]
    assert cycles(package_graph(graph)) == [["toolkit.models", "toolkit.runtime"]]
    (tmp_path / "toolkit" / "models" / "spec.py").write_text("def f():\n    pass\n")
    graph = import_graph(project_modules(tmp_path))
    assert cycles(graph) == [] and cycles(package_graph(graph)) == []
