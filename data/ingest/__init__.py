"""Offline ingestion: your Parquet / CSV logs -> a kunlun dataset (``python -m data.ingest``).

``run`` (driver) scans, proposes a schema and converts with one runner: ``engine`` (DuckDB, the
default), ``beam`` (Apache Beam) or ``memory`` (the reference); ``public/``: recipes for public
logs. The training input (``data/``) never imports this package."""

from data.ingest.cli import main, run_cli
from data.ingest.driver import run
from data.ingest.sources import Progress, Source

__all__ = ["Progress", "Source", "main", "run", "run_cli"]
