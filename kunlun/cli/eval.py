"""Evaluates a train.py checkpoint: NE, AUC, calibration per surface x task (+ overall).

  kunlun-eval --workdir=/tmp/kunlun_tiny [--step=300 | --best] [--mesh=fsdp=-1] \
      [--split=eval] [--out=metrics.json] [--plots_dir=plots] [--predictions=preds.parquet]

``kunlun-eval`` and ``python eval.py`` (from a checkout) are the same program. It restores the
params only (no optimizer state) onto the given mesh, streams the split once and writes JSON of
the shape
  {"step", "best", "split", "examples", "ne_normalisation", "metrics": {surface: {task: {ne, auc,
   calibration, count, positive_rate, bayes_ne}}}, "overall": {task: {...}}}.
NE is normalised by each evaluated cell's own positive rate (the eval window's base rate, per
surface x task, or per task overall). ``--predictions`` writes one Parquet row per example: the
keys (user_id, ad_id, request_ts), surface name, ``label.<task>`` (null = not labelled) and
``prob.<task>``. ``--best`` evaluates the keep-best params (config.train.keep_best).
The config and data directory recorded by train.py in --workdir are used unless given. The
split the model was trained on is refused without ``--allow_train_split``; the output paths are
checked before any work (docs/outputs.md).
"""

from __future__ import annotations

import os

from absl import flags

from kunlun.train import settings, startup
from kunlun.utils import flags as program_flags

FLAGS = flags.FLAGS
NE_NORMALISATION = ("mean log loss / entropy of the positive rate of the same evaluated examples "
                    "(each surface x task cell and each overall task uses its own base rate)")
KEY_COLUMNS = ("user_id", "ad_id", "request_ts")


def main() -> None:
  """``kunlun-eval`` / ``python eval.py``: defines the flags, parses them and evaluates (one-line
  errors, ``startup.run_main``)."""
  define_flags()
  program_flags.run(_run, __name__)


def _run(argv) -> None:
  startup.run_main(program_flags.prog(), evaluate, argv)


def define_flags() -> None:
  """The program's flags, defined when it starts (importing this module defines none: train's
  flags bear the same names)."""
  program_flags.define_config(program_flags.prog(), None, "Config file (default: the one "
                              "train.py saved in --workdir); --config.a.b=value overrides need "
                              "--config.")
  flags.DEFINE_string("workdir", None, "train.py workdir (checkpoints/ inside).", required=True)
  flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
  flags.DEFINE_string("mesh", "data=1,fsdp=-1,tensor=1,context=1,expert=1", "Mesh axis sizes.")
  flags.DEFINE_string("dcn_mesh", None, "Mesh axis sizes across hosts.")
  flags.DEFINE_string("data_dir", None, "Dataset directory (default: the one train.py used).")
  flags.DEFINE_string("split", "eval", "Split to evaluate.")
  flags.DEFINE_integer("batch_size", None,
                       "Global eval batch size (default config.data.batch_size).")
  flags.DEFINE_string("out", None, "Output JSON path (default <workdir>/metrics.json).")
  flags.DEFINE_string("plots_dir", None, "If set, writes calibration_<task>.png there.")
  flags.DEFINE_string("predictions", None,
                      "If set, writes per-example predictions (Parquet) there.")
  flags.DEFINE_bool("best", False, "Evaluate <workdir>/best (config.train.keep_best) instead.")
  flags.DEFINE_bool("allow_train_split", False, "Evaluate the split the model was trained on "
                    "(refused without it: such metrics overstate how the model does on new data).")
  program_flags.define()


def write_predictions(path: str, arrays: dict, surfaces, tasks) -> None:
  """One Parquet row per example: keys, surface name, label.<task> (null = not labelled) and
  prob.<task>."""
  import numpy as np
  import pyarrow as pa
  import pyarrow.parquet as pq
  cols = {k: pa.array(np.asarray(arrays[k], np.int64)) for k in KEY_COLUMNS}
  cols["surface"] = pa.array(np.asarray(surfaces, object)[np.asarray(arrays["surface"], int)]
                             .tolist(), pa.string())
  for k, t in enumerate(tasks):
    cols[f"label.{t}"] = pa.array(np.asarray(arrays["labels"][:, k], np.int8),
                                  mask=np.asarray(arrays["label_mask"][:, k]) == 0)
  for k, t in enumerate(tasks):
    cols[f"prob.{t}"] = pa.array(np.asarray(arrays["prob"][:, k], np.float32))
  from kunlun.utils import atomic
  with atomic.target(path) as tmp:          # a killed write leaves no partial file at ``path``
    pq.write_table(pa.table(cols), tmp)


def trained_split_note(info: dict, data_dir: str | None, split: str) -> str | None:
  """One line when ``split`` of ``data_dir`` is the split the run recorded in ``info``
  (``run_info.json``: its data directory and ``config.data.train_split``) trained on; None
  otherwise, or when the run recorded neither."""
  cfg = info.get("config")
  data = cfg.get("data") if isinstance(cfg, dict) else None
  trained = data.get("train_split") if isinstance(data, dict) else None
  recorded = info.get("data_dir")
  if split != trained or not isinstance(recorded, str) or not data_dir:
    return None
  if os.path.realpath(data_dir) != os.path.realpath(recorded):
    return None
  return (f"--split={split} is the split this model was trained on ({recorded}, recorded in "
          "run_info.json): its metrics overstate how the model does on new data")


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

  from kunlun.utils import atomic
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
    with atomic.target(path) as tmp:
      fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    paths.append(path)
  return paths


def evaluate(argv):
  del argv
  # jax loads from here on (after the multi-host start): --help and bad flags answered without it
  from kunlun.train.devices import maybe_initialize_distributed
  maybe_initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from data import pipeline
  from kunlun.train import checkpoint, loop, metrics
  from kunlun.train import step as step_lib
  from kunlun.train.run_info import saved_run_info
  from kunlun.train.workdir import check_output, check_outputs
  from kunlun.utils import atomic
  from sharding import partition

  workdir = os.path.abspath(FLAGS.workdir)
  is_main = jax.process_index() == 0
  try:
    settings.check_flag("batch_size", FLAGS.batch_size, 1,
                        "an integer >= 1 (leave it out for config.data.eval_batch_size)")
    settings.check_flag("step", FLAGS.step, 0)
  except settings.SettingsError as e:
    startup.fail(str(e))
  if FLAGS.best and FLAGS.step is not None:
    startup.fail("give --step or --best, not both")
  if FLAGS.best and not os.path.isdir(os.path.join(workdir, "best")):
    startup.fail(f"--best: no keep-best params in {workdir}/best (train with "
                 "--config.train.keep_best=True on data with a validation split)")
  try:
    ckpt = checkpoint.Checkpointer(os.path.join(workdir, "best" if FLAGS.best else "checkpoints"),
                                   read_only=True)
    if not ckpt.all_steps():
      startup.fail(f"--workdir={workdir}: no checkpoints in {ckpt.directory}")
  except checkpoint.CheckpointError as e:
    startup.fail(f"--workdir={workdir}: {e}")
  if FLAGS.step is not None and FLAGS.step not in ckpt.all_steps():
    startup.fail(f"--step={FLAGS.step}: no such checkpoint; available {ckpt.all_steps()}")
  out = os.path.abspath(FLAGS.out or os.path.join(workdir, "metrics.json"))
  info = saved_run_info(workdir) or {}
  data_dir = FLAGS.data_dir or info.get("data_dir")
  check_outputs(                               # before evaluating (docs/outputs.md)
      [("--out" if FLAGS.out else "--out (default)", out), ("--predictions", FLAGS.predictions)],
      dirs=[("--plots_dir", FLAGS.plots_dir, ("calibration_*.png",))],
      inputs=[("--data_dir", FLAGS.data_dir),
              ("--config", program_flags.config_file())],
      workdir=workdir)
  if FLAGS.plots_dir:
    check_output(os.path.join(FLAGS.plots_dir, "calibration.png"), "--plots_dir")
  trained_on = trained_split_note(info, data_dir, FLAGS.split)
  if trained_on and not FLAGS.allow_train_split:
    startup.fail(f"{trained_on}; pass --allow_train_split to evaluate it anyway")
  if trained_on and is_main:
    print(f"note: {trained_on} (--allow_train_split)", flush=True)

  run = loop.eval_setup(workdir, ckpt, config=FLAGS.config, trust_workdir=FLAGS.trust_workdir,
                        data_dir=FLAGS.data_dir, split=FLAGS.split, batch_size=FLAGS.batch_size,
                        step=FLAGS.step, mesh=FLAGS.mesh, dcn_mesh=FLAGS.dcn_mesh,
                        compilation_cache=FLAGS.compilation_cache)
  schema = run.schema
  predict = step_lib.make_predict_step(run.model)
  acc = metrics.EvalAccumulator(schema.surfaces, schema.task_names)
  host_keys = ("labels", "label_mask", "surface", "true_prob", "example_mask") + (
      KEY_COLUMNS if FLAGS.predictions else ())
  keys = {k: [] for k in KEY_COLUMNS}
  with partition.activate(run.mesh, run.rules):
    for batch in run.batches:
      prob = predict(run.params, pipeline.device_put_batch(batch, run.batch_sharding))
      host = {k: batch[k] for k in host_keys if k in batch}
      if jax.process_count() > 1:
        prob = multihost_utils.process_allgather(prob, tiled=True)
        host = multihost_utils.process_allgather(host, tiled=True)
      acc.add(np.asarray(prob), host)
      if FLAGS.predictions:
        real = np.asarray(host["example_mask"]) > 0
        for k in KEY_COLUMNS:
          keys[k].append(np.asarray(host[k])[real])
  per_surface, overall = acc.result()
  result = {"step": int(run.step), "best": bool(FLAGS.best), "split": FLAGS.split,
            "examples": acc.examples,
            "ne_normalisation": NE_NORMALISATION,
            "metrics": per_surface, "overall": overall}
  if is_main:
    print(f"step {run.step}, split {FLAGS.split!r}, {acc.examples} examples, mesh "
          f"{dict(run.mesh.shape)}")
    print(format_table(result))
    # every output is written atomically, metrics.json last: a metrics.json at --out means the
    # predictions and plots asked for are complete too
    try:
      if FLAGS.predictions:
        arrays = {**acc.arrays(), **{k: np.concatenate(v) for k, v in keys.items()}}
        write_predictions(FLAGS.predictions, arrays, schema.surfaces, schema.task_names)
        print(f"wrote {FLAGS.predictions} ({acc.examples} examples)")
      if FLAGS.plots_dir:
        for p in calibration_plots(acc.arrays(), schema.surfaces, schema.task_names,
                                   FLAGS.plots_dir):
          print(f"wrote {p}")
      atomic.write_json(out, result)
    except OSError as e:
      startup.fail(f"cannot write {e.filename or out} ({e.strerror or e}); nothing partial was "
                   "left at the output paths")
    print(f"wrote {out}")
  ckpt.close()
  return result
