"""``python -m portable_ssm``: the ``portable-ssm`` command line (see :mod:`portable_ssm.cli`)."""

import sys

from .cli import main

sys.exit(main())
