"""No import circles among the package's own modules: every module of ``portable_ssm`` (its core,
``io`` and ``bench``, ``backends`` installed as ``portable_ssm.backends`` and ``market`` as
``portable_ssm.market``) is parsed with ``ast``, and each import of another of them, at module
level or inside a function, is an edge (to the submodule where one is named, else to the module or
package imported from); the graph must have no cycle, so each folder is one layer below the modules
that use it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Installed package name -> its folder in the checkout (pyproject's package-dir).
FOLDERS = {"portable_ssm": ROOT / "portable_ssm", "portable_ssm.backends": ROOT / "backends",
           "portable_ssm.market": ROOT / "market"}


def modules() -> dict[str, Path]:
    """Every module's dotted name -> its file (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if ".venv" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's own modules that module ``name`` (its file ``path``) imports anywhere in it."""
    out: set[str] = set()
    package = _package_of(name, path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = []
            for alias in node.names:  # a submodule where one is named, else the module itself
                sub = f"{source}.{alias.name}"
                targets.append(sub if sub in known else source)
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``edges`` as the modules along it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_graph_covers_every_folder_and_both_kinds_of_import():
    edges = graph()
    assert {"portable_ssm.lm", "portable_ssm.io", "portable_ssm.bench.runner", "portable_ssm.backends.numpy.ops",
            "portable_ssm.market.bars"} <= set(edges)
    assert "portable_ssm.backends.numpy.kernels" in edges["portable_ssm.backends.numpy.ops"]  # module level
    assert "portable_ssm.params" in edges["portable_ssm.bench.peak"]  # inside a function


def test_find_cycle_names_the_modules_around_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_has_no_import_circles():
    cycle = find_cycle(graph())
    assert cycle is None, "an import circle: " + " -> ".join(cycle)
