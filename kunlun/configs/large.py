"""Large preset (spec d.7 "Large", production-like, multi-host): d_ns 256 / N_ns 96, 4 towers.

High-value towers d 512 / H 4 / d_h 128 with 12 layers and HSP 128->32; low-value towers
d 256 / H 2 / d_h 128 with 6 layers and HSP 32->8; n_kv 128, w 100, MoWE 4 x 2 with rank 32.
Sharded with the "5d" rule preset. Towers are named after the synthetic ``mid`` data preset's
streams (click, conversion, impression; kept lengths within its max lengths); a production
dataset with more streams (spec: 4-10 towers) adds one ``towers.<stream>`` entry per stream.
"""

from kunlun.configs.common import base_config
from kunlun.configs.types import default_model, tower

HIGH = dict(width=512, heads=4, n_kv=128, window=100, n_seed=128, n_sum=32, depth=12)
LOW = dict(width=256, heads=2, n_kv=128, window=100, n_seed=32, n_sum=8, depth=6)


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 256, 96, 4
  m.num_layers = 12
  m.hsp_rank = 8
  m.mowe.update(num_experts=4, layers_per_expert=2, rank=32, mlp_hidden=1024)
  m.towers.click = tower(kept_len=512, **HIGH)
  m.towers.conversion = tower(kept_len=128, **HIGH)
  m.towers.impression = tower(kept_len=2048, **LOW)
  m.tower_templates = "click,impression,conversion"   # sizes for streams 0, 1, 2 of other data
  m.oneseq = tower(width=512, heads=4, n_kv=128, window=100, kept_len=2688, n_seed=128, n_sum=32,
                   depth=12)
  m.heads.update(kind="mmoe", top_mlp=(1024, 512), tower_hidden=256, num_experts=4,
                 expert_hidden=512)
  m.dlrm.update(seq_dim=256, mlp=(2048, 1024))
  m.dtype = "bfloat16"
  m.backend = "auto"
  c.model = m
  c.data.preset = "mid"
  c.data.batch_size = 8192
  c.data.num_examples = 50_000
  c.train.steps = 1_000
  c.train.warmup_steps = 100
  c.sharding.rules = "5d"
  return c
