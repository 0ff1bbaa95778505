"""Old module paths of the ``kunlun/`` layout before ``baselines/`` and ``serving/`` (kept for one
release): each old module is a two-line file that calls ``alias``."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
  """Makes module ``old`` the module ``new`` (imports of either give the same object), with a
  DeprecationWarning that says where it moved."""
  warnings.warn(f"{old} moved to {new}; the old module path goes in the next release",
                DeprecationWarning, stacklevel=3)
  sys.modules[old] = importlib.import_module(new)
