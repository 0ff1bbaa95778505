"""``python -m data.ingest``: the ingestion command line (``cli.main``)."""

import sys

from data.ingest.cli import main

sys.exit(main())
