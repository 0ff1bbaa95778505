"""Mid preset (spec d.7 "Mid", the benchmark size): d_ns 128 / N_ns 32, three towers.

High-value towers (``click``, ``conversion``): d 256 / H 4 / d_h 64, 8 layers, HSP 64->16.
Kept lengths fit the synthetic ``mid`` data preset (click 512, conversion 128, impression 1024
of 2048). Low-value tower (``impression``): d 128 / H 2 / d_h 64, 4 layers, HSP 32->8.
n_kv 64, w 64, SumKronLinear rank 4, MoWE 2 experts x 2 Wukong layers with rank 16.
Local batch 1024.
"""

from kunlun.configs.common import base_config
from kunlun.configs.types import default_model, tower

HIGH = dict(width=256, heads=4, n_kv=64, window=64, n_seed=64, n_sum=16, depth=8)
LOW = dict(width=128, heads=2, n_kv=64, window=64, n_seed=32, n_sum=8, depth=4)


def get_config():
  c = base_config()
  m = default_model()
  m.d_ns, m.n_ns, m.n_dense_tokens = 128, 32, 2
  m.num_layers = 8
  m.hsp_rank = 4
  m.mowe.update(num_experts=2, layers_per_expert=2, rank=16, mlp_hidden=512)
  m.towers.click = tower(kept_len=512, **HIGH)
  m.towers.conversion = tower(kept_len=128, **HIGH)
  m.towers.impression = tower(kept_len=1024, **LOW)
  m.tower_templates = "click,impression,conversion"   # sizes for streams 0, 1, 2 of other data
  m.oneseq = tower(width=256, heads=4, n_kv=64, window=64, kept_len=1664, n_seed=64, n_sum=16,
                   depth=8)
  m.heads.update(kind="towers", top_mlp=(512, 256), tower_hidden=128)
  m.dlrm.update(seq_dim=128, mlp=(1024, 512))
  m.dtype = "bfloat16"
  m.backend = "auto"
  c.model = m
  c.data.preset = "mid"
  c.data.batch_size = 1024
  c.data.num_examples = 50_000
  c.train.steps = 1_000
  c.train.warmup_steps = 100
  return c
