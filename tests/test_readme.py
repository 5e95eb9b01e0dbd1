"""README.md's claims run as written.

Policy for the fenced blocks (the helpers are shared with tests/test_docs.py, which holds the
pages under docs/ to the same policy):

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
- README is a landing page: at most 250 lines (the depth is in docs/).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from markdown_checks import (
    FENCE,
    ROOT,
    block_id,
    blocks,
    check_declared_extras,
    check_flags_in_help,
    command_lines,
    missing_library,
    run_python,
)

README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("code", blocks(README, "python"), ids=block_id)
def test_every_python_block_runs_alone_in_an_empty_directory(code, tmp_path):
    if reason := missing_library(code):
        pytest.skip(reason)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, f"block failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"


def test_readme_has_a_python_example_to_run():
    assert len(blocks(README, "python")) >= 1


def test_readme_is_a_landing_page_of_at_most_250_lines():
    assert len(README.splitlines()) <= 250


@pytest.mark.parametrize("line", [line for line in command_lines(README) if not line.startswith(("pip ", "pytest"))])
def test_every_flag_a_readme_command_uses_is_in_its_help(line):
    check_flags_in_help(line, "README")


def test_pip_install_lines_name_only_declared_extras():
    installs = [line for line in command_lines(README) if line.startswith("pip install")]
    assert installs
    check_declared_extras(installs)


def test_the_demo_runs_as_the_two_commands_say(tmp_path):
    assert "python examples/demo.py" in command_lines(README)
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
