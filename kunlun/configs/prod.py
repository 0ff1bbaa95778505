"""Production-shaped single-GPU preset (the shape of Meta's kernel benchmarks): d_ns 256 / N_ns 48.

High-value towers (``click``, ``conversion``): d 512 / H 4 / d_h 128 (spec d.7 ``large``), 4 layers,
n_kv 256, HSP 128->32; low-value tower (``impression``): d 256 / H 2 / d_h 128, 2 layers, n_kv 128.
Kept lengths 1024 / 256 / 1024 on the synthetic ``prod`` data (max 1024 / 256 / 2048, about half
filled). Batch 1024; ``train.remat=auto`` recomputes only what does not fit the device
(``kunlun.train.step.pick_remat``: on the H200 program packed towers need none, 31.5 GiB);
the analytic memory with full remat per layer: ``ESTIMATE_GIB``.
"""

from kunlun.configs.common import base_config
from kunlun.configs.types import default_model, tower

HIGH = dict(width=512, heads=4, n_kv=256, window=128, n_seed=128, n_sum=32, depth=4)
LOW = dict(width=256, heads=2, n_kv=128, window=128, n_seed=32, n_sum=8, depth=2)

# Analytic per-device memory at batch B = 1024 (GiB = 2^30 bytes), with remat "full" per layer:
#   214M dense params x 16 B (f32 value, AdamW m / v, gradient)                      ~ 3.2
#   384M table params (1.3M rows) x 4 B (sparse update: no table-sized gradient)     ~ 1.4
#   saved layer inputs, bf16: B x sum_towers(depth x T x d) x 2 B
#     = 1024 x (4 x 1024 x 512 + 4 x 256 x 512 + 2 x 1024 x 256) x 2 B              ~ 6.0
#   one recomputed layer (click, the largest): ~16 live [B, T, d] f32 tensors
#     (1024 x 1024 x 512 x 4 B = 2 GiB each) + GDPA scores [B, H, T, n_kv] f32 (4 GiB)
#     + window scores [B, H, T, w] f32 (2 GiB)                                        ~ 38
#   total ~ 49 GiB of the H200's 141 GB (bench/train_step.py's compiled peak is the check).
ESTIMATE_GIB = 49


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 256, 48, 4
  m.num_layers = 4
  m.hsp_rank = 8
  m.mowe.update(num_experts=2, layers_per_expert=2, rank=32, mlp_hidden=1024)
  m.towers.click = tower(kept_len=1024, **HIGH)
  m.towers.conversion = tower(kept_len=256, **HIGH)
  m.towers.impression = tower(kept_len=1024, **LOW)
  m.tower_templates = "click,impression,conversion"   # sizes for streams 0, 1, 2 of other data
  m.oneseq = tower(width=512, heads=4, n_kv=256, window=128, kept_len=2304, n_seed=128,
                   n_sum=32, depth=4)
  m.heads.update(kind="towers", top_mlp=(1024, 512), tower_hidden=256)
  m.dlrm.update(seq_dim=256, mlp=(2048, 1024))
  m.dtype = "bfloat16"
  m.backend = "auto"
  c.model = m
  c.data.preset = "prod"
  c.data.batch_size = 1024
  c.data.num_examples = 50_000
  c.train.steps = 1_000
  c.train.warmup_steps = 100
  c.train.remat = "auto"
  return c
