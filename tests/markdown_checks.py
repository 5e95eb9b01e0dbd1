"""Helpers shared by tests/test_readme.py and tests/test_docs.py: the fenced blocks of a Markdown
page, running a Python block alone, and the ``--help`` of a command line a page shows."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of ``text`` in ``language``."""
    return [body for lang, body in FENCE.findall(text) if lang == language]


def block_id(body: str) -> str:
    """A test id for a block: its first line that is not blank or an import."""
    return next(line for line in body.splitlines() if line.strip() and not line.startswith("import"))[:40]


def missing_library(code: str) -> str | None:
    """Why a Python block cannot run here (a library it uses is not installed), or None."""
    for module in ("torch", "transformers", "jax"):
        imported = re.search(rf"^\s*(import|from) [^#\n]*\b{module}\b", code, re.M)
        if (imported or f'backend="{module}"' in code) and not importlib.util.find_spec(module):
            return f"the block uses {module}, which is not installed"
    if "portable_ssm.market" in code and not importlib.util.find_spec("databento_dbn"):
        return "the block uses portable_ssm.market, whose DBN files need databento-dbn (the [market] extra)"
    return None


def run_python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter in ``cwd``, nothing from the repository on the path."""
    env = {**os.environ, "PYTHONPATH": "", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def command_lines(text: str) -> list[str]:
    """Each command of the bash blocks of ``text``, comments stripped, ``a && b`` split."""
    lines = []
    for body in blocks(text, "bash"):
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            lines += [part.strip() for part in line.split("&&") if part.strip()]
    return lines


def help_command(line: str) -> list[str] | None:
    """The ``--help`` invocation of the program a command line runs (None for installs)."""
    words = shlex.split(line)
    if words[0] in ("pip", "pytest"):
        return None
    if words[0] in ("python", "torchrun"):
        script = next(w for w in words[1:] if w.endswith(".py"))
        return [sys.executable, str(ROOT / script), "--help"]
    if words[0] == "portable-ssm":
        subcommand = [] if words[1].startswith("-") else [words[1]]  # `portable-ssm --version` is the tool's own flag
        return [sys.executable, "-m", "portable_ssm", *subcommand, "--help"]
    if words[0] == "mkdocs":
        return [sys.executable, "-m", "mkdocs", words[1], "--help"]
    raise AssertionError(f"bash line of an unknown kind (add it to the tests' policy): {line}")


def check_flags_in_help(line: str, page: str) -> None:
    """Run the ``--help`` of ``line``'s program and assert every ``--flag`` the line uses is in it."""
    import pytest

    command = help_command(line)
    if command[2] == "mkdocs":
        pytest.importorskip("mkdocs", reason="the [docs] extra")
    program = Path(command[1])
    if program.suffix == ".py":
        assert program.is_file(), f"{page} runs {program.relative_to(ROOT)}, which is not in the repository"
        if "import torch" in program.read_text() or program.parent.name == "examples" and program.stem != "demo":
            for module in ("torch", "tqdm", "matplotlib"):
                pytest.importorskip(module)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", line):
        if flag != "--nproc_per_node":  # torchrun's own flag
            assert flag in result.stdout, f"{flag} (used in {page}: {line}) is not in {' '.join(command[1:])}"


def check_declared_extras(lines: list[str]) -> None:
    """Every extra a ``pip install`` line names is declared in pyproject.toml."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for line in lines:
        for group in re.findall(r"\[([\w,-]+)\]", line):
            assert set(group.split(",")) <= declared, line
