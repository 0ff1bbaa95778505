"""Start-up flags shared by train.py and eval.py (multi-host launch, compilation cache, workdir
trust, checkpoint fallback), a flag parser whose errors are one line, and ``run``: one program
started as a script (``python train.py``) or as a console command (``kunlun-train``)."""

from __future__ import annotations

import os
import sys

from absl import app, flags


def define(train: bool = False) -> None:
  """Defines ``--coordinator_address``, ``--num_processes``, ``--process_id``,
  ``--compilation_cache`` (env ``KUNLUN_COMPILATION_CACHE``) and ``--trust_workdir``; with
  ``train``, ``--strict_restore``."""
  flags.DEFINE_string("coordinator_address", None, "Multi-host: coordinator host:port.")
  flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
  flags.DEFINE_string("compilation_cache",
                      os.environ.get("KUNLUN_COMPILATION_CACHE", "~/.cache/kunlun-jax/xla"),
                      "Persistent XLA compilation cache directory ('' disables).")
  flags.DEFINE_bool("trust_workdir", False,
                    "Load a config.pkl written by an older version (pickle: it can run code "
                    "from the file; only for workdirs you trust).")
  if train:
    flags.DEFINE_bool("strict_restore", False,
                      "Stop if the latest checkpoint does not restore, instead of moving it "
                      "aside and resuming from the newest step that does.")
    flags.DEFINE_bool("allow_config_change", False,
                      "Resume even though the model config or the data's surfaces / tasks "
                      "differ from those recorded in the workdir's run_info.json.")


def define_config(prog: str, default: str | None, help_: str) -> None:
  """``--config`` (``ml_collections.config_flags``). With a default file, config_flags reads the
  ``--config.a.b`` overrides from ``sys.argv`` right here; an unknown field is then a one-line
  error instead of a traceback at import."""
  from ml_collections import config_flags
  try:
    config_flags.DEFINE_config_file("config", default, help_)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    bad = [a for a in sys.argv[1:] if a.startswith("--config.")]
    _exit(prog, f"{' '.join(bad)}: no such config field ({_one_line(e)})")


def config_file() -> str | None:
  """The ``--config`` file's path (its default when not given); None without one."""
  from ml_collections import config_flags
  f = flags.FLAGS
  return config_flags.get_config_filename(f["config"]) if f.config is not None else None


def _one_line(e: BaseException) -> str:
  lines = [x.strip() for x in str(e).splitlines() if x.strip()]
  return " ".join(lines) if len(lines) <= 2 else f"{lines[0]} ... {lines[-1]}"


def parser(prog: str):
  """A ``flags_parser`` for ``absl.app.run``: bad flags, an unloadable ``--config`` file and
  stray positional arguments exit with status 2 and one line ``<prog>: error: ...``."""
  def parse(argv):
    f = flags.FLAGS
    try:
      rest = f(argv)
      if "config" in f and f.config is not None:
        f.config.keys()                       # a config file that failed to load raises now
    except flags.Error as e:
      _exit(prog, _one_line(e))
    except Exception as e:  # a config file that is missing, or raises / has a syntax error
      cfg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
      last = [x.strip() for x in str(e).splitlines() if x.strip()]
      why = last[-1] if last else type(e).__name__
      _exit(prog, f"--config={cfg}: cannot load the config file ({type(e).__name__}: {why})"
            if cfg else f"{type(e).__name__}: {why}")
    if len(rest) > 1:
      _exit(prog, f"unexpected argument(s) {rest[1:]} (flags are --name=value)")
    return rest
  return parse


def _exit(prog: str, msg: str):
  print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
  sys.exit(2)


def prog() -> str:
  """The program's name as it was started (``train.py``, ``kunlun-train``): its error lines
  begin with it."""
  return os.path.basename(sys.argv[0])


def run(main, module: str) -> None:
  """``absl.app.run(main)`` with ``parser`` for a program whose flags ``module`` defined, whether
  a script (``python train.py``) or a console command (``kunlun-train``) started it: absl's
  ``--help`` prints ``__main__``'s docstring and the flags of ``sys.argv[0]``, so both become
  ``module``'s."""
  f = flags.FLAGS
  for flag in f.get_key_flags_for_module(module):
    f.register_key_flag_for_module(sys.argv[0], flag)
  sys.modules["__main__"].__doc__ = sys.modules[module].__doc__
  app.run(main, flags_parser=parser(prog()))
