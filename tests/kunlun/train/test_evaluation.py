"""Epochs, validation period and keep-best (issue #14 friction 7): steps from epochs over the
surfaces trained on, validation once per epoch on the held-out split, best-NE bookkeeping, and
one-line errors for impossible settings."""

import math
import os

import numpy as np
import pytest

from data import records
from data.schema import Schema
from kunlun.configs import tiny
from kunlun.train import evaluation, startup
from kunlun.train.plan import Plan, schedule
from tests.kunlun.configs.test_fit import ml_dir  # noqa: F401  (module fixture: a valid split)


def _cfg(**train):
  c = tiny.get_config()
  c.data.batch_size = 8
  for k, v in train.items():
    c.train[k] = v
  return c


def _counts(d, split="train"):
  s = Schema.load(d)
  return {k: sum(c for _, c in v) for k, v in records.split_files(d, split, s).items()}


def test_epochs_to_steps_and_validation_period(ml_dir):  # noqa: F811
  schema = Schema.load(ml_dir)
  n = sum(_counts(ml_dir).values())
  c = _cfg(epochs=2.5)
  p = schedule(c, schema, ml_dir, None, say=lambda *a: None)
  spe = math.ceil(n / 8)
  assert p.steps_per_epoch == spe and p.total == math.ceil(2.5 * spe) == c.train.steps
  assert p.every == spe and p.split == "valid"                   # once per epoch by default
  assert c.data.surface_weights == "auto" and p.weights == {"movielens": float(n)}
  c = _cfg(validate_every=3)
  p = schedule(c, schema, ml_dir, 40, say=lambda *a: None)
  assert p.total == c.train.steps == 300 and p.every == 3        # steps unchanged without epochs
  assert schedule(_cfg(validate_every=-1), schema, ml_dir, None, say=print).every == 0


@pytest.mark.parametrize("train,steps_flag,msg", [
    (dict(epochs=1.0), 100, "--steps=100 and config.train.epochs=1 both set: give one"),
    (dict(keep_best=True, validate_every=-1), None,
     "config.train.keep_best needs validation, but config.train.validate_every=-1"),
    (dict(best_task="like"), None, "config.train.best_task='like': not a task of the data"),
])
def test_plan_errors(ml_dir, train, steps_flag, msg):  # noqa: F811
  with pytest.raises(startup.FatalError, match=msg.replace("(", r"\(").replace(")", r"\)")):
    schedule(_cfg(**train), Schema.load(ml_dir), ml_dir, steps_flag, say=print)


def test_no_valid_split(ml_dir, tmp_path):  # noqa: F811
  import json
  import shutil
  d = str(tmp_path / "d")
  shutil.copytree(ml_dir, d)
  m = json.load(open(os.path.join(d, "manifest.json")))
  del m["splits"]["valid"]
  json.dump(m, open(os.path.join(d, "manifest.json"), "w"))
  schema = Schema.load(d)
  assert schedule(_cfg(), schema, d, None, say=print).every == 0   # synthetic-like data
  with pytest.raises(startup.FatalError, match="keep_best needs validation, but the data has no "
                     "split 'valid'"):
    schedule(_cfg(keep_best=True), schema, d, None, say=print)
  with pytest.raises(startup.FatalError, match="validate_every=5: the data has no split 'valid'"):
    schedule(_cfg(validate_every=5), schema, d, None, say=print)


class _Scripted(evaluation.ValidSplitEvaluator):
  """The ValidSplitEvaluator's schedule and best tracking with scripted validation NEs (no model)."""

  def __init__(self, plan, nes, keep, workdir, best_task=""):
    self.plan, self.on, self.prog, self.main = plan, True, None, True
    self.say, self.last, self._mngr = (lambda *a, **k: None), None, None
    self.keep, self.best, self.best_task, self.dir = keep, None, best_task, workdir
    self.nes, self.saved, self.calls = list(nes), [], []

  def evaluate(self, params):
    ne = self.nes.pop(0)
    self.calls.append(ne)
    return ne, {t: 0.5 for t in ne}

  def _save_best(self, step, params, value, ne, auc):
    self.saved.append((step, value))
    self.best = {"step": step, "value": value}


def test_schedule_and_best(tmp_path):
  plan = Plan(total=10, steps_per_epoch=4, every=4, split="valid", weights={})
  nes = [{"click": 0.9, "like": 0.7}, {"click": 0.8, "like": 0.9}, {"click": 0.85, "like": 0.6}]
  v = _Scripted(plan, nes, keep=True, workdir=str(tmp_path))
  ran = [s for s in range(1, 11) if v(s, None)]
  assert ran == [4, 8, 10]                                  # every epoch and the last step
  assert not v(10, None)                                    # no second validation of a step
  means = [np.mean(list(n.values())) for n in nes]          # 0.8, 0.85, 0.725
  assert v.saved == [(4, means[0]), (10, means[2])]
  v = _Scripted(plan, nes, keep=True, workdir=str(tmp_path), best_task="click")
  [v(s, None) for s in range(1, 11)]
  assert v.saved == [(4, 0.9), (8, 0.8)]
