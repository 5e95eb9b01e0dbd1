"""What a user installs: the wheel built from the repository carries py.typed, the kernels, the
licence and the metadata pyproject.toml declares."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "portable_ssm", "backends", "market")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built by pip from a copy of the sources (the checkout itself stays untouched)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(src)],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{result.stderr[-3000:]}")
    (built,) = out.glob("portable_ssm-*.whl")
    return zipfile.ZipFile(built)


@pytest.mark.slow
def test_the_wheel_marks_the_package_typed_and_ships_its_kernels(wheel):
    names = set(wheel.namelist())
    assert "portable_ssm/py.typed" in names
    assert any(n.startswith("portable_ssm/backends/cupy/kernels/") and n.endswith(".cu") for n in names)


@pytest.mark.slow
def test_the_wheel_ships_every_module_of_the_package(wheel):
    """Every .py file of the three source folders is in the wheel under its installed name: a new
    subpackage missing from pyproject.toml's list would import in a checkout and not once installed."""
    names = set(wheel.namelist())
    installed = {"portable_ssm": "portable_ssm", "backends": "portable_ssm/backends", "market": "portable_ssm/market"}
    for folder, target in installed.items():
        for path in (ROOT / folder).rglob("*.py"):
            name = f"{target}/{path.relative_to(ROOT / folder).as_posix()}"
            assert name in names, f"{name} (from {path.relative_to(ROOT)}) is not in the wheel"


@pytest.mark.slow
def test_the_wheel_ships_every_cpu_kernel_source_the_builds_read(wheel):
    from portable_ssm.backends.cpu_source import source_files

    names = set(wheel.namelist())
    sources = source_files()
    assert {p.name for p in sources} >= {"shared.h", "torch_ops.cpp", "numpy_kernels.cpp"}
    for path in sources:
        assert f"portable_ssm/backends/cpu/{path.name}" in names, path.name
        assert wheel.read(f"portable_ssm/backends/cpu/{path.name}") == path.read_bytes()


@pytest.mark.slow
def test_the_wheel_carries_the_apache_licence_and_its_spdx_expression(wheel):
    names = wheel.namelist()
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")]
    text = wheel.read(licence).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    meta = wheel.read(metadata).decode()
    for line in ("License-Expression: Apache-2.0", "License-File: LICENSE", "Classifier: Typing :: Typed",
                 "Keywords: "):
        assert line in meta, line

