"""Shared memory of the packed (jagged) Pallas kernels: the rule that fits their tiles to the GPU
(``tuning.fit_smem``), the tiles it picks at mid and prod shapes, and every kernel (forward and
backward) compiled deviceless for the H200 at prod's shapes by the venv ``scripts/setup.sh
--gpu-compile`` makes (``python -m tests.pallas_kernels.test_jagged_smem DUMP_DIR`` runs there).
Before the rule, the GDPA cross forward and dq kernels asked for 278,532 and 294,916 bytes of the
H200's 232,448 per block (an example's 256 keys and values, two pipeline buffers)."""

import glob
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bench.profiling import gpu_target
from pallas_kernels import (
    event_mlp,
    jagged,
    jagged_pallas,
    norm_qkv,
    norm_residual,
    proj_residual,
    seed_kron,
    tuning,
)
from tests.bench.profiling.test_gpu_target import GPU_PY, ROOT

# (heads, head dim, n_kv, seeds, window): kunlun/configs/prod.py's high-value towers (the
# low-value one is no larger in any), mid's towers (kunlun/configs/mid.py: 64 or 32 seeds)
SHAPES = {"prod": (4, 128, 256, 128, 128), "mid": (4, 64, 64, 64, 64),
          "mid_s32": (4, 64, 64, 32, 64)}
B, N = 4, 1024
FAMILIES = ("cross", "cross_through", "cross_ln", "cross_ln_split", "cross_per_head", "pool",
            "pool_per_head", "pool_proj", "pool_proj_through", "block_softmax", "block_gdpa", "softmax_band", "softmax_full",
            "norm_qkv", "norm_proj", "norm_residual", "norm_residual_ln", "proj_residual",
            "event_mlp", "seed_kron")
# the row-wise fused kernels (no jagged_pallas._plan): {family: kernels (forward, backward;
# norm_qkv, norm_proj, proj_residual: and pallas_kernels.wgrad's weight gradient; norm_qkv: and
# the sum of its scales' partials, pallas_kernels.partials; event_mlp: two)}
FUSED = {"norm_qkv": 4, "norm_proj": 3, "norm_residual": 2, "norm_residual_ln": 2,
         "proj_residual": 2, "event_mlp": 4, "seed_kron": 2}
PER_HEAD = ("gelu", "silu", "relu2", "fast_gelu")   # XLA's Triton: one loop copy each
# families that also run row-wise kernels (no _plan): {family: (kernels, row-wise kernels)}
WITH_ROWWISE = {f: (4, ("norm_proj_bwd", "row_scaled_wgrad"))
                for f in ("pool_proj", "pool_proj_through")}


def _summed(outs):
  return sum(o.astype(jnp.float32) for o in outs)


def _pooled_and_passed(outs):
  """A scalar of the pool's output and its two pass-throughs of x (every cotangent nonzero)."""
  o, *xs = (jnp.sum(a.astype(jnp.float32)) for a in outs)
  return o + jnp.sum(jnp.stack(xs) ** 2)


def _families(shape, dtype=jnp.bfloat16):
  """``{family: (value and gradients of one packed op, argument shapes)}`` at ``shape``."""
  H, D, NKV, S, W = SHAPES[shape]
  tok = jax.ShapeDtypeStruct((N, H, D), dtype)
  ex = jax.ShapeDtypeStruct((B, NKV, H, D), dtype)
  seeds = jax.ShapeDtypeStruct((S, H, D), dtype)
  tok_x = jax.ShapeDtypeStruct((N, H * D), dtype)
  w3, w2 = (jax.ShapeDtypeStruct((H * D, p, H, D), jnp.float32) for p in (3, 2))
  age = jax.ShapeDtypeStruct((N,), jnp.float32)
  w_out = jax.ShapeDtypeStruct((H, D, H * D), jnp.float32)
  # an event stream's MLP at the tower width d = H * D: K 2 d (d plus four side fields of d / 4;
  # prod's streams without extra fields have 1.75 d), hidden and output d (prod: K 1024, hidden
  # 512, the widths the kernels take at most), as the model passes it: the item table's d
  # columns and the side tables' as a pair, whose cotangents the backward kernel writes apart
  mlp_x = tuple(jax.ShapeDtypeStruct((N, H * D), dtype) for _ in range(2))
  mlp_w1, mlp_w2 = (jax.ShapeDtypeStruct(s, jnp.float32)
                    for s in ((2 * H * D, H * D), (H * D, H * D)))
  jp = jagged_pallas
  ops = {
      "cross": (lambda q, k, v, j: jp.jagged_gdpa_cross_pallas(
          q, k, v, j, kv_lengths=jnp.full((B,), NKV - 3)), (tok, ex, ex)),
      # PFFN's: q passed through to the fused tail, its cotangent read by the backward kernel
      "cross_through": (lambda q, k, v, j: _summed(jp.jagged_gdpa_cross_pallas(
          q, k, v, j, kv_lengths=jnp.full((B,), NKV - 3), through=True)), (tok, ex, ex)),
      # PFFN's where the query is the LayerNorm of x, computed in the kernels (q_norm)
      "cross_ln": (lambda x, k, v, j: jp.jagged_gdpa_cross_pallas(
          x, k, v, j, kv_lengths=jnp.full((B,), NKV - 3), q_norm=1e-6), (tok, ex, ex)),
      # and its statistics held (x from HSP's pool, pool_proj_through): the kernels write r du
      "cross_ln_split": (lambda x, k, v, j: jp.jagged_gdpa_cross_pallas(
          x, k, v, j, kv_lengths=jnp.full((B,), NKV - 3), q_norm=1e-6, ln_split=True),
          (tok, ex, ex)),
      "cross_per_head": (lambda q, k, v, j: jp.jagged_gdpa_cross_pallas(
          q, k, v, j, activation=PER_HEAD[:H], score_clip=8.0), (tok, ex, ex)),
      "pool": (lambda q, k, v, j: jp.jagged_gdpa_pool_pallas(q, k, v, j), (seeds, tok, tok)),
      "pool_per_head": (lambda q, k, v, j: jp.jagged_gdpa_pool_pallas(
          q, k, v, j, activation=PER_HEAD[:H]), (seeds, tok, tok)),
      # HSP's pool projecting its keys and values from the tokens (two weight operands)
      "pool_proj": (lambda q, x, w, j: jp.jagged_gdpa_pool_proj_pallas(
          q, x, (w[:, 0].astype(dtype), w[:, 1].astype(dtype)), j), (seeds, tok_x, w2)),
      # and passing x through to the PFFN: its backward kernel adds the two cotangents
      "pool_proj_through": (lambda q, x, w, j: _pooled_and_passed(jp.jagged_gdpa_pool_proj_pallas(
          q, x, (w[:, 0].astype(dtype), w[:, 1].astype(dtype)), j, through=1e-6)),
          (seeds, tok_x, w2)),
      "block_softmax": (lambda q, k, v, j: jp.jagged_block_attention_pallas(q, k, v, j),
                        (tok, tok, tok)),
      "block_gdpa": (lambda q, k, v, j: jp.jagged_block_attention_pallas(
          q, k, v, j, activation="silu", score_clip=4.0), (tok, tok, tok)),
      "softmax_band": (lambda q, k, v, j: jp.jagged_softmax_attention_pallas(q, k, v, j, window=W),
                       (tok, tok, tok)),
      "softmax_full": (lambda q, k, v, j: jp.jagged_softmax_attention_pallas(q, k, v, j),
                       (tok, tok, tok)),
      # the fused norm -> projections (pallas_kernels.norm_qkv; the ages are data, no gradient;
      # one QK-norm scale for both, whose partials pallas_kernels.partials sums)
      "norm_qkv": (lambda x, w, sc, j: _summed(norm_qkv.norm_qkv_pallas(
          x, w, sc, sc, jnp.arange(N, dtype=jnp.float32), j.pos, jnp.ones(D // 2))),
          (tok_x, w3, jax.ShapeDtypeStruct((D,), jnp.float32))),
      "norm_proj": (lambda x, w, age, j: _summed(norm_qkv.norm_proj_pallas(
          x, (w[:, 0], w[:, 1]))), (tok_x, w2, age)),        # two operands, as HSP passes them
      # the PFFN's tail and the attention's output side (row-wise; valid: j.valid)
      "norm_residual": (lambda g, u, s, j: norm_residual.norm_residual_pallas(
          g, u, s, j.valid.astype(jnp.float32), eps=1e-6), (tok_x, tok_x, tok_x)),
      "norm_residual_ln": (lambda g, s, _, j: norm_residual.norm_residual_pallas(
          g, None, s, j.valid.astype(jnp.float32), eps=1e-6, u_norm=1e-6), (tok_x, tok_x, age)),
      "proj_residual": (lambda x, o, w, j: proj_residual.proj_residual_pallas(
          x, o, w, j.valid.astype(jnp.float32)), (tok_x, tok, w_out)),
      "event_mlp": (lambda x, w1, w2, j: event_mlp.event_mlp_pallas(
          x, w1, jnp.zeros(H * D), w2, jnp.zeros(H * D), j.valid.astype(jnp.float32)),
          (mlp_x, mlp_w1, mlp_w2)),
      # HSP's seed side at the tower's seeds and width d = H * D: rank 4, 16 summaries (mid: the
      # whole accumulator at once) or rank 8, 32 summaries (prod: in column chunks, wide)
      "seed_kron": (lambda a, e, z, j: seed_kron.seed_kron_pallas(a, e, z, eps=1e-6),
                    (jax.ShapeDtypeStruct((B, S, H * D), dtype),
                     jax.ShapeDtypeStruct((S, H * D), jnp.float32),
                     jax.ShapeDtypeStruct((8, S, 32) if shape == "prod" else (4, S, 16),
                                          jnp.float32))),
  }
  lens = jax.ShapeDtypeStruct((B,), jnp.int32)
  loss = lambda fn: jax.value_and_grad(lambda lens, *o: jnp.sum(
      fn(*o, jagged.from_lengths(lens, N)).astype(jnp.float32)), argnums=(1, 2, 3))
  return {name: (loss(fn), (lens, *o)) for name, (fn, o) in ops.items()}


def _plans(shape, monkeypatch):
  """``{(family, kernel): (whole, chunk, stages, estimated bytes)}`` at ``shape``."""
  seen, plan = {}, jagged_pallas._plan
  for family, (fn, args) in _families(shape).items():
    def record(name, cfg, need, whole=None, floor=64, family=family):
      chunk, stages = plan(name, cfg, need, whole, floor)
      est = tuning.smem_estimate(*need(chunk), stages, len(set(cfg.acts or ("",))))
      seen[family, name] = (whole, chunk, stages, est)
      return chunk, stages
    monkeypatch.setattr(jagged_pallas, "_plan", record)
    jax.make_jaxpr(fn)(*args)
  return seen


def test_the_limit_is_the_h200_target_files():
  with open(gpu_target.TARGETS["h200"]) as f:
    optin = int(re.search(r"shared_memory_per_block_optin: (\d+)", f.read()).group(1))
  assert tuning.SMEM_PER_BLOCK[tuning.TARGET_CC] == optin == tuning.smem_limit()  # CPU: target


def test_fit_smem_keeps_the_most_stages_then_the_largest_chunk():
  kv = lambda c: (16 << 10, 2 * c * 256)          # a 64 x 128 bf16 tile, c keys and values
  assert tuning.fit_smem(kv, 64) == (64, 3)        # fits: unchanged
  assert tuning.fit_smem(kv, 256) == (128, 3)      # 400 KiB at 3 stages -> 208 KiB
  assert tuning.fit_smem(kv, 256, floor=256) == (256, 1)
  assert tuning.fit_smem(kv, 256, copies=4) == (256, 1)   # 4 loop copies: no 2 stages fit
  assert tuning.fit_smem(kv, 1024, floor=1024) == (256, 1)   # below the floor at 1 stage
  assert tuning.smem_estimate(10, 5, 3, copies=4) == 70
  assert tuning.smem_estimate(10, 5, 1, copies=4) == 15   # one stage: nothing pipelined
  assert tuning.fit_smem(lambda _: (100_000, 50_000), None) == (None, 2)
  with pytest.raises(ValueError) as e:
    tuning.fit_smem(lambda _: (300_000, 0), None, what="k")
  assert str(e.value).startswith("k: needs 300000 bytes") and "\n" not in str(e.value)


KERNELS = {f"jagged_{k}" for k in (
    "gdpa_cross", "gdpa_cross_bwd", "gdpa_pool", "gdpa_pool_bwd",
    "block_attention", "block_attention_bwd", "softmax_attention", "softmax_attention_bwd")}


@pytest.mark.parametrize("shape", ["mid", "mid_s32"])
def test_mid_keeps_its_tiles(shape, monkeypatch):
  """Every kernel loads its whole dimension at once with jax's default 3 stages (the tiles mid's
  figures were measured with), per-head activations too."""
  plans = _plans(shape, monkeypatch)
  assert {k for _, k in plans} == KERNELS
  for key, (whole, chunk, stages, _) in plans.items():
    assert (chunk, stages) == (whole, tuning.JAGGED_STAGES), key


def test_prod_tiles(monkeypatch):
  """bf16, d_h 128: the cross forward reads an example's 256 keys in chunks of 128 (whole: 400
  KiB at 3 stages), its backward (one kernel) keeps them whole at 2 stages, the rest as at mid; with 4 per-head activations (4 loop copies,
  each with its own pipeline buffers) the GDPA kernels run unpipelined (1 stage); the pool
  projecting its keys and values (a 128-column chunk of x and two [128, 128] weight blocks per
  step) keeps its seeds whole at 2 stages forward (its backward is the pool's)."""
  plans = _plans("prod", monkeypatch)
  for (family, name), (whole, chunk, stages, est) in plans.items():
    if family.endswith("per_head") and name.startswith("jagged_gdpa"):
      want = (whole, 1)
    elif family.startswith("pool_proj") and name == "jagged_gdpa_pool":
      want = (whole, 2)
    else:
      want = {"jagged_gdpa_cross": (128, 3), "jagged_gdpa_cross_bwd": (whole, 2)}.get(
          name, (whole, 3))
    assert (chunk, stages) == want, (family, name)
    assert est <= tuning.SMEM_PER_BLOCK[90], (family, name)


@pytest.fixture(scope="module")
def prod_compiled(tmp_path_factory):
  """``{family: {"smem": {kernel: bytes}} or {"error": first line}}`` of the deviceless H200
  compiles at prod's shapes (``main``)."""
  if not os.path.exists(GPU_PY):
    pytest.skip(f"no {GPU_PY}: {gpu_target.INSTALL} makes it")
  dump = tmp_path_factory.mktemp("dump")
  p = subprocess.run([GPU_PY, "-m", "tests.pallas_kernels.test_jagged_smem", str(dump)],
                     cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                     text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


# the PFFN passes its query through GDPA only where cross_through_fits, which prod's d_h 128 is
# not (tests/pallas_kernels/test_jagged.py): there the pass-through's kernels are the cross's
AT_PROD = tuple(f for f in FAMILIES if f != "cross_through")


@pytest.mark.parametrize("family", AT_PROD)
def test_packed_kernels_compile_for_h200_at_prod_shapes(prod_compiled, family):
  r = prod_compiled[family]
  assert "error" not in r, r.get("error")
  n = FUSED.get(family, WITH_ROWWISE.get(family, (2,))[0])
  assert len(r["smem"]) == n, r                       # fwd and bwd kernels
  assert max(r["smem"].values()) <= tuning.SMEM_PER_BLOCK[90], r


def test_estimates_bound_the_compiled_shared_memory(prod_compiled, monkeypatch):
  plans = _plans("prod", monkeypatch)
  for family, r in prod_compiled.items():
    if family in FUSED:
      continue
    for kernel, smem in r.get("smem", {}).items():
      if kernel in WITH_ROWWISE.get(family, (0, ()))[1]:
        continue
      assert smem <= plans[family, kernel][-1], (family, kernel, smem, plans[family, kernel])


def main(dump_dir):
  """Compiles every family at prod's shapes for the H200 (deviceless); prints the JSON of
  ``prod_compiled``: each kernel's shared memory from the dumped thunk sequence."""
  gpu_target.set_flags(dump_dir, "h200")
  mesh = gpu_target.gpu_mesh("h200")
  out, seen = {}, set()
  for family, (fn, args) in _families("prod").items():
    if family not in AT_PROD:
      continue
    try:
      gpu_target.compile_for(fn, args, mesh)
    except Exception as e:  # noqa: BLE001 - reported to the test
      out[family] = {"error": str(e).splitlines()[0][:300]}
      continue
    new = set(glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))) - seen
    seen |= new
    out[family] = {"smem": {k: v["smem"] for p in sorted(new)
                            for k, v in gpu_target.thunk_launches(p).items()
                            if k.startswith(("jagged", "norm_", "proj_", "event_", "seed_",
                                             "row_scaled"))}}
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1])
