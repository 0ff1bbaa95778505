"""Tiny preset: CPU, well under a second per step at batch 64; used by tests and the demo.

Tower names match the synthetic ``tiny`` data preset (streams click & impression, surfaces
feed/stories/reels, tasks click/conversion); on any other dataset the towers serve as size
templates and heads / surface weights follow its schema (kunlun/configs/fit.py).
"""

from kunlun.configs.common import base_config
from kunlun.configs.types import default_model, tower


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 16, 4, 1
  m.num_layers = 2
  m.final_hsp = True     # shallow towers: the spec dataflow (off) would run HSP only
  m.num_time_buckets = 16
  m.attention.block_size = 16
  m.hsp_rank = 2
  m.mowe.update(num_experts=2, layers_per_expert=1, rank=4, mlp_hidden=32)
  m.towers.click = tower(width=32, heads=2, n_kv=8, window=8, kept_len=32, n_seed=8, n_sum=2,
                         depth=2)
  m.towers.impression = tower(width=16, heads=2, n_kv=8, window=8, kept_len=32, n_seed=4,
                              n_sum=1, depth=1)
  m.tower_templates = "click,impression"   # size templates for streams 0, 1, ... of other data
  m.oneseq = tower(width=32, heads=2, n_kv=8, window=8, kept_len=48, n_seed=8, n_sum=2, depth=2)
  m.heads.update(kind="towers", top_mlp=(32,), tower_hidden=16, num_experts=2, expert_hidden=16)
  m.dlrm.update(seq_dim=16, mlp=(64, 32))
  c.model = m
  c.data.preset = "tiny"
  c.data.batch_size = 64
  return c
