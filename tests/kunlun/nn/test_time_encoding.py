"""Time encodings against explicit numpy formulas; ROTE logits depend only on time differences."""

import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.time_encoding import log_time_bucket, rotary_time
from pallas_kernels.reference import apply_rotary


def test_log_time_bucket():
  age = np.array([[0.0, 0.5, 1.0, 3.9, 4.0, 1000.0, 1e12]], np.float32)
  got = np.asarray(log_time_bucket(jnp.array(age), 12))
  want = np.clip(np.floor(np.log2(np.maximum(age, 1.0))), 0, 11).astype(np.int32)
  np.testing.assert_array_equal(got, want)
  assert got.dtype == np.int32 and got[0, -1] == 11 and got[0, 4] == 2
  with pytest.raises(ValueError, match="num_buckets"):
    log_time_bucket(jnp.array(age), 0)


def test_rotary_time_angles():
  rng = np.random.default_rng(0)
  B, T, H, D = 2, 5, 3, 8
  age = rng.exponential(5000.0, (B, T)).astype(np.float32)
  cos, sin = rotary_time(jnp.array(age), H, D, t_scale=60.0)
  assert cos.shape == (B, T, H, D // 2) and sin.shape == cos.shape
  omega = 10000.0 ** (-2.0 * np.arange(D // 2) / D)
  for h in range(H):
    x = np.log1p(age / 60.0) if h < 2 else np.broadcast_to(np.arange(T, dtype=np.float64), (B, T))
    ang = x[..., None] * omega
    np.testing.assert_allclose(np.asarray(cos[:, :, h]), np.cos(ang), atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin[:, :, h]), np.sin(ang), atol=1e-5)
  with pytest.raises(ValueError, match="even head_dim"):
    rotary_time(jnp.array(age), H, 7)


def _logits(q, k, age, H, D):
  rot = rotary_time(jnp.array(age), H, D)
  qr, kr = apply_rotary(jnp.array(q), rot), apply_rotary(jnp.array(k), rot)
  return np.asarray(jnp.einsum("bihd,bjhd->bhij", qr, kr))


def test_rote_logits_depend_on_time_differences_only():
  rng = np.random.default_rng(1)
  B, T, H, D = 1, 6, 2, 8                        # head 0 temporal, head 1 positional
  q, k = (rng.normal(size=(B, T, H, D)).astype(np.float32) for _ in range(2))
  age = np.sort(rng.exponential(3600.0, (B, T)))[:, ::-1].astype(np.float32)
  tau = np.log1p(age / 60.0)
  shifted = (60.0 * np.expm1(tau + 0.8)).astype(np.float32)     # tau + const for every event
  other = rng.exponential(3600.0, (B, T)).astype(np.float32)     # different time gaps
  l0, l1, l2 = _logits(q, k, age, H, D), _logits(q, k, shifted, H, D), _logits(q, k, other, H, D)
  np.testing.assert_allclose(l1, l0, rtol=1e-3, atol=1e-3)          # shift invariant
  assert np.abs(l2[:, 0] - l0[:, 0]).max() > 1e-2                    # temporal head sees time
  np.testing.assert_allclose(l2[:, 1], l0[:, 1], atol=1e-5)         # positional head does not


# ---- per-head bucket embeddings (spec b.5-2) ---------------------------------------------------
def _np_buckets(age, lengths, kinds, n, horizon, kept_len):
  """Explicit per-event loops."""
  B, T = age.shape
  out = np.zeros((B, T, len(kinds)), np.int64)
  for b in range(B):
    for t in range(T):
      a = float(age[b, t])
      for j, kind in enumerate(kinds):
        if kind == "age":
          v = min(int(a // (horizon / n)), n - 1)
        elif kind == "log_age":
          v = min(max(int(np.floor(np.log2(max(a, 1.0)))), 0), n - 1)
        elif kind == "gap":
          if t == 0:
            v = 0
          else:
            g = max(float(age[b, t - 1]) - a, 0.0)
            v = 1 + min(int(np.floor(np.log2(max(g, 1.0)))), n - 2)
        else:
          rank = max(int(lengths[b]) - 1 - t, 0)
          v = min(rank * n // kept_len, n - 1)
        out[b, t, j] = v
  return out


def _events(B=3, T=12, seed=0):
  rng = np.random.default_rng(seed)
  age = np.sort(rng.exponential(86400.0 * 3, (B, T)), axis=1)[:, ::-1].astype(np.float32)
  age[0, 3] = age[0, 2]                 # a zero gap
  age[1, -1] = 0.0                      # an event at the request time
  lengths = np.array([T, 5, 1], np.int32)[:B]
  return age, lengths


def test_bucket_ids_against_loops():
  from kunlun.configs.types import BucketSpec
  from kunlun.nn.time_encoding import bucket_ids
  age, lengths = _events()
  kinds = ("age", "log_age", "gap", "position")
  spec = BucketSpec(kinds, 8, 86400.0 * 10, kept_len=12)
  got = np.asarray(bucket_ids(jnp.array(age), jnp.array(lengths), spec))
  want = _np_buckets(age, lengths, kinds, 8, 86400.0 * 10, 12)
  np.testing.assert_array_equal(got, want)
  assert got.dtype == np.int32 and len(np.unique(got[..., 0])) > 2
  # position buckets use the kept length: extra padding leaves the valid prefix unchanged
  padded = np.pad(age, ((0, 0), (0, 5)))
  got_p = np.asarray(bucket_ids(jnp.array(padded), jnp.array(lengths), spec))
  np.testing.assert_array_equal(got_p[:, :12], got)
  with pytest.raises(ValueError, match="unknown time-bucket kind"):
    bucket_ids(jnp.array(age), jnp.array(lengths), BucketSpec(("when",), 8, 1.0, 12))


def test_add_bucket_embedding_module():
  import flax.linen as nn
  import jax

  from kunlun.configs.types import BucketSpec
  from kunlun.nn.time_encoding import add_bucket_embedding

  class M(nn.Module):
    spec: BucketSpec | None

    @nn.compact
    def __call__(self, x, age, lengths):
      return add_bucket_embedding(self, "tb", x, age, lengths, self.spec)

  age, lengths = _events()
  B, T, H, D = 3, 12, 2, 4
  x = np.random.default_rng(1).normal(size=(B, T, H, D)).astype(np.float32)
  spec = BucketSpec(("age", "gap", "position"), 6, 86400.0 * 5, kept_len=T)
  m = M(spec)
  v = m.init(jax.random.key(0), x, age, lengths)
  table = np.asarray(nn.meta.unbox(v)["params"]["tb"])
  assert table.shape == (3, 6, H, D) and not table.any()           # zero init: a no-op at start
  np.testing.assert_allclose(np.asarray(m.apply(v, x, age, lengths)), x)
  table = np.random.default_rng(2).normal(size=table.shape).astype(np.float32)
  got = np.asarray(m.apply({"params": {"tb": table}}, x, age, lengths))
  ids = _np_buckets(age, lengths, spec.kinds, 6, spec.age_horizon, T)
  want = x.copy()
  for b in range(B):
    for t in range(T):
      for k in range(3):
        want[b, t] += table[k, ids[b, t, k]]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert "params" not in M(None).init(jax.random.key(0), x, age, lengths)   # off: no parameter


def test_model_time_bucket_params_only_when_on():
  import flax.linen as nn
  import jax

  from data.fake import random_batch, tiny_schema
  from kunlun.configs import tiny
  from kunlun.configs.types import parse, seq_lens
  from kunlun.models.build import build_model

  schema = tiny_schema()

  def names(on, kinds="age,gap,position"):
    cfg = tiny.get_config()
    cfg.model.time_buckets.enabled = on
    cfg.model.time_buckets.kinds = kinds
    model = build_model(cfg, schema)
    shapes = jax.eval_shape(model.init, jax.random.key(0), random_batch(schema, 2, seq_lens(cfg)))
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(shapes["params"]))[0]
    return {"/".join(k.key for k in p): s.shape for p, s in flat}

  off, on = names(False), names(True, "age,log_age,gap,position")
  new = {k: v for k, v in on.items() if k not in off}
  assert set(on) - set(new) == set(off)                 # switch off: the old parameter tree
  assert new == {                                         # tiny: click 2 heads x 16, impr. 2 x 8
      "layer_0/click_hsp/time_bucket_k": (4, 32, 2, 16),
      "layer_0/click_pffn/time_bucket_q": (4, 32, 2, 16),
      "layer_0/impression_hsp/time_bucket_k": (4, 32, 2, 8),
      "layer_0/impression_pffn/time_bucket_q": (4, 32, 2, 8),
      "layer_0/impression_final_hsp/time_bucket_k": (4, 32, 2, 8),
      "layer_1/click_attention/time_bucket_q": (4, 32, 2, 16),
      "layer_1/click_final_hsp/time_bucket_k": (4, 32, 2, 16)}
  # config checks; a stored run config without the field parses with the switch off
  cfg = tiny.get_config()
  for field, bad, msg in (("kinds", "age,when", "kinds"), ("num_buckets", 1, "num_buckets"),
                          ("enabled", 1, "enabled"), ("age_horizon_days", 0.0, "horizon")):
    c = tiny.get_config()
    with c.model.time_buckets.ignore_type():
      c.model.time_buckets[field] = bad
    with pytest.raises(ValueError, match=msg):
      parse(c, schema)
  del cfg.model["time_buckets"]
  assert parse(cfg, schema).time_buckets.enabled is False
