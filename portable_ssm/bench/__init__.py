"""Benchmark tooling (not core): ``portable-ssm bench`` and ``python benchmarks/run.py``.

:mod:`.runner` chooses the shapes and times them side by side (:func:`main`), :mod:`.calls` builds
the timed calls per backend, :mod:`.report` holds the FLOP count and writes ``RESULTS.md`` and
``scaling.png``. Frameworks are imported inside functions only.
"""

from .runner import main

__all__ = ["main"]
