"""config.transfer validation, and train.py/eval.py refusing FM inputs they would ignore."""

import ml_collections
import pytest

from data.fake import tiny_schema
from kunlun.configs import tiny, vm_tiny
from kunlun.configs.transfer import TransferConfig, parse_transfer
from kunlun.train import model, startup
from kunlun.transfer.loopfm import build_loopfm


def test_defaults_and_absent_section():
  assert parse_transfer(tiny.get_config()) == TransferConfig()
  t = parse_transfer(vm_tiny.get_config())
  assert t == TransferConfig(0.0, False, False, "user_item", None) and not t.uses_fm


@pytest.mark.parametrize("field,value,match", [
    ("kd_lambda", -0.1, "kd_lambda"), ("kd_lambda", True, "kd_lambda"),
    ("loopfm_ctx", 1, "loopfm_ctx"), ("join_key", "item", "join_key"),
    ("max_age", -5.0, "max_age"), ("kd_lamda", 0.5, "unknown fields")])
def test_bad_values_name_the_field(field, value, match):
  c = vm_tiny.get_config()
  c.transfer = ml_collections.ConfigDict({**c.transfer.to_dict(), field: value})
  with pytest.raises(ValueError, match=match):
    parse_transfer(c)


def test_max_age_and_loopfm_flags_reach_the_model():
  c = vm_tiny.get_config()
  c.transfer.max_age = 3600.0
  c.transfer.loopfm_events = True
  t = parse_transfer(c)
  assert t.max_age == 3600.0 and t.uses_fm
  m = build_loopfm(c, tiny_schema())
  assert m.use_events and not m.use_ctx


def test_train_py_refuses_fm_inputs_it_would_ignore():
  c = vm_tiny.get_config()
  c.transfer.kd_lambda = 0.5
  with pytest.raises(startup.FatalError, match="kd_lambda"):
    model.fit_and_build_model(c, tiny_schema())
  c = vm_tiny.get_config()
  c.transfer = ml_collections.ConfigDict({"join_key": "x"})
  with pytest.raises(startup.FatalError, match="join_key"):
    model.fit_and_build_model(c, tiny_schema())
  assert model.fit_and_build_model(vm_tiny.get_config(), tiny_schema()) is not None
