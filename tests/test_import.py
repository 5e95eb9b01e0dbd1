"""Packaging and the "written once" rule: no framework on import, no framework imports in the core."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import portable_ssm

PACKAGE = pathlib.Path(portable_ssm.__file__).parent
FRAMEWORKS = {"numpy", "torch", "cupy", "jax", "jaxlib", "array_api_strict"}
#: Tooling outside the array-API core; these may import frameworks lazily, inside functions.
TOOLING = {"cli.py", "__main__.py"} | {f"bench/{p.name}" for p in (PACKAGE / "bench").glob("*.py")}
#: The byte format of safetensors files, read into and written from host NumPy arrays (imported
#: only when a file is read or written).
HOST_IO = {"io/safetensors.py"}


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_modules_import_no_array_framework():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in TOOLING:
            continue
        banned = FRAMEWORKS - {"numpy"} if name in HOST_IO else FRAMEWORKS
        assert not imported_modules(path) & banned, f"{name} imports {imported_modules(path) & banned}"


def test_only_one_core_module_touches_array_api_compat():
    users = {p.name for p in PACKAGE.rglob("*.py") if "array_api_compat" in imported_modules(p)}
    assert users == {"_array.py"}


def test_import_portable_ssm_loads_no_framework():
    code = ("import sys, portable_ssm; "
            f"print(sorted(m for m in {sorted(FRAMEWORKS)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_backends_install_under_portable_ssm_not_at_top_level():
    code = ("import importlib.util, portable_ssm.backends as b; "
            "print(b.__name__, importlib.util.find_spec('backends'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["portable_ssm.backends", "None"]


def test_tooling_files_exist_and_install_as_packages():
    assert sorted(name for name in TOOLING if not (PACKAGE / name).is_file()) == []
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert '"portable_ssm.bench"' in pyproject  # `portable-ssm bench` reaches it from an installed package
