"""Time encodings against explicit numpy formulas; ROTE logits depend only on time differences."""

import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.time_encoding import log_time_bucket, rotary_time
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
