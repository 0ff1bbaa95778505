"""Smoke tests of the shared contracts (schema round trip, fake batches, GDPA reference)."""

import numpy as np

from data.fake import random_batch, tiny_schema
from data.schema import Schema
from pallas_kernels import gdpa


def test_schema_roundtrip(tmp_path):
  s = tiny_schema()
  s.save(str(tmp_path))
  assert Schema.load(str(tmp_path)) == s


def test_random_batch_layout():
  s = tiny_schema()
  b = random_batch(s, 4, {"click": 16, "impression": 32}, seed=1)
  assert b["events"]["click"]["item"].shape == (4, 16)
  assert b["labels"].shape == (4, 2)
  L = b["events"]["impression"]["length"]
  assert (b["events"]["impression"]["item"][np.arange(32)[None] >= L[:, None]] == 0).all()


def test_gdpa_reference_against_numpy_loop():
  rng = np.random.default_rng(0)
  B, Tq, Tk, H, D = 2, 5, 7, 2, 4
  q, k, v = (rng.normal(size=(B, T, H, D)).astype(np.float32) for T in (Tq, Tk, Tk))
  ql, kl = np.array([5, 3]), np.array([7, 2])
  o = np.asarray(gdpa(q, k, v, activation="relu", q_lengths=ql, kv_lengths=kl, window=2,
                      out_scale=0.5, backend="xla"))
  ref = np.zeros_like(o)
  for b in range(B):
    for h in range(H):
      for i in range(ql[b]):
        for j in range(kl[b]):
          if abs(i - j) <= 2:
            ref[b, i, h] += max(0.0, q[b, i, h] @ k[b, j, h] / 2.0) * v[b, j, h]
  np.testing.assert_allclose(o, 0.5 * ref, rtol=1e-5, atol=1e-5)
