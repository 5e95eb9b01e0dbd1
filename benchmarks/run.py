"""Runs the benchmark suite: ``python benchmarks/run.py [--quick] [--only forward,train,decode,scaling]``.

A thin script around :func:`portable_ssm.bench.main` (also ``portable-ssm bench``); see
``--help`` and ``benchmarks/RESULTS.md``.
"""

import sys

from portable_ssm.bench import main

if __name__ == "__main__":
    sys.exit(main())
