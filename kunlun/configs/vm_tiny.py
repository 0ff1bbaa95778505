"""Vertical-model (VM) tiny preset: a small, fast student of the ``tiny`` FM (spec g.1).

Same parts as ``tiny``, but one layer, short histories (16 events), narrow towers. Trained and
evaluated by the same train.py / eval.py; ``config.transfer`` holds the knowledge-transfer knobs
used by ``kunlun.transfer`` (KD weight, LoopFM on/off); plain training ignores it.
"""

from kunlun.configs.common import base_config
from kunlun.configs.transfer import transfer_config
from kunlun.configs.types import default_model, tower


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 8, 4, 1
  m.num_layers = 1
  m.final_hsp = True     # shallow towers: the spec dataflow (off) would run HSP only
  m.num_time_buckets = 8
  m.hsp_rank = 2
  m.mowe.update(num_experts=1, layers_per_expert=1, rank=2, mlp_hidden=16)
  m.towers.click = tower(width=16, heads=2, n_kv=4, window=4, kept_len=8, n_seed=4, n_sum=1,
                         depth=1)
  m.towers.impression = tower(width=8, heads=2, n_kv=4, window=4, kept_len=8, n_seed=2, n_sum=1,
                              depth=1)
  m.tower_templates = "click,impression"   # size templates for streams 0, 1, ... of other data
  m.oneseq = tower(width=16, heads=2, n_kv=4, window=4, kept_len=16, n_seed=4, n_sum=1, depth=1)
  m.heads.update(kind="towers", top_mlp=(16,), tower_hidden=8, num_experts=1, expert_hidden=8)
  m.dlrm.update(seq_dim=8, mlp=(32, 16))
  c.model = m
  c.transfer = transfer_config()
  c.data.preset = "tiny"
  c.data.batch_size = 64
  return c
