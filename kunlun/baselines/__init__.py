"""Baselines beside Kunlun, each one file, selected by ``config.model.arch`` in
``kunlun.model.build_model``:

* ``interformer.py``: InterFormer (spec A.1), the baseline of the scaling comparison, with its
  DHEN interaction (``dhen.py``);
* ``dlrm.py``: DLRM-style pooling and an MLP;
* ``ablated.py``: the Kunlun trunk with its own changes switched off (``kunlun_ablated``).

The Kunlun model itself imports none of them. Importing this package loads no baseline; the
names ``DLRM`` and ``ablated_config`` of the old ``kunlun/baselines.py`` module still resolve, with
a warning, for one release.
"""

from __future__ import annotations

import importlib
import warnings

_MOVED = {"DLRM": "kunlun.baselines.dlrm", "ablated_config": "kunlun.baselines.ablated"}


def __getattr__(name):
  if name in _MOVED:
    warnings.warn(f"kunlun.baselines.{name} moved to {_MOVED[name]}.{name}; the old name goes in "
                  "the next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
  raise AttributeError(f"module 'kunlun.baselines' has no attribute {name!r}")
