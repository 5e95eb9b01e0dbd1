"""The documentation site (docs/, mkdocs.yml) holds what README.md's test holds, and its API
reference covers the public API.

- Every ```python block of every page under docs/ runs alone in an empty directory, and every
  ```bash line's flags are in its program's ``--help`` (the policy of tests/test_readme.py, whose
  helpers this shares).
- ``mkdocs build --strict`` builds the site (broken links and docstring warnings fail it), and its
  API page has a section for every name in ``portable_ssm.__all__`` and
  ``portable_ssm.market.__all__`` holding that name's docstring.
"""

from __future__ import annotations

import html
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest
from markdown_checks import (
    ROOT,
    block_id,
    blocks,
    check_declared_extras,
    check_flags_in_help,
    command_lines,
    missing_library,
    run_python,
)

PAGES = {path.relative_to(ROOT / "docs").as_posix(): path.read_text() for path in sorted((ROOT / "docs").rglob("*.md"))}
PYTHON_BLOCKS = [(page, code) for page, text in PAGES.items() for code in blocks(text, "python")]
COMMANDS = [(page, line) for page, text in PAGES.items() for line in command_lines(text)]


def load_api_hook():
    """docs/hooks/api.py, the MkDocs hook that writes the API reference from ``__all__``."""
    spec = importlib.util.spec_from_file_location("docs_api_hook", ROOT / "docs" / "hooks" / "api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page, code", PYTHON_BLOCKS, ids=[f"{page}:{block_id(code)}" for page, code in PYTHON_BLOCKS])
def test_every_python_block_in_the_docs_runs_alone_in_an_empty_directory(page, code, tmp_path):
    if reason := missing_library(code):
        pytest.skip(reason)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, f"{page}: block failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"


def test_the_guides_have_python_blocks_to_run():
    guides = {page for page, _ in PYTHON_BLOCKS if page.startswith("guides/")}
    assert len(guides) >= 6 and len(PYTHON_BLOCKS) >= 15


@pytest.mark.parametrize("page, line", [(p, x) for p, x in COMMANDS if not x.startswith(("pip ", "pytest"))],
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else None)
def test_every_flag_a_docs_command_uses_is_in_its_help(page, line):
    check_flags_in_help(line, f"docs/{page}")


def test_docs_pip_install_lines_name_only_declared_extras():
    check_declared_extras([line for _, line in COMMANDS if line.startswith("pip install")])


def section_after(page_html: str, anchor: str) -> str:
    """The text of the API page from the heading ``anchor`` to the next object's heading."""
    start = page_html.index(f'id="{anchor}"')
    end = page_html.find('class="doc doc-heading"', page_html.index("</h", start))
    text = re.sub(r"<[^>]+>", "", page_html[start:end if end > 0 else None])
    return "".join(html.unescape(text).split())  # no whitespace: markup may split or join words


def plain(markdown: str) -> str:
    """A docstring line as ``section_after`` shows it: Sphinx roles, backticks and whitespace removed."""
    return "".join(re.sub(r":\w+:(?=`)", "", markdown).replace("`", "").split())


@pytest.fixture
def api_page(tmp_path) -> str:
    """The API page of a site built with ``mkdocs build --strict`` (the [docs] extra, in [test])."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the [docs] extra builds the site")
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return (site / "api" / "index.html").read_text()


def test_the_api_reference_has_every_public_name_with_its_docstring(api_page):
    hook = load_api_hook()
    for package in ("portable_ssm", "portable_ssm.market"):  # one build for both: the site takes seconds
        module = importlib.import_module(package)
        paths = hook.public_names(package)
        assert list(paths) == list(module.__all__)
        for name, path in paths.items():
            assert f'id="{path}"' in api_page, f"{package}.{name}: no section {path} on the API page"
            obj = getattr(module, name)
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else attribute_docstring(path)
            assert doc, f"{package}.{name} has no docstring"
            first = plain(doc.split("\n\n")[0].splitlines()[0])
            assert first in section_after(api_page, path), f"{package}.{name}: its docstring is not on the API page"


def attribute_docstring(path: str) -> str | None:
    """The docstring of a module constant (the string right after its assignment), read from source."""
    import ast

    module_name, name = path.rsplit(".", 1)
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    for node, after in zip(tree.body, tree.body[1:]):
        targets = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        if name in targets and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            return after.value.value
    return None
