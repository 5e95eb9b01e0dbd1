"""MkDocs hook: the API reference, generated from ``__all__`` at every build.

``docs/api.md`` holds one ``<!-- api: PACKAGE -->`` marker per public package; at build time each
becomes one mkdocstrings block per name of that package's ``__all__``, pointing at the module that
defines it, so a name added to ``__all__`` appears in the reference with no edit here.

mkdocstrings reads the sources statically (griffe), and the installed layout differs from the
repository's (``backends/`` and ``market/`` are installed as ``portable_ssm.backends`` and
``portable_ssm.market``: pyproject.toml's ``package-dir``), so ``on_config`` mirrors the installed
layout with a copy of the sources in a temporary folder of its own (so builds at the same time do
not share one; griffe follows symbolic links to the real folder, so links would not do) and points
the mkdocstrings handler's ``paths`` at it before mkdocstrings reads its configuration.
"""

from __future__ import annotations

import importlib
import inspect
import re
import shutil
import sys
import tempfile
from pathlib import Path

import tomllib
from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- api: ([\w.]+) -->$", re.M)
SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(?=<code>)")  # the docstrings' roles


def mirror_installed_layout(mirror: Path, root: Path = ROOT) -> Path:
    """Copy the repository's package folders into ``mirror`` as pyproject.toml installs them."""
    package_dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package in sorted(package_dirs, key=lambda name: name.count(".")):  # parents before children
        shutil.copytree(root / package_dirs[package], mirror.joinpath(*package.split(".")), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return mirror


def public_names(package: str) -> dict[str, str]:
    """Each name of ``package.__all__`` and the dotted path of the object in its defining module."""
    module = importlib.import_module(package)
    paths = {}
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            paths[name] = obj.__name__
            continue
        defined_in = getattr(obj, "__module__", None) if callable(obj) else None
        if defined_in is None:  # a constant: the submodule that assigns it
            defined_in = next(m for m, mod in sorted(sys.modules.items())
                              if m.startswith(package + ".") and getattr(mod, name, None) is obj)
        qualname = getattr(obj, "__qualname__", name) if callable(obj) else name
        paths[name] = f"{defined_in}.{qualname}"
    return paths


def api_markdown(package: str) -> str:
    """The mkdocstrings blocks of one package's reference, a section per public name."""
    blocks = [f"::: {path}\n    options:\n      heading: {name}\n      toc_label: {name}\n"
              for name, path in public_names(package).items()]
    return "\n".join(blocks)


_mirror: tempfile.TemporaryDirectory | None = None


@event_priority(100)  # before mkdocstrings' own on_config reads the handler's options
def on_config(config):
    global _mirror
    _mirror = tempfile.TemporaryDirectory(prefix="portable_ssm-api-src-")
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(mirror_installed_layout(Path(_mirror.name)))]
    return config


def on_shutdown():
    if _mirror is not None:
        _mirror.cleanup()


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: api_markdown(m[1]), markdown)


def on_page_content(html, page, config, files):
    """Drop the Sphinx roles of the docstrings (``:func:`name``` renders as ``:func:<code>name</code>``)."""
    return SPHINX_ROLE.sub("", html)
