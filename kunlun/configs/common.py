"""Defaults shared by every preset: data, training, checkpointing and sharding sections.

Preset files call ``base_config()`` and then fill ``config.model`` and override what differs.
Presets describe sizes: on a dataset whose streams / surfaces have other names than the synthetic
ones, towers, heads and surface weights follow the data's schema (kunlun/schema_fit.py).
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.data = ml_collections.ConfigDict()
  c.data.preset = "tiny"             # synthetic preset generated when --data_dir is absent
  c.data.num_examples = 20_000       # examples generated for the synthetic preset (train split)
  c.data.batch_size = 64             # global batch size
  # per-surface sampling weights: "surface=weight,...", a mapping, or "auto" (in proportion to the
  # train records); weights naming none of the data's surfaces fall back to "auto" (schema_fit)
  c.data.surface_weights = "feed=0.5,stories=0.3,reels=0.2"
  c.data.shuffle_seed = 0
  c.data.num_threads = 2
  c.data.prefetch = 4
  c.data.skip_invalid = False        # True: count, report and skip invalid records
  c.data.length_balance = False      # Base Batch Shuffling (sort small groups by length)
  c.data.train_split = "train"       # split train.py reads (e.g. "pretrain": an earlier window)
  c.data.eval_batch_size = 0         # eval.py global batch size (0: same as batch_size)
  c.data.valid_split = "valid"       # held-out split for validation (absent in the data: none)

  c.train = ml_collections.ConfigDict()
  c.train.steps = 300
  c.train.epochs = 0.0               # > 0: passes over the train split (replaces steps)
  c.train.validate_every = 0         # steps between validations; 0 = once per epoch; -1 = never
  c.train.keep_best = False          # keep the params of the best validation NE in <workdir>/best
  c.train.best_task = ""             # task whose validation NE picks the best ("" = mean)
  c.train.schedule_steps = 0         # length of the LR schedule (0: train.steps)
  c.train.lr = 2e-3                  # AdamW peak learning rate (dense parameters)
  c.train.warmup_steps = 50
  c.train.schedule = "cosine"        # "cosine" | "constant"
  c.train.weight_decay = 1e-5
  c.train.b1 = 0.9
  c.train.b2 = 0.999
  c.train.clip_norm = 1.0
  c.train.emb_lr = 0.05              # row-wise Adagrad learning rate (embedding tables)
  c.train.sparse_embedding_update = False  # True: Adagrad reads/writes looked-up rows only
  c.train.checkpoint_every = 100
  c.train.keep_checkpoints = 3
  c.train.log_every = 10
  c.train.max_bad_steps = 5          # consecutive non-finite steps allowed; one more stops
  c.train.task_weights = ()          # per-task loss weights (empty: all 1.0)
  c.train.remat = "none"             # recompute in backward: none|dots_no_batch|dots_saveable|full
  c.train.remat_scope = "layer"      # what the policy wraps: "layer" | "tower" (kunlun/remat.py)
  c.train.microbatches = 1           # gradient accumulation: the batch in this many parts
  c.train.metrics_lag = 1            # step stats fetched this many steps late (0: every step)

  c.sharding = ml_collections.ConfigDict()
  c.sharding.rules = "fsdp"          # a preset name from sharding.rules

  c.model = ml_collections.ConfigDict()
  return c
