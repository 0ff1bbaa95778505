"""``python -m bench.report [--check]``: the results pages (``bench.report.main``)."""

import sys

from bench.report import main

sys.exit(main())
