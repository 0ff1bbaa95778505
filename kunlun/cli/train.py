"""Trains a Kunlun model; resumes automatically from the latest checkpoint in --workdir.

  kunlun-train --config=kunlun/configs/tiny.py --workdir=/tmp/kunlun_tiny
  python train.py --config=kunlun/configs/dev.py --config.train.lr=1e-3 \
      --workdir=runs/dev --mesh=data=1,fsdp=-1 --data_dir=/data/dev --profile_steps=20:25

  python train.py --show_config [--config=...] [--config.a.b=value]   # every field, described

``kunlun-train`` and ``python train.py`` (from a checkout) are the same program. SIGTERM / SIGINT
finish the current step, save a checkpoint and exit 0; during set-up (data, model
initialisation and its compilation) Ctrl-C stops at once with one line (status 130). Settings
are checked before any data is read (kunlun/train/settings.py); the workdir is locked against a
second train.py (kunlun/utils/lock.py); a full disk stops the run with the newest good
checkpoint kept.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from kunlun.train import settings, startup
from kunlun.utils import flags as program_flags
from kunlun.utils.outputs import TRAIN_WORKDIR

FLAGS = flags.FLAGS
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "tiny.py")


def main() -> None:
  """``kunlun-train`` / ``python train.py``: defines the flags, parses them and trains (one-line
  errors, ``startup.run_main``)."""
  define_flags()
  program_flags.run(_run, __name__)


def _run(argv) -> None:
  startup.run_main(program_flags.prog(), train, argv)


def define_flags() -> None:
  """The program's flags, defined when it starts (importing this module defines none: eval's
  flags bear the same names)."""
  program_flags.define_config(program_flags.prog(), DEFAULT_CONFIG,
                              "Config file; override fields with --config.a.b=value.")
  flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, tb/ and (generated) data/ "
                      "(required; one train.py at a time: train.lock).")
  flags.DEFINE_bool("show_config", False, "Print every config field (overrides applied) with its "
                    "value and a one-line description, then exit.")
  flags.DEFINE_string("mesh", "data=1,fsdp=-1,tensor=1,context=1,expert=1",
                      "Mesh axis sizes within a host (one -1 absorbs the remaining devices).")
  flags.DEFINE_string("dcn_mesh", None, "Mesh axis sizes across hosts / slices (e.g. data=2).")
  flags.DEFINE_integer("steps", None, "Total training steps (overrides config.train.steps).")
  flags.DEFINE_string("data_dir", None, "Dataset directory; absent: generate config.data.preset "
                      "into <workdir>/data once and reuse it.")
  flags.DEFINE_string("profile_steps", None,
                      "START:END: capture a jax.profiler trace of these steps.")
  flags.DEFINE_string("profile_dir", None, "Trace output directory (default <workdir>/profile).")
  program_flags.define(train=True)


def parse_profile_steps(spec: str | None):
  if not spec:
    return None
  try:
    a, b = (int(x) for x in spec.split(":"))
  except ValueError:
    startup.fail(f"--profile_steps={spec}: expected START:END (integers)")
  if not 0 <= a < b:
    startup.fail(f"--profile_steps={spec}: need 0 <= START < END")
  return a, b


def show_config(config) -> None:
  """``--show_config``: every field of the config (overrides applied), its value and what it is."""
  try:
    settings.check(config)
    status = "all settings within their allowed ranges"
  except settings.SettingsError as e:
    status = f"NOT VALID: {e}"
  print(f"# config {_config_file()}, overrides applied: {status}")
  print("\n".join(settings.describe(config)))


def _config_file() -> str:
  given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
  return given[-1] if given else "kunlun/configs/tiny.py (default)"


def train(argv):
  del argv
  config = FLAGS.config
  if FLAGS.show_config:              # before the runtime: the table and the presets load no jax
    show_config(config)
    return
  if not FLAGS.workdir:
    startup.fail("--workdir is required (checkpoints, metrics and generated data go there)")
  startup.check_settings(config, steps_flag=FLAGS.steps)   # before any data, jax or compile
  # jax loads from here on: --help, --show_config and bad flags answered without it
  from kunlun.train.devices import maybe_initialize_distributed
  from kunlun.train.workdir import check_outputs, prepare_workdir
  if FLAGS.steps is not None:
    config.train.steps = FLAGS.steps
  profile = parse_profile_steps(FLAGS.profile_steps)
  workdir = os.path.abspath(FLAGS.workdir)
  maybe_initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  given = {"data": FLAGS.data_dir, "profile": FLAGS.profile_dir}   # written elsewhere if given
  check_outputs(                                # docs/outputs.md
      dirs=[("--workdir", workdir, [n for n in TRAIN_WORKDIR if not given.get(n)]),
            ("--profile_dir", FLAGS.profile_dir, ("plugins",))],
      inputs=[("--data_dir", FLAGS.data_dir),
              ("--config", program_flags.config_file())])
  lock = prepare_workdir(workdir)               # one writer: a second train.py stops here
  try:
    from kunlun.train import loop
    run = loop.setup(config, workdir, mesh=FLAGS.mesh, dcn_mesh=FLAGS.dcn_mesh,
                     data_dir=FLAGS.data_dir, steps_flag=FLAGS.steps,
                     strict_restore=FLAGS.strict_restore, compilation_cache=FLAGS.compilation_cache,
                     allow_config_change=FLAGS.allow_config_change)
    loop.train(run, profile, FLAGS.profile_dir)
  finally:
    lock.release()
