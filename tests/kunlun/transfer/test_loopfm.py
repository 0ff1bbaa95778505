"""LoopFM wrapper: equals the plain VM when off; missing FM inputs are masked (never read)."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import vm_tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.transfer import loopfm

D_FM = 6


def _random_params(model, batch, seed):
  """Random params of the model's shapes (cheap: no compiled init; values are irrelevant here)."""
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), batch)["params"])
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: (0.3 * rng.normal(size=x.shape)).astype(x.dtype), shapes)


@pytest.fixture(scope="module")
def setup():
  schema = tiny_schema()
  config = vm_tiny.get_config()
  sl = seq_lens(config)
  b = random_batch(schema, 6, sl, seed=0, min_len=2)
  rng = np.random.default_rng(0)
  b["fm_ctx"] = rng.normal(size=(6, D_FM)).astype(np.float32)
  b["fm_ctx_present"] = np.array([1, 0, 1, 0, 1, 1], bool)
  b["fm_events"] = {s: rng.normal(size=(6, T, D_FM)).astype(np.float32) for s, T in sl.items()}
  b["fm_events_present"] = {s: rng.uniform(size=(6, T)) < 0.6 for s, T in sl.items()}
  m = loopfm.build_loopfm(config, schema, use_ctx=True, use_events=True)
  p = _random_params(m, b, 0)
  apply = jax.jit(lambda p, b: m.apply({"params": p}, b))
  return schema, config, b, apply, p


def test_off_equals_plain_vm(setup):
  schema, config, b, _, _ = setup
  vm = build_model(config, schema)
  off = loopfm.build_loopfm(config, schema, use_ctx=False, use_events=False)
  p_vm = nn.unbox(jax.eval_shape(vm.init, jax.random.key(1), b)["params"])
  p = _random_params(off, b, 1)
  assert jax.tree.map(lambda x: x.shape, p) == jax.tree.map(lambda x: x.shape, p_vm)
  np.testing.assert_allclose(jax.jit(off.apply)({"params": p}, b),
                             jax.jit(vm.apply)({"params": p}, b), atol=1e-6)


def _perturb_where(b, ctx_sel, ev_sel, value):
  b2 = dict(b)
  value = np.float32(value)
  b2["fm_ctx"] = np.where(ctx_sel[:, None], value, b["fm_ctx"])
  b2["fm_events"] = {s: np.where(ev_sel[s][..., None], value, e) for s, e in b["fm_events"].items()}
  assert b2["fm_ctx"].dtype == np.float32
  return b2


def test_missing_inputs_are_never_read(setup):
  _, _, b, m, p = setup
  base = m(p, b)
  assert np.isfinite(base).all()
  ev_missing = {s: ~pr | (np.arange(pr.shape[1])[None] >= b["events"][s]["length"][:, None])
                for s, pr in b["fm_events_present"].items()}
  for value in (np.nan, 1e6):
    b2 = _perturb_where(b, ~b["fm_ctx_present"], ev_missing, value)
    np.testing.assert_array_equal(m(p, b2), base)


def test_present_inputs_are_used_and_rows_independent(setup):
  _, _, b, m, p = setup
  base = np.asarray(m(p, b))
  # change the context embedding of row 0 only (present): only row 0 changes
  b2 = dict(b)
  b2["fm_ctx"] = b["fm_ctx"].copy()
  b2["fm_ctx"][0] = -b["fm_ctx"][0]
  out = np.asarray(m(p, b2))
  assert np.abs(out[0] - base[0]).max() > 1e-5
  np.testing.assert_allclose(out[1:], base[1:], atol=1e-6)
  # flipping a present event's embedding changes its row
  s = "click"
  pr = b["fm_events_present"][s] & (np.arange(8)[None] < b["events"][s]["length"][:, None])
  i, t = np.argwhere(pr)[0]
  b3 = dict(b)
  b3["fm_events"] = dict(b["fm_events"])
  b3["fm_events"][s] = b["fm_events"][s].copy()
  b3["fm_events"][s][i, t] *= -3
  out3 = np.asarray(m(p, b3))
  assert np.abs(out3[i] - base[i]).max() > 1e-6
  rest = np.arange(6) != i
  np.testing.assert_allclose(out3[rest], base[rest], atol=1e-6)


def test_missing_keys_error(setup):
  _, _, b, m, p = setup
  b2 = {k: v for k, v in b.items() if k != "fm_ctx"}
  with pytest.raises(ValueError, match="fm_ctx"):
    m(p, b2)


def test_fm_adapter_formula():
  a = loopfm.FMAdapter(3)
  e = np.array([[1.0, 2.0, 4.0, -1.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
  pres = np.array([True, False])
  v = nn.unbox(a.init(jax.random.key(0), e, pres))
  out = np.asarray(a.apply(v, e, pres))
  pp = v["params"]
  x = e[0] - e[0].mean()
  x = x / np.sqrt((x ** 2).mean() + 1e-6)
  want0 = x @ np.asarray(pp["proj"]["kernel"]) + np.asarray(pp["proj"]["bias"])
  np.testing.assert_allclose(out[0], want0, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out[1], pp["missing"], atol=0)
