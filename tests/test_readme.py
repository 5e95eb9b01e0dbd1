"""README.md's claims run as written.

Policy for the fenced blocks:

- Every ```python block runs alone, as written, in a fresh interpreter in an empty temporary
  directory (nothing from another block, nothing from the repository on the path). A block that
  imports torch, jax or transformers, or asks for ``backend="torch"`` / ``"jax"``, needs that
  library installed (the [torch], [jax] / [test] extras) and skips without it.
- ```bash blocks are not all run: installs change the environment and training, benchmarks or
  generation with a real model take minutes. What runs: ``python examples/demo.py`` whole (a
  second on NumPy); for every other command line (``python SCRIPT``, ``torchrun ... SCRIPT``,
  ``portable-ssm SUBCOMMAND``) its ``--help``, and every ``--flag`` the line uses must be in that
  help. For ``pip install`` lines every extra named must be declared in pyproject.toml. (The
  test command itself is what ``.ci/run`` executes; the examples' ``--quick`` claims are run to
  the end by tests/test_examples.py.)
- Every repository path README cites exists: link targets, inline-code names ending in ``.md``,
  and inline-code names containing a ``/`` whose first part is a top-level entry of the repository.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README) if lang == language]


def _block_id(body: str) -> str:
    return next(line for line in body.splitlines() if line.strip() and not line.startswith("import"))[:40]


def run_python(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": "", "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("code", blocks("python"), ids=_block_id)
def test_every_python_block_runs_alone_in_an_empty_directory(code, tmp_path):
    for module in ("torch", "transformers", "jax"):
        imported = re.search(rf"^\s*(import|from) [^#\n]*\b{module}\b", code, re.M)
        if (imported or f'backend="{module}"' in code) and not importlib.util.find_spec(module):
            pytest.skip(f"the block uses {module}, which is not installed")
    if "portable_ssm.market" in code and not importlib.util.find_spec("databento_dbn"):
        pytest.skip("the block uses portable_ssm.market, whose DBN files need databento-dbn (the [market] extra)")
    result = run_python(code, tmp_path)
    assert result.returncode == 0, f"block failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"


def test_readme_has_python_blocks_to_run():
    assert len(blocks("python")) >= 7


def command_lines() -> list[str]:
    """Each command of the bash blocks, comments stripped, ``a && b`` split."""
    lines = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("#", 1)[0].strip()
            lines += [part.strip() for part in line.split("&&") if part.strip()]
    return lines


def help_command(line: str) -> list[str] | None:
    """The ``--help`` invocation of the program a README command runs (None for installs)."""
    words = shlex.split(line)
    if words[0] in ("pip", "pytest"):
        return None
    if words[0] in ("python", "torchrun"):
        script = next(w for w in words[1:] if w.endswith(".py"))
        return [sys.executable, str(ROOT / script), "--help"]
    if words[0] == "portable-ssm":
        subcommand = [] if words[1].startswith("-") else [words[1]]  # `portable-ssm --version` is the tool's own flag
        return [sys.executable, "-m", "portable_ssm", *subcommand, "--help"]
    raise AssertionError(f"README bash line of an unknown kind (add it to the test's policy): {line}")


@pytest.mark.parametrize("line", [line for line in command_lines() if not line.startswith(("pip ", "pytest"))])
def test_every_flag_a_readme_command_uses_is_in_its_help(line):
    command = help_command(line)
    program = Path(command[1])
    if program.suffix == ".py":
        assert program.is_file(), f"README runs {program.relative_to(ROOT)}, which is not in the repository"
        if "import torch" in program.read_text() or program.parent.name == "examples" and program.stem != "demo":
            for module in ("torch", "tqdm", "matplotlib"):
                pytest.importorskip(module)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", line):
        if flag != "--nproc_per_node":  # torchrun's own flag
            assert flag in result.stdout, f"{flag} (used in README: {line}) is not in {' '.join(command[1:])}"


def test_pip_install_lines_name_only_declared_extras():
    tomllib = pytest.importorskip("tomllib")
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    installs = [line for line in command_lines() if line.startswith("pip install")]
    assert installs
    for line in installs:
        for group in re.findall(r"\[([\w,-]+)\]", line):
            assert set(group.split(",")) <= declared, line


def test_the_demo_runs_as_the_two_commands_say(tmp_path):
    assert "python examples/demo.py" in command_lines()
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "numpy" in result.stdout and "-> y (" in result.stdout


def cited_paths() -> set[str]:
    prose = FENCE.sub("", README)
    links = re.findall(r"\]\(([^)#\s]+)\)", prose)
    top = {p.name for p in ROOT.iterdir()}
    inline = [c for c in re.findall(r"`([^`\s]+)`", prose)
              if c.endswith(".md") or "/" in c and c.split("/")[0] in top]
    return {p for p in links + inline if "://" not in p}


def test_every_file_the_readme_cites_exists():
    cited = cited_paths()
    assert {"docs/MAMBA2_SPEC.md", "benchmarks/RESULTS.md"} <= cited
    missing = sorted(p for p in cited if not (ROOT / p).exists())
    assert not missing, f"README cites files that are not in the repository: {missing}"
