"""The model a program trains, evaluates or exports: ``config.model`` fitted to the data's schema
(its towers to the schema's streams, in place) and built; a config that does not fit, or one
that turns on the transfer path's FM inputs, is a one-line FatalError."""

from __future__ import annotations

import jax

from kunlun.configs.fit import fit_towers
from kunlun.configs.transfer import parse_transfer
from kunlun.models.build import build_model
from kunlun.train.startup import fail


def fit_and_build_model(config, schema, remat: str | None = None):
  """Fits ``config.model.towers`` to the schema's streams (kunlun/configs/fit.py, in place) and
  builds the model (``remat``: ``build_model``'s); a config / schema mismatch is a FatalError."""
  try:
    tr = parse_transfer(config)
  except ValueError as e:
    fail(str(e))
  if tr.uses_fm:
    fail(f"config.transfer turns on FM inputs ({tr}); train.py/eval.py train and evaluate the "
         "plain model only and would silently ignore them. Set kd_lambda=0 and loopfm_*=False, "
         "or run the transfer path (kunlun.transfer.experiment, bench/experiments/transfer.py).")
  try:
    for note in fit_towers(config, schema):     # towers follow the schema's streams (in place)
      if jax.process_index() == 0:
        print(f"config: {note}", flush=True)
    return build_model(config, schema, remat)
  except ValueError as e:
    fail(f"config does not fit the data schema: {e}")
