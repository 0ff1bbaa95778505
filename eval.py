"""Evaluates a train.py checkpoint: NE, AUC, calibration per surface x task (+ overall).

  python eval.py --workdir=/tmp/kunlun_tiny [--step=300] [--mesh=fsdp=-1] [--split=eval] \
      [--out=metrics.json] [--plots_dir=plots]

Restores the params only (no optimizer state) onto the given mesh, streams the split once and
writes JSON of the shape
  {"step", "examples", "metrics": {surface: {task: {ne, auc, calibration, count, positive_rate,
   bayes_ne}}}, "overall": {task: {...}}}.
The config and data directory recorded by train.py in --workdir are used unless given.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from kunlun.train import flags as runtime_flags

runtime_flags.define_config("eval.py", None, "Config file (default: the one train.py saved "
                            "in --workdir); --config.a.b=value overrides need --config.")
flags.DEFINE_string("workdir", None, "train.py workdir (checkpoints/ inside).", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
flags.DEFINE_string("mesh", "data=1,fsdp=-1,tensor=1,context=1,expert=1", "Mesh axis sizes.")
flags.DEFINE_string("dcn_mesh", None, "Mesh axis sizes across hosts.")
flags.DEFINE_string("data_dir", None, "Dataset directory (default: the one train.py used).")
flags.DEFINE_string("split", "eval", "Split to evaluate.")
flags.DEFINE_integer("batch_size", None, "Global eval batch size (default config.data.batch_size).")
flags.DEFINE_string("out", None, "Output JSON path (default <workdir>/metrics.json).")
flags.DEFINE_string("plots_dir", None, "If set, writes calibration_<task>.png there.")
runtime_flags.define()
FLAGS = flags.FLAGS

_KEYS = ("ne", "auc", "calibration", "count", "positive_rate", "bayes_ne")


def format_table(result: dict) -> str:
  """The metrics as an aligned text table (one row per surface x task, then overall)."""
  head = (f"{'surface':<10} {'task':<12} {'NE':>7} {'AUC':>7} {'calib':>7} {'count':>8} "
          f"{'pos_rate':>8} {'bayesNE':>8}")
  fmt = lambda x, w, p: f"{'-':>{w}}" if x is None else f"{x:>{w}.{p}f}"
  rows = [head, "-" * len(head)]
  cells = [(s, t, m) for s, tasks in result["metrics"].items() for t, m in tasks.items()]
  cells += [("overall", t, m) for t, m in result["overall"].items()]
  for s, t, m in cells:
    rows.append(f"{s:<10} {t:<12} {fmt(m['ne'], 7, 4)} {fmt(m['auc'], 7, 4)} "
                f"{fmt(m['calibration'], 7, 3)} {m['count']:>8d} {fmt(m['positive_rate'], 8, 4)} "
                f"{fmt(m['bayes_ne'], 8, 4)}")
  return "\n".join(rows)


def calibration_plots(arrays: dict, surfaces, tasks, plots_dir: str, bins: int = 10) -> list[str]:
  """One PNG per task: observed positive rate vs mean prediction in prediction-quantile bins,
  per surface, with the diagonal."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  os.makedirs(plots_dir, exist_ok=True)
  paths = []
  for k, task in enumerate(tasks):
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for s_idx, s in enumerate(surfaces):
      sel = (arrays["surface"] == s_idx) & (arrays["label_mask"][:, k] > 0)
      p, y = arrays["prob"][sel, k], arrays["labels"][sel, k]
      if len(p) < bins:
        continue
      edges = np.quantile(p, np.linspace(0, 1, bins + 1))
      idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, bins - 1)
      mp = [p[idx == b].mean() for b in range(bins) if np.any(idx == b)]
      my = [y[idx == b].mean() for b in range(bins) if np.any(idx == b)]
      ax.plot(mp, my, "o-", label=s, ms=3)
    hi = float(max(arrays["prob"][:, k].max(initial=0.0), arrays["labels"][:, k].mean() * 2, 0.05))
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.set(xlabel="mean prediction", ylabel="observed rate", title=f"calibration: {task}")
    ax.legend(fontsize=8)
    path = os.path.join(plots_dir, f"calibration_{task}.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    paths.append(path)
  return paths


def evaluate(argv):
  del argv
  from kunlun.train import runtime
  runtime.maybe_initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                       FLAGS.process_id)
  import jax
  import numpy as np

  runtime.enable_compilation_cache(FLAGS.compilation_cache)
  workdir = os.path.abspath(FLAGS.workdir)
  from kunlun.train import checkpoint
  try:
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
    if not ckpt.all_steps():
      runtime.fail(f"--workdir={workdir}: no checkpoints in {ckpt.directory}")
  except checkpoint.CheckpointError as e:
    runtime.fail(f"--workdir={workdir}: {e}")
  if FLAGS.step is not None and FLAGS.step not in ckpt.all_steps():
    runtime.fail(f"--step={FLAGS.step}: no such checkpoint; available {ckpt.all_steps()}")

  config, saved_data_dir = runtime.run_config(workdir, FLAGS.config, FLAGS.trust_workdir)
  data_dir = FLAGS.data_dir or saved_data_dir
  if not data_dir:
    runtime.fail("no --data_dir given and none recorded in the workdir")
  mesh = runtime.build_mesh(FLAGS.mesh, FLAGS.dcn_mesh)
  rules = runtime.get_rules(config.sharding.rules)
  bs = FLAGS.batch_size or config.data.get("eval_batch_size", 0) or config.data.batch_size
  runtime.check_batch_size(bs, mesh, rules, "eval batch size")
  schema = runtime.load_schema(data_dir)
  runtime.check_data_files(data_dir, FLAGS.split)
  model = runtime.build_model(config, schema)

  from data import pipeline
  from kunlun import config as model_config
  from kunlun.train import metrics
  from kunlun.train import step as step_lib
  from sharding import partition

  data_cfg = config.data.copy_and_resolve_references()
  data_cfg.batch_size = bs
  try:
    ds = pipeline.make_dataset(data_cfg, data_dir, FLAGS.split, model_config.seq_lens(config),
                               train=False, shard_index=jax.process_index(),
                               shard_count=jax.process_count())
  except (ValueError, FileNotFoundError) as e:
    runtime.fail(f"--split={FLAGS.split} in {data_dir}: {e}")
  it = iter(ds)
  first = next(it, None)
  if first is None:
    runtime.fail(f"split {FLAGS.split!r} in {data_dir} is empty")
  abstract = partition.abstract_params(model, jax.random.key(0), first, mesh, rules)
  try:
    step, params = ckpt.restore_params(abstract, FLAGS.step)
  except checkpoint.CheckpointError as e:
    runtime.fail(str(e))
  b_shard = partition.batch_sharding(mesh, rules)
  predict = step_lib.make_predict_step(model)
  acc = metrics.EvalAccumulator(schema.surfaces, schema.task_names)
  host_keys = ("labels", "label_mask", "surface", "true_prob", "example_mask")
  with partition.activate(mesh, rules):
    batch = first
    while batch is not None:
      prob = predict(params, pipeline.device_put_batch(batch, b_shard))
      host = {k: batch[k] for k in host_keys if k in batch}
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        prob = multihost_utils.process_allgather(prob, tiled=True)
        host = multihost_utils.process_allgather(host, tiled=True)
      acc.add(np.asarray(prob), host)
      batch = next(it, None)
  per_surface, overall = acc.result()
  result = {"step": int(step), "examples": acc.examples, "metrics": per_surface, "overall": overall}
  if jax.process_index() == 0:
    out = FLAGS.out or os.path.join(workdir, "metrics.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(result, f, indent=1)
    print(f"step {step}, split {FLAGS.split!r}, {acc.examples} examples, mesh "
          f"{dict(mesh.shape)}")
    print(format_table(result))
    print(f"wrote {out}")
    if FLAGS.plots_dir:
      for p in calibration_plots(acc.arrays(), schema.surfaces, schema.task_names, FLAGS.plots_dir):
        print(f"wrote {p}")
  ckpt.close()
  return result


def main(argv):
  from kunlun.train.runtime import run_main
  run_main("eval.py", evaluate, argv)


if __name__ == "__main__":
  app.run(main, flags_parser=runtime_flags.parser("eval.py"))
