"""Dev preset: one GPU (spec d.7 "Dev"): d_ns 64 / N_ns 16, a high- and a low-value tower.

Streams of the synthetic ``dev`` data preset: ``click`` and ``conversion`` (high value) and
``impression`` (low value, longer, shallower).
"""

from kunlun.configs.common import base_config
from kunlun.configs.types import default_model, tower


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 64, 16, 2
  m.num_layers = 4
  m.hsp_rank = 2
  m.mowe.update(num_experts=2, layers_per_expert=1, rank=8, mlp_hidden=256)
  m.towers.click = tower(width=128, heads=4, n_kv=32, window=32, kept_len=256, n_seed=32, n_sum=8,
                         depth=4)
  m.towers.impression = tower(width=64, heads=2, n_kv=32, window=32, kept_len=512, n_seed=16,
                              n_sum=4, depth=2)
  m.towers.conversion = tower(width=128, heads=4, n_kv=32, window=32, kept_len=64, n_seed=32,
                              n_sum=8, depth=4)
  m.tower_templates = "click,impression,conversion"   # sizes for streams 0, 1, 2 of other data
  m.oneseq = tower(width=128, heads=4, n_kv=32, window=32, kept_len=832, n_seed=32, n_sum=8,
                   depth=4)
  m.heads.update(kind="towers", top_mlp=(256,), tower_hidden=64)
  m.dlrm.update(seq_dim=64, mlp=(512, 256))
  m.dtype = "bfloat16"
  m.backend = "auto"
  c.model = m
  c.data.preset = "dev"
  c.data.batch_size = 512
  c.data.num_examples = 100_000
  c.train.steps = 2_000
  c.train.warmup_steps = 100
  return c
