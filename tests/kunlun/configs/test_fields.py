"""Every config default, check and ``--show_config`` row comes from the one table
``kunlun.configs.fields.FIELDS``: the preset defaults and dataclass defaults equal its defaults,
``describe`` shows its description and range, and the checks refuse a value just outside it."""

import dataclasses
import os
import subprocess
import sys

import pytest

from data.fake import tiny_schema
from kunlun.configs import fields, vm_tiny
from kunlun.configs import types as C
from kunlun.configs.common import base_config
from kunlun.configs.fields import FIELDS, REQUIRED
from kunlun.configs.transfer import TransferConfig, parse_transfer, transfer_config
from kunlun.models.ablated import SWITCHED_OFF, ablated_config, switched_off
from kunlun.train import settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# the dataclass of each model sub-section (its field defaults come from the table)
DATACLASSES = {"attention": C.AttentionConfig, "mowe": C.MoWEConfig,
               "time_buckets": C.TimeBucketConfig, "heads": C.HeadsConfig, "dlrm": C.DLRMConfig,
               "interformer": C.InterFormerConfig}


def _leaves(x, path=""):
  if hasattr(x, "keys") and not isinstance(x, str):
    return [lv for k in x.keys() for lv in _leaves(x[k], f"{path}.{k}" if path else k)]
  return [(path, x)]


def _get(c, path):
  for p in path.split("."):
    c = c[p]
  return c


def _set(c, path, value):
  head, _, name = path.rpartition(".")
  sec = _get(c, head) if head else c
  with sec.unlocked(), sec.ignore_type():
    sec[name] = value


def _concrete(path):
  return path.replace("*", "click")


def test_preset_defaults_are_the_table_defaults():
  c = base_config()
  c.model = C.default_model()
  c.transfer = transfer_config()
  leaves = dict(_leaves(c))
  want = {p: f.default for p, f in FIELDS.items() if "*" not in p and not f.optional}
  assert leaves.keys() == want.keys()              # no field outside the table, none missing
  for p, v in want.items():
    assert leaves[p] == v and type(leaves[p]) is type(v), p
  assert all(f.default == REQUIRED for p, f in FIELDS.items() if "*" in p)
  assert "synthetic_seed" not in c.data            # optional: absent from the presets


def test_dataclass_defaults_are_the_table_defaults():
  for section, cls in DATACLASSES.items():
    got = {f.name: f.default for f in dataclasses.fields(cls)}
    rows = {p.split(".")[-1]: f.default for p, f in FIELDS.items()
            if p.startswith(f"model.{section}.")}
    assert got.keys() == rows.keys(), section
    for name, d in rows.items():
      want = tuple(d.split(",")) if (section, name) == ("time_buckets", "kinds") else d
      assert got[name] == want, (section, name)
  assert C.MoWEConfig().cross_layer is C.default_model().mowe.cross_layer is True   # spec h-19
  assert parse_transfer({"transfer": transfer_config()}) == TransferConfig()
  assert parse_transfer({}) == TransferConfig()
  assert TransferConfig().max_age is None and FIELDS["transfer.max_age"].default == -1


def _full_config():
  return vm_tiny.get_config()          # every section, the transfer one too


def test_show_config_rows_are_the_table_rows():
  c = _full_config()
  lines = {x.split(" = ")[0].strip(): x for x in settings.describe(c)}
  for p, f in FIELDS.items():
    if f.optional:
      continue
    line = lines[_concrete(p)]
    assert line.endswith(f"{f.doc} [{f.allowed()}]"), (p, line)
    assert settings.doc(_concrete(p)) == f.doc


def _bounds(f):
  """(value, allowed?) pairs at and just outside the range of a row."""
  if f.kind not in ("int", "number"):
    return []
  eps = 1 if f.kind == "int" else 1e-6
  out = []
  if f.lo is not None:
    out += [(f.lo - eps, False)]
    out += [(f.lo, False), (f.lo + eps, True)] if f.open_lo else [(f.lo, True)]
  if f.hi is not None:
    out += [(f.hi + eps, False)]
    out += [(f.hi, False), (f.hi - eps, True)] if f.open_hi else [(f.hi, True)]
  return [(int(v) if f.kind == "int" else float(v), ok) for v, ok in out]


BAD_VALUE = {"bool": "yes", "str": 3, "choice": "no-such-choice", "activation": "no-such-act",
             "kinds": "age,no-such-kind", "ints": (4, 0), "numbers": (1.0, -1.0),
             "weights": {"feed": -1.0}}


@pytest.mark.parametrize("path", list(FIELDS))
def test_settings_checks_apply_the_table_range(path):
  f = FIELDS[path]
  cases = _bounds(f) + [(BAD_VALUE.get(f.kind, "not a number"), False)]
  for value, ok in cases:
    c = _full_config()
    _set(c, _concrete(path), value)
    if ok:
      settings.check(c)
    else:
      with pytest.raises(settings.SettingsError, match=f"config.{_concrete(path)} = "):
        settings.check(c)
      if path.startswith("model.") and not path.startswith("model.oneseq."):
        with pytest.raises(ValueError, match=_concrete(path)[len("model."):]):
          C.parse(c, tiny_schema())             # parse applies the same rows


def test_ablated_switches_off_exactly_its_list():
  c = vm_tiny.get_config()
  c.model.seq_mode = "oneseq"
  cfg = C.parse(c, tiny_schema())
  assert cfg.mowe.cross_layer and cfg.comp_skip      # on in the preset: switched off below
  a = ablated_config(cfg)
  for path, (value, _) in SWITCHED_OFF.items():
    if path == "towers.*.depth":
      assert all(t.depth == cfg.num_layers for t in a.towers)
    else:
      assert _get_attr(a, path) == value, path
  changed = {f.name for f in dataclasses.fields(cfg) if getattr(a, f.name) != getattr(cfg, f.name)}
  assert changed <= {"arch", "oneseq", *(p.split(".")[0] for p in SWITCHED_OFF)}, changed
  assert len(switched_off()) == len(SWITCHED_OFF) and "cross_layer" in switched_off()[-1]


def _get_attr(x, path):
  for p in path.split("."):
    x = getattr(x, p)
  return x


def test_table_and_settings_import_no_jax():
  code = ("import sys, kunlun.train.settings, kunlun.configs.common; "
          "assert 'jax' not in sys.modules and 'kunlun.transfer' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_ranges_read_well():
  assert FIELDS["train.b2"].allowed() == "a number in [0, 1)"
  assert FIELDS["model.time_buckets.age_horizon_days"].allowed() == "a number > 0"
  assert fields.row("model.towers.organic.window") is FIELDS["model.towers.*.window"]
