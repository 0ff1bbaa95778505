"""Moved to ``kunlun.serving.export`` (``python -m kunlun.serving.export``); this alias goes in the
next release."""
import sys

from kunlun._moved import alias

if __name__ == "__main__":
  from kunlun.serving import export
  print("note: kunlun.export_serving moved to kunlun.serving.export", file=sys.stderr)
  sys.exit(export.main())
alias(__name__, "kunlun.serving.export")
