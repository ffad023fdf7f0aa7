"""``python -m fusedq_bench``: the ``fusedq-bench`` command."""

import sys

from fusedq_bench.cli import main

sys.exit(main())
