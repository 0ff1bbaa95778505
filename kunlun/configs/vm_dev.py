"""Vertical-model (VM) dev preset: a latency-bounded student of the ``dev`` FM (spec g.1).

Roughly 1/4 of ``dev``'s width, 2 layers, 64-event histories; ``config.transfer`` as in vm_tiny.
"""

from kunlun.configs.common import base_config
from kunlun.configs.transfer import transfer_config
from kunlun.configs.types import default_model, tower


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 32, 8, 1
  m.num_layers = 2
  m.final_hsp = True     # shallow towers: the spec dataflow (off) would run HSP only
  m.hsp_rank = 2
  m.mowe.update(num_experts=1, layers_per_expert=1, rank=4, mlp_hidden=64)
  m.towers.click = tower(width=32, heads=2, n_kv=16, window=16, kept_len=64, n_seed=8, n_sum=2,
                         depth=2)
  m.towers.impression = tower(width=16, heads=2, n_kv=8, window=16, kept_len=64, n_seed=4,
                              n_sum=1, depth=1)
  m.tower_templates = "click,impression"   # size templates for streams 0, 1, ... of other data
  m.oneseq = tower(width=32, heads=2, n_kv=16, window=16, kept_len=128, n_seed=8, n_sum=2,
                   depth=2)
  m.heads.update(kind="towers", top_mlp=(64,), tower_hidden=32)
  m.dlrm.update(seq_dim=32, mlp=(128, 64))
  m.dtype = "bfloat16"
  m.backend = "auto"
  c.model = m
  c.transfer = transfer_config()
  c.data.preset = "dev"
  c.data.batch_size = 512
  c.data.num_examples = 2_000_000
  c.train.steps = 10_000
  c.train.warmup_steps = 500
  return c
