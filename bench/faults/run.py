"""Fault injection on real train.py / eval.py runs (tiny Kunlun model, CPU): does training
survive, and does it end exactly where an uninterrupted run ends?
Notes: docs/guides/benchmarks.md, ``bench/faults/run.py``."""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import flax  # noqa: E402
import grain  # noqa: E402
import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from absl import logging  # noqa: E402

from bench.output import at_least, make_folder  # noqa: E402
from data import synthetic  # noqa: E402
from kunlun.utils import atomic  # noqa: E402


class Runner:
  """train.py / eval.py subprocesses through ``fault_hooks.py`` sharing one compilation cache."""

  def __init__(self, base: str, data: str, steps: int, every: int):
    self.base, self.data, self.steps, self.every = base, data, steps, every
    self.env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                    KUNLUN_COMPILATION_CACHE=os.path.join(base, "xla_cache"))
    self.runs = []

  def args(self, wd, data=None, extra=()):
    return [f"--workdir={wd}", f"--data_dir={data or self.data}", f"--steps={self.steps}",
            f"--config.train.checkpoint_every={self.every}", "--config.train.log_every=1",
            "--config.train.keep_checkpoints=3", *extra]

  def run(self, script, args, faults=None, label=""):
    env = dict(self.env)
    if faults:
      env["KUNLUN_FAULTS"] = json.dumps(faults)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "faults", "hooks.py"), script,
                        *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    dt = time.perf_counter() - t0
    self.runs.append({"label": label, "script": script, "faults": faults or {},
                      "rc": p.returncode, "seconds": round(dt, 1)})
    print(f"  [{label}] {script} rc={p.returncode} {dt:.0f}s", flush=True)
    return p

  def train(self, wd, faults=None, data=None, extra=(), label=""):
    return self.run("train.py", self.args(wd, data, extra), faults, label)


def committed(wd) -> list[int]:
  d = os.path.join(wd, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(int(x) for x in os.listdir(d) if x.isdigit() and
                os.path.exists(os.path.join(d, x, "commit_success.txt")))


def resumed_from(p) -> int:
  m = re.search(r"resumed from step (\d+)", p.stdout)
  return int(m.group(1)) if m else 0


def params(wd, step):
  logging.set_verbosity(logging.ERROR)
  path = os.path.join(wd, "checkpoints", str(step), "params")
  meta = ocp.PyTreeCheckpointer().metadata(path)
  tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                      is_leaf=lambda x: not isinstance(x, dict))
  got = ocp.PyTreeCheckpointer().restore(path, restore_args=args)
  return [(jax.tree_util.keystr(k), np.asarray(v))
          for k, v in jax.tree_util.tree_leaves_with_path(got)]


def same_params(a, b, step) -> bool:
  la, lb = params(a, step), params(b, step)
  return len(la) == len(lb) > 10 and all(
      ka == kb and np.array_equal(x, y) for (ka, x), (kb, y) in zip(la, lb, strict=True))


def iter_state(wd, step) -> dict:
  return json.load(open(os.path.join(wd, "checkpoints", str(step), "data_iter",
                                     "process_0-of-1.json")))


def batch_log(path) -> list[str]:
  if not os.path.exists(path):
    return []
  return [line.split()[1] for line in open(path)]


def one_line(p, prog) -> bool:
  out = p.stdout + p.stderr
  errors = [x for x in p.stderr.splitlines() if x.startswith(f"{prog}: error: ")]
  return (p.returncode == 2 and len(errors) == 1 and "Traceback" not in out
          and "Event loop is closed" not in out)


def flip_bit(path, offset=None):
  n = os.path.getsize(path)
  offset = n // 2 if offset is None else offset
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(1)
    f.seek(offset)
    f.write(bytes([b[0] ^ 0x01]))


def flip_shard_bytes(path):
  """Damages an ArrayRecord shard in place: one flipped byte every 16 KB of its first half
  (records only, not the footer index), so the manifest's size still matches and the damage is
  met while reading."""
  size = os.path.getsize(path)
  with open(path, "r+b") as f:
    for off in range(4096, size // 2, 16384):
      f.seek(off)
      b = f.read(1)
      f.seek(off)
      f.write(bytes([b[0] ^ 0xFF]))


def largest_param_file(wd, step):
  files = glob.glob(os.path.join(wd, "checkpoints", str(step), "params", "ocdbt.process_0",
                                 "d", "*"))
  return max(files, key=os.path.getsize)


# ---- the faults ---------------------------------------------------------------------------------

def kill_trials(r: Runner, base_wd, base_hashes, base_metrics, kills, per_run, rng):
  """SIGKILLs at random steps / mid-save, ``per_run`` per workdir, then finish and compare."""
  S, G = r.steps, 64
  records, groups, takeovers = [], [], []
  ckpt_steps = list(range(r.every, S + 1, r.every))
  for g in range(math.ceil(kills / per_run)):
    wd = os.path.join(r.base, f"kill_{g}")
    lineage: dict[int, str] = {}
    n_here = min(per_run, kills - g * per_run)
    for k in range(n_here + 1):
      start = (committed(wd) or [0])[-1]
      final = k == n_here or start >= S - 1              # nothing left to interrupt
      log = os.path.join(r.base, f"kill_{g}_{k}.log")
      if final:
        faults, reached, kind = {"batch_log": log}, S, "finish"
      elif rng.random() < 0.5 and [c for c in ckpt_steps if c > start]:
        c = rng.choice([c for c in ckpt_steps if c > start])
        faults, reached, kind = {"kill_after_save": c, "batch_log": log}, c, "mid-save"
      else:
        a = rng.randint(start + 1, S - 1)
        faults, reached, kind = {"kill_at_step": a - start, "batch_log": log}, a, "at step"
      p = r.train(wd, faults, label=f"kill {g}.{k} {kind} {reached}")
      if k > 0:                         # the run before was killed: its lock is taken over
        takeovers.append("which no longer runs" in p.stderr and "taking the workdir over"
                         in p.stderr)
      got_start = resumed_from(p)
      for i, h in enumerate(batch_log(log)):
        lineage[got_start + i] = h
      if final:
        ok = p.returncode == 0
        groups.append({"workdir": wd, "resumed_from": got_start, "rc": p.returncode})
        break
      after = (committed(wd) or [0])[-1]
      records.append({"group": g, "kind": kind, "target_step": reached, "start": got_start,
                      "rc": p.returncode, "committed_after": after,
                      "steps_lost": reached - after, "killed": p.returncode == -9,
                      "target_committed": reached in committed(wd)})
    grp = groups[-1]
    grp["params_equal"] = ok and same_params(base_wd, wd, S)
    ev = r.run("eval.py", [f"--workdir={wd}", f"--out={wd}/metrics.json"], label=f"eval kill {g}")
    grp["eval_equal"] = ev.returncode == 0 and json.load(open(f"{wd}/metrics.json")) == \
        base_metrics
    grp["batches_equal"] = [lineage.get(i) for i in range(S)] == base_hashes
    st = iter_state(wd, S)
    grp["position_ok"] = st["plan"]["position"] == S * G and \
        st["plan"] == iter_state(base_wd, S)["plan"]
    grp["ok"] = all(grp[k] for k in ("params_equal", "eval_equal", "batches_equal",
                                     "position_ok"))
  return records, groups, takeovers


def checkpoint_damage(r: Runner, base_wd, how):
  S, every = r.steps, r.every
  wd = os.path.join(r.base, f"ckpt_{how}")
  shutil.copytree(base_wd, wd, ignore=shutil.ignore_patterns("tb"))
  if how == "flip":
    flip_bit(largest_param_file(wd, S))
  else:
    for f in glob.glob(os.path.join(wd, "checkpoints", str(S), "params", "**", "d", "*"),
                       recursive=True):
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
  ev = r.run("eval.py", [f"--workdir={wd}"], label=f"eval ckpt {how}")
  p = r.train(wd, label=f"ckpt {how}")
  moved = [d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.startswith(f"{S}.corrupt")]
  rec = {"eval_one_line_error": one_line(ev, "eval.py"), "rc": p.returncode,
         "resumed_from": resumed_from(p), "moved_aside": moved,
         "detected_by": "checksum" if "checksum mismatch" in p.stderr else "restore error",
         "params_equal": p.returncode == 0 and same_params(base_wd, wd, S)}
  rec["ok"] = (rec["eval_one_line_error"] and rec["rc"] == 0 and rec["resumed_from"] == S - every
               and len(moved) == 1 and rec["params_equal"])
  rec["steps_lost"] = S - rec["resumed_from"]
  return rec


def write_failure(r: Runner, base_wd):
  S, every = r.steps, r.every
  wd = os.path.join(r.base, "ckpt_eio")
  p = r.train(wd, {"save_oserror": [every]}, label="ckpt I/O error")
  rec = {"rc": p.returncode, "warned": f"checkpoint of step {every} could not be written"
         in p.stderr, "committed": committed(wd),
         "params_equal": p.returncode == 0 and same_params(base_wd, wd, S)}
  rec["ok"] = rec["rc"] == 0 and rec["warned"] and every not in rec["committed"] and \
      rec["params_equal"] and "Traceback" not in p.stderr
  rec["steps_lost"] = 0
  return rec


def concurrency(r: Runner, base_wd):
  """A second train.py on the workdir of a running one: refused at once, naming the holder; the
  first is undisturbed (bitwise equal to the baseline, every step logged once)."""
  S = r.steps
  wd = os.path.join(r.base, "two_writers")
  env = dict(r.env)
  cmd = [sys.executable, os.path.join(ROOT, "bench", "faults", "hooks.py"), "train.py", *r.args(wd)]
  t0 = time.perf_counter()
  first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  jsonl = os.path.join(wd, "metrics.jsonl")
  while first.poll() is None and not (os.path.exists(jsonl) and
                                      len(open(jsonl).read().splitlines()) >= 2):
    time.sleep(0.2)
  running = first.poll() is None
  second = r.train(wd, label="second train.py, same workdir")
  out, err = first.communicate(timeout=3600)
  r.runs.append({"label": "first train.py (running)", "script": "train.py", "faults": {},
                 "rc": first.returncode, "seconds": round(time.perf_counter() - t0, 1)})
  steps = [json.loads(x)["step"] for x in open(jsonl)]
  rec = {"second_rc": second.returncode, "second_one_line": one_line(second, "train.py"),
         "second_error": second.stderr.strip().splitlines()[-1:],
         "names_holder": f"pid {first.pid} on host" in second.stderr,
         "second_took_seconds": r.runs[-2]["seconds"], "first_rc": first.returncode,
         "first_running_when_second_started": running,
         "steps_logged_once": sorted(steps) == list(range(1, S + 1)),
         "params_equal": first.returncode == 0 and same_params(base_wd, wd, S),
         "lock_left_empty": open(os.path.join(wd, "train.lock")).read() == "", "steps_lost": 0}
  rec["ok"] = (running and rec["second_one_line"] and rec["names_holder"] and rec["first_rc"] == 0
               and rec["steps_logged_once"] and rec["params_equal"] and rec["lock_left_empty"])
  return rec


def _excerpt(text: str, mark: str, n: int = 12) -> list[str]:
  """The lines around the first ``mark`` in ``text`` (for the JSON record of a failed check)."""
  lines = text.splitlines()
  at = next((i for i, x in enumerate(lines) if mark in x), None)
  return [] if at is None else lines[max(0, at - 2):at + n]


def _mount_small(path: str, kib: int):
  """A tmpfs of ``kib`` KiB at ``path``; returns an unmount function, or None (not root, or
  mounting not allowed)."""
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0:
    return None
  p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", path],
                     capture_output=True)
  if p.returncode:
    return None
  return lambda: subprocess.run(["umount", "-l", path], capture_output=True)


def disk_full(r: Runner, base_wd):
  """The workdir on a filesystem that holds about 2.5 checkpoints (data elsewhere)."""
  S, every = r.steps, r.every
  ck = os.path.join(base_wd, "checkpoints", str(S))
  size = sum(-(-os.path.getsize(os.path.join(d, f)) // 4096) * 4096      # tmpfs pages
             for d, _, fs in os.walk(ck) for f in fs)
  mnt = os.path.join(r.base, "small_disk")
  kib = int(2.5 * size / 1024)
  unmount = _mount_small(mnt, kib)
  faults = None if unmount else {"disk_full_at_step": 2 * every + 1}
  wd = os.path.join(mnt, "wd")
  try:
    p = r.train(wd, faults, label=f"disk full ({kib} KiB tmpfs)" if unmount else
                "disk full (injected ENOSPC)")
    left = sorted(os.listdir(os.path.join(wd, "checkpoints"))) if os.path.isdir(
        os.path.join(wd, "checkpoints")) else []
    good = committed(wd)
    m = re.search(r"stopped at step (\d+)", p.stderr)
    rec = {"filesystem": f"tmpfs {kib} KiB" if unmount else "injected ENOSPC",
           "checkpoint_bytes": size, "rc": p.returncode, "one_line_error": one_line(p, "train.py"),
           "error": p.stderr.strip().splitlines()[-1:], "disk_full_named": "disk full" in p.stderr,
           "tracebacks": (p.stdout + p.stderr).count("Traceback"),
           "traceback_excerpt": _excerpt(p.stdout + p.stderr, "Traceback"),
           "partial_steps_left": [x for x in left if "orbax-checkpoint-tmp" in x],
           "committed": good, "stopped_at": int(m.group(1)) if m else None}
    wd2 = os.path.join(r.base, "disk_full_resumed")      # "free some space": another disk
    shutil.copytree(wd, wd2, ignore=shutil.ignore_patterns("tb"))
  finally:
    if unmount:
      unmount()
  p2 = r.train(wd2, label="disk full: resumed with space")
  rec["resumed_from"] = resumed_from(p2)
  rec["params_equal"] = p2.returncode == 0 and same_params(base_wd, wd2, S)
  rec["steps_lost"] = (rec["stopped_at"] or 0) - (good[-1] if good else 0)
  rec["ok"] = (rec["one_line_error"] and rec["disk_full_named"] and not rec["tracebacks"]
               and not rec["partial_steps_left"] and bool(good)
               and rec["resumed_from"] == good[-1] and rec["params_equal"])
  return rec


def shard_damage(r: Runner, rng):
  S = r.steps
  data = os.path.join(r.base, "data_flipped")
  shutil.copytree(r.data, data)
  path = os.path.join(data, "train", "feed-00000-of-00001.arrayrecord")
  flip_shard_bytes(path)
  wd = os.path.join(r.base, "shard_noskip")
  p = r.train(wd, data=data, label="shard flip, no skip")
  m = re.search(r"records? (\d+)(?:-(\d+))?: damaged chunk", p.stderr)
  logged = [json.loads(x)["step"] for x in open(os.path.join(wd, "metrics.jsonl"))] \
      if os.path.exists(os.path.join(wd, "metrics.jsonl")) else []
  died_at = max(logged, default=0)
  noskip = {"rc": p.returncode, "one_line_error": one_line(p, "train.py"),
            "names_file_and_range": bool(m) and path in p.stderr,
            "steps_lost": died_at - (committed(wd) or [0])[-1]}
  noskip["ok"] = noskip["one_line_error"] and noskip["names_file_and_range"]
  skip_args = ["--config.data.skip_invalid=True"]
  wd_a = os.path.join(r.base, "shard_skip")
  pa = r.train(wd_a, data=data, extra=skip_args, label="shard flip, skip")
  wd_b = os.path.join(r.base, "shard_skip_killed")
  kill = rng.randint(r.every + 1, S - 1)
  pb1 = r.train(wd_b, {"kill_at_step": kill}, data=data, extra=skip_args,
                label=f"shard flip, skip, kill {kill}")
  pb2 = r.train(wd_b, data=data, extra=skip_args, label="shard flip, skip, resume")
  counts = iter_state(wd_a, S)["invalid"] if pa.returncode == 0 else {}
  skip = {"rc": pa.returncode, "skipped": counts, "killed_at": kill,
          "killed": pb1.returncode == -9, "resumed_from": resumed_from(pb2),
          "steps_lost": kill - resumed_from(pb2)}
  skip["resume_equal"] = pa.returncode == pb2.returncode == 0 and same_params(wd_a, wd_b, S) \
      and iter_state(wd_b, S)["invalid"] == counts
  skip["ok"] = skip["resume_equal"] and counts.get("bytes", 0) > 0 and skip["killed"]
  return noskip, skip


def shard_truncated(r: Runner):
  data = os.path.join(r.base, "data_cut")
  shutil.copytree(r.data, data)
  path = os.path.join(data, "train", "stories-00000-of-00001.arrayrecord")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  p = r.train(os.path.join(r.base, "shard_cut"), data=data, label="shard truncated")
  rec = {"rc": p.returncode, "one_line_error": one_line(p, "train.py"),
         "names_file": f"{path}: " in p.stderr, "steps_lost": 0}
  rec["ok"] = rec["one_line_error"] and rec["names_file"]
  return rec


def nan_batch(r: Runner, rng):
  k = rng.randint(2, r.steps - 1)
  wd = os.path.join(r.base, "nan")
  p = r.train(wd, {"nan_at_step": k}, label=f"nan batch {k}")
  logged = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  rec = {"rc": p.returncode, "step": k, "skipped_updates": logged[-1].get("bad_steps"),
         "message": f"step {k}: non-finite loss" in p.stdout, "steps_lost": 1}
  rec["ok"] = p.returncode == 0 and rec["skipped_updates"] == 1 and rec["message"]
  return rec


# ---- main ---------------------------------------------------------------------------------------

CASES = ("kills", "damage", "write_error", "shard", "nan", "concurrency", "disk_full")


def versions() -> dict:
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
          "orbax_checkpoint": orbax.checkpoint.__version__,
          "grain": getattr(grain, "__version__", "?"), "python": sys.version.split()[0]}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python bench/faults/run.py",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--kills", type=at_least(0), default=20, help="random SIGKILLs in all")
  ap.add_argument("--kills_per_run", type=at_least(1), default=5,
                  help="kills before a run is finished")
  ap.add_argument("--steps", type=at_least(1), default=40)
  ap.add_argument("--checkpoint_every", type=at_least(1), default=10)
  ap.add_argument("--num_examples", type=at_least(1), default=4000,
                  help="train examples (tiny preset)")
  ap.add_argument("--seed", type=at_least(0), default=0)
  ap.add_argument("--quick", action="store_true", help="4 kills, 20 steps")
  ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
  ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "faults.json"))
  ap.add_argument("--cases", default="all",
                  help=f"comma-separated subset of {','.join(CASES)}: run only these and merge "
                       "them into the table already at --out")
  a = ap.parse_args(argv)
  bad = set(a.cases.split(",")) - set(CASES) if a.cases != "all" else set()
  if bad:
    ap.error(f"--cases: unknown {sorted(bad)}; allowed {CASES}")
  if a.quick:
    a.kills, a.kills_per_run, a.steps, a.checkpoint_every = 4, 2, 20, 5
  rng = random.Random(a.seed)
  t_start = time.perf_counter()
  make_folder("--workdir", a.workdir)
  base = a.workdir or tempfile.mkdtemp(prefix="kunlun_faults_")
  data = os.path.join(base, "data")
  if not os.path.exists(os.path.join(data, "manifest.json")):
    synthetic.generate(data, "tiny", a.num_examples, seed=0)
  r = Runner(base, data, a.steps, a.checkpoint_every)
  print(f"baseline: {a.steps} steps, checkpoints every {a.checkpoint_every} ({base})", flush=True)
  base_wd = os.path.join(base, "baseline")
  log = os.path.join(base, "baseline.log")
  p = r.train(base_wd, {"batch_log": log}, label="baseline")
  if p.returncode:
    print(p.stderr[-3000:])
    return 1
  base_hashes = batch_log(log)
  ev = r.run("eval.py", [f"--workdir={base_wd}", f"--out={base_wd}/metrics.json"],
             label="eval baseline")
  base_metrics = json.load(open(f"{base_wd}/metrics.json")) if ev.returncode == 0 else None

  want = set(CASES if a.cases == "all" else a.cases.split(","))
  res, rows = {}, {}
  if "kills" in want:
    kills, groups, takeovers = kill_trials(r, base_wd, base_hashes, base_metrics, a.kills,
                                           a.kills_per_run, rng)
    n_kill = sum(k["killed"] for k in kills)
    mid = sum(k["killed"] and k["kind"] == "mid-save" and not k["target_committed"]
              for k in kills)
    res.update(kills=kills, kill_runs=groups, stale_lock_takeovers=takeovers)
    rows["kills"] = ("SIGKILL (random step / mid async save)", f"{n_kill} ({mid} mid-save)",
                     f"{sum(g['ok'] for g in groups)}/{len(groups)} runs resumed bitwise equal "
                     "(params, eval, batches, position); stale lock taken over with a warning "
                     f"in {sum(takeovers)}/{len(takeovers)}", sum(k["steps_lost"] for k in kills))
    res["kills_ok"] = all(g["ok"] for g in groups) and all(k["killed"] for k in kills) and all(
        takeovers)
  if "damage" in want:
    flip = res["checkpoint_flip"] = checkpoint_damage(r, base_wd, "flip")
    cut = res["checkpoint_truncate"] = checkpoint_damage(r, base_wd, "truncate")
    rows["flip"] = ("checkpoint: 1 bit flipped in param data", 1,
                    f"{'ok' if flip['ok'] else 'FAIL'}: eval one-line error; detected by "
                    f"{flip['detected_by']}, moved aside, resumed from {flip['resumed_from']}, "
                    "final bitwise equal", flip["steps_lost"])
    rows["cut"] = ("checkpoint: param files truncated", 1,
                   f"{'ok' if cut['ok'] else 'FAIL'}: eval one-line error; moved aside, resumed "
                   f"from {cut['resumed_from']}, final bitwise equal", cut["steps_lost"])
  if "write_error" in want:
    eio = res["checkpoint_write_error"] = write_failure(r, base_wd)
    rows["write_error"] = ("checkpoint write fails (I/O error)", 1,
                           f"{'ok' if eio['ok'] else 'FAIL'}: warned, step not committed, "
                           "training went on, final bitwise equal", eio["steps_lost"])
  if "shard" in want:
    noskip, skip = shard_damage(r, rng)
    trunc = shard_truncated(r)
    res.update(shard_flip_noskip=noskip, shard_flip_skip=skip, shard_truncated=trunc)
    rows["shard_flip"] = ("shard: bytes flipped", 1,
                          f"{'ok' if noskip['ok'] else 'FAIL'}: one-line error naming file and "
                          "record range", noskip["steps_lost"])
    rows["shard_skip"] = ("shard: bytes flipped + skip_invalid + kill", 1,
                          f"{'ok' if skip['ok'] else 'FAIL'}: {skip['skipped']} skipped and "
                          "counted; resume bitwise equal", skip["steps_lost"])
    rows["shard_cut"] = ("shard: truncated", 1, f"{'ok' if trunc['ok'] else 'FAIL'}: refused "
                         "at start-up, file named", trunc["steps_lost"])
  if "nan" in want:
    nan = res["nan_batch"] = nan_batch(r, rng)
    rows["nan"] = ("NaN features in one batch", 1, f"{'ok' if nan['ok'] else 'FAIL'}: update "
                   f"skipped and counted ({nan['skipped_updates']})", nan["steps_lost"])
  if "concurrency" in want:
    two = res["two_writers"] = concurrency(r, base_wd)
    rows["concurrency"] = ("two train.py on one workdir", 1,
                           f"{'ok' if two['ok'] else 'FAIL'}: the second refused in one line "
                           "naming the first (pid, host); the first undisturbed: bitwise equal, "
                           "each step logged once", two["steps_lost"])
  if "disk_full" in want:
    full = res["disk_full"] = disk_full(r, base_wd)
    rows["disk_full"] = ("disk full (workdir on a small filesystem)", full["filesystem"],
                         f"{'ok' if full['ok'] else 'FAIL'}: one-line error, no traceback, no "
                         f"partial checkpoint left, newest good step {full['committed'][-1:]} "
                         f"kept; resumed with space from {full['resumed_from']}, final bitwise "
                         "equal", full["steps_lost"])
  checks = [v["ok"] for k, v in res.items() if isinstance(v, dict) and "ok" in v]
  ok = all(checks) and res.get("kills_ok", True)
  previous = {}
  if a.cases != "all" and os.path.exists(a.out):      # merge into the last full table
    previous = json.load(open(a.out))
  replaced = {"checkpoint write fails (ENOSPC)"} if "write_error" in want else set()  # now: I/O
  kept = [t for t in previous.get("table", []) if t["fault"] not in replaced
          and not t["fault"].startswith("disk full (tmpfs")]           # an older row name
  table = {t["fault"]: t for t in kept}
  order = [t["fault"] for t in kept]
  for fault, n, outcome, lost in rows.values():
    if fault not in table:
      order.append(fault)
    table[fault] = {"fault": fault, "injected": n, "outcome": outcome, "steps_lost": lost}
  table = [table[f] for f in order]
  w = max(len(t["fault"]) for t in table)
  print(f"\n{'fault':<{w}}  {'injected':>14}  {'steps lost':>10}  outcome")
  for t in table:
    print(f"{t['fault']:<{w}}  {t['injected']!s:>14}  {t['steps_lost']:>10}  {t['outcome']}")
  print(f"\n{'ALL OK' if ok else 'SOME CHECKS FAILED'} (this run: {', '.join(sorted(want))}; "
        f"{time.perf_counter() - t_start:.0f}s, load average {os.getloadavg()[0]:.1f})")
  result = dict(previous)
  if previous:
    stale = {"checkpoint_enospc"} if "write_error" in want else set()
    result = {k: v for k, v in previous.items() if k not in stale}
    result["merged"] = result.get("merged", []) + [{
        "cases": sorted(want), "date": time.strftime("%Y-%m-%d"), "load_avg": os.getloadavg(),
        "seconds": round(time.perf_counter() - t_start, 1), "runs": r.runs}]
  else:
    result.update(runs=r.runs, seconds=round(time.perf_counter() - t_start, 1))
  result.update(res)
  result.pop("kills_ok", None)
  ok = (all(v["ok"] for v in result.values() if isinstance(v, dict) and "ok" in v)
         and all(g["ok"] for g in result.get("kill_runs", []))
         and all(k["killed"] for k in result.get("kills", []))
         and all(result.get("stale_lock_takeovers", [])))        # every case, merged ones too
  result.update({
      "ok": ok, "device": "cpu", "machine": platform.machine(),
      "cpus": os.cpu_count(), "versions": versions(),
      "config": {"preset": "tiny (Kunlun)", "steps": a.steps, "batch_size": 64,
                 "checkpoint_every": a.checkpoint_every, "keep_checkpoints": 3,
                 "num_examples": a.num_examples, "seed": a.seed, "kills": a.kills,
                 "kills_per_run": a.kills_per_run},
      "table": table})
  if not previous:
    result["load_avg"] = os.getloadavg()
  atomic.write_json(a.out, result)
  print("wrote", a.out)
  if not a.workdir:
    shutil.rmtree(base, ignore_errors=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
