"""Runs the benchmark suite: ``python benchmarks/run.py [--quick] [--only forward,train,decode,scaling]``.

The same as ``portable-ssm bench`` (:func:`portable_ssm.bench.main`, through the command line's
error handling); results go to ``./bench-out`` unless ``--out`` says otherwise. See ``--help``
and ``benchmarks/RESULTS.md``.
"""

import sys

from portable_ssm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
