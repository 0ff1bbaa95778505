"""The settings table (kunlun/train/settings.py): every preset passes and every field of every
preset is described; each bad value is one SettingsError naming the field, the value and what is
allowed; a run_info.json with a bad config fails in one line when loaded (issue 20)."""

import importlib
import json

import grain
import jax
import pytest

from kunlun.configs import tiny
from kunlun.train import devices, run_info, settings, startup
from sharding import mesh as M

PRESETS = ("tiny", "demo", "dev", "mid", "large", "vm_tiny", "vm_dev")


def _walk(x, path=""):
  """Leaf paths of a ConfigDict (an independent walk)."""
  if hasattr(x, "keys") and not isinstance(x, str):
    return [p for k in x.keys() for p in _walk(x[k], f"{path}.{k}" if path else k)]
  return [path]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_pass_and_every_field_is_described(name):
  c = importlib.import_module(f"kunlun.configs.{name}").get_config()
  settings.check(c)
  lines = settings.describe(c)
  paths = _walk(c)
  assert len(lines) == len(paths) and paths
  for p in paths:
    assert settings.doc(p), f"{name}: config.{p} has no description"
  got = {line.split(" = ", 1)[0].strip() for line in lines}
  assert got == set(paths)


def test_describe_shows_overridden_values():
  c = tiny.get_config()
  c.train.lr = 0.125
  c.seed = 7
  lines = {x.split(" = ")[0].strip(): x for x in settings.describe(c)}
  assert "0.125" in lines["train.lr"] and "learning rate" in lines["train.lr"]
  assert lines["seed"].split("=", 1)[1].split()[0] == "7"
  assert "[an integer >= 1]" in lines["train.keep_checkpoints"]
  assert list(lines)[0] == "seed"


def _set(c, path, value):
  head, _, name = path.rpartition(".")
  sec = c[head] if head else c
  with sec.unlocked(), sec.ignore_type():
    sec[name] = value


# (field, bad value, text the error must contain): the cases first
BAD = [
    ("train.keep_checkpoints", 0, "config.train.keep_checkpoints = 0: allowed an integer >= 1"),
    ("train.steps", -1, "config.train.steps = -1: allowed an integer in [0, 2147483647]"),
    ("train.checkpoint_every", 0, "config.train.checkpoint_every = 0: allowed an integer >= 1"),
    ("train.log_every", 0, "config.train.log_every = 0: allowed an integer >= 1"),
    ("data.batch_size", 0, "config.data.batch_size = 0: allowed an integer in [1, 1048576]"),
    ("data.batch_size", -64, "config.data.batch_size = -64: allowed an integer in [1, 1048576]"),
    ("data.batch_size", "64", "config.data.batch_size = '64': allowed an integer"),
    ("data.batch_size", 10**12, "config.data.batch_size = 1000000000000: allowed an integer in "
                                "[1, 1048576] (at most 1048576"),
    ("data.batch_size", True, "config.data.batch_size = True: allowed an integer"),
    ("train.max_bad_steps", -1, "config.train.max_bad_steps = -1: allowed an integer >= 0"),
    ("train.epochs", -1.0, "config.train.epochs = -1.0: allowed a number >= 0"),
    ("train.validate_every", -2, "config.train.validate_every = -2: allowed an integer >= -1"),
    ("train.lr", float("nan"), "config.train.lr = nan: allowed a number >= 0"),
    ("train.b2", 1.0, "config.train.b2 = 1.0: allowed a number in [0, 1)"),
    ("train.schedule", "linear", "config.train.schedule = 'linear': allowed one of ('cosine', "
                                 "'constant')"),
    ("train.remat", "all", "config.train.remat = 'all': allowed one of ('none'"),
    ("train.task_weights", (1.0, -1.0), "config.train.task_weights = (1.0, -1.0): allowed"),
    ("train.keep_best", "yes", "config.train.keep_best = 'yes': allowed True or False"),
    ("data.eval_batch_size", -8, "config.data.eval_batch_size = -8: allowed an integer in [0,"),
    ("data.num_threads", 0, "config.data.num_threads = 0: allowed an integer in [1, 256]"),
    ("data.preset", "huge",
     "config.data.preset = 'huge': allowed one of ('tiny', 'dev', 'mid', 'prod')"),
    ("data.surface_weights", {"feed": -1.0}, "config.data.surface_weights = {'feed': -1.0}"),
    ("sharding.rules", "zero3", "config.sharding.rules = 'zero3': allowed one of ('dp', 'fsdp'"),
    ("seed", 1.5, "config.seed = 1.5: allowed an integer"),
    # upper bounds (issue 39, 10): seeds, steps, and the model sizes that become allocations
    ("seed", 2**70, "config.seed = 1180591620717411303424: allowed an integer in [0, "
                    "4294967295]"),
    ("seed", -1, "config.seed = -1: allowed an integer in [0, 4294967295]"),
    ("data.shuffle_seed", 2**32, "config.data.shuffle_seed = 4294967296: allowed an integer in "
                                 "[0, 4294967295]"),
    ("train.steps", 2**31, "config.train.steps = 2147483648: allowed an integer in [0, "
                           "2147483647]"),
    ("model.d_ns", 10**10, "config.model.d_ns = 10000000000: allowed an integer in [1, 65536]"),
    ("model.towers.click.width", 2**17, "config.model.towers.click.width = 131072: allowed an "
                                        "integer in [1, 65536]"),
    ("model.heads.top_mlp", (64, 10**9), "config.model.heads.top_mlp = (64, 1000000000): allowed "
                                         "a tuple of integers in [1, 65536]"),
    ("train.microbatches", 3, "config.train.microbatches = 3: allowed a divisor of "
                              "config.data.batch_size = 64"),
]


def _refused(c) -> str:
  """``settings.check(c)``'s error, asserted to be one line."""
  with pytest.raises(settings.SettingsError) as e:
    settings.check(c)
  msg = str(e.value)
  assert "\n" not in msg, msg
  return msg


@pytest.mark.parametrize("path,value,want", BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_setting_is_one_line_naming_field_value_and_range(path, value, want):
  c = tiny.get_config()
  _set(c, path, value)
  assert want in _refused(c)


def test_relations_and_flags():
  c = tiny.get_config()
  c.train.microbatches = 2
  c.train.sparse_embedding_update = True          # the sparse update accumulates microbatches
  settings.check(c)
  c = tiny.get_config()
  with c.unlocked():
    c.transfer = {"kd_lambda": -1.0}
  with pytest.raises(settings.SettingsError, match="config.transfer.kd_lambda = -1.0"):
    settings.check(c)
  settings.check_flag("steps", None, 0)
  settings.check_flag("steps", 0, 0)
  with pytest.raises(settings.SettingsError, match="--batch_size=0: allowed an integer >= 1"):
    settings.check_flag("batch_size", 0, 1)
  # a field left out takes the default, as the programs read it (older run_info.json files)
  c = tiny.get_config()
  with c.train.unlocked():
    del c.train["metrics_lag"]
  settings.check(c)


@pytest.mark.parametrize("config,want", [
    (None, "config is None"),
    ({}, "config is {}"),
    ({"data": {"batch_size": 64}, "train": {}}, "config.model: missing"),
    ("tiny", "config is 'tiny'"),
    ("batch_size='64'", "config.data.batch_size = '64': allowed an integer"),
    ("batch_size=10**12", "config.data.batch_size = 1000000000000: allowed an integer in [1, "
                          "1048576]"),
])
def test_loaded_run_info_gets_the_same_checks(tmp_path, config, want):
  """A run_info.json whose config is null, empty, without a model section, or with a bad
  value fails to load with one line naming the file (no AttributeError / TypeError traceback,
  no 7 TiB allocation later)."""
  c = tiny.get_config()
  run_info.save_run_info(str(tmp_path), c, str(tmp_path))
  path = tmp_path / "run_info.json"
  info = json.loads(path.read_text())
  if isinstance(config, str) and config.startswith("batch_size="):
    info["config"]["data"]["batch_size"] = eval(config.split("=", 1)[1])
  else:
    info["config"] = config
  path.write_text(json.dumps(info))
  with pytest.raises(startup.FatalError) as e:
    run_info.load_run_info(str(tmp_path))
  msg = str(e.value)
  assert msg.startswith(str(path)) and want in msg and "\n" not in msg, msg


@pytest.mark.parametrize("value,ok", [("", True), ("auto", True), ("click=128,impression=64", True),
                                      ("click=100", False), ("click", False), ("click=0", False),
                                      ("=64", False)])
def test_jagged_capacity_values(value, ok):
  c = tiny.get_config()
  c.data.jagged_capacity = value
  if ok:
    settings.check(c)
    return
  msg = _refused(c)
  assert msg.startswith("config.data.jagged_capacity = ") and "64" in msg


def test_seed_bound_is_what_grain_and_jax_take():
  """Hand-written boundary: 2**32 - 1 is the largest seed; grain refuses 2**32 and jax's key
  drops the high bits (key(2**32) is key(0): another seed, the same run)."""
  c = tiny.get_config()
  for path in ("seed", "data.shuffle_seed"):
    _set(c, path, 2**32 - 1)
    settings.check(c)
  grain.MapDataset.range(4).shuffle(seed=2**32 - 1)
  with pytest.raises(ValueError):
    grain.MapDataset.range(4).shuffle(seed=2**32)
  same = jax.random.key_data(jax.random.key(2**32)) == jax.random.key_data(jax.random.key(0))
  assert bool(same.all())
  for path in ("seed", "data.shuffle_seed", "data.synthetic_seed"):
    c = tiny.get_config()
    _set(c, path, 2**32)
    with pytest.raises(settings.SettingsError, match=f"config.{path} = 4294967296"):
      settings.check(c)


@pytest.mark.parametrize("fields,ok,want", [
    ({"data.jagged_capacity": "auto", "model.arch": "dlrm"}, False,
     "config.data.jagged_capacity = 'auto': packed towers run only with config.model.arch in "
     "('kunlun', 'kunlun_ablated'), got 'dlrm'"),
    ({"data.jagged_capacity": "click=256", "model.arch": "interformer"}, False,
     "got 'interformer'"),
    ({"data.jagged_capacity": "auto", "model.arch": "kunlun_ablated"}, True, ""),
    ({"data.jagged_capacity": "", "model.arch": "dlrm"}, True, ""),
])
def test_packed_towers_need_an_architecture_that_has_them(fields, ok, want):
  """Packed towers with an architecture that has none (before: a broadcasting error, or a
  traceback after the length sample) are refused by the settings check, before any work."""
  c = tiny.get_config()
  for path, value in fields.items():
    _set(c, path, value)
  if ok:
    settings.check(c)
    return
  assert want in _refused(c)


def test_jagged_capacity_refuses_a_stream_given_twice():
  c = tiny.get_config()
  c.data.jagged_capacity = "click=64,impression=64,click=1024"
  assert "'click' given twice" in _refused(c)


def test_steps_flag_upper_bound():
  startup.check_settings(tiny.get_config(), steps_flag=2**31 - 1)
  with pytest.raises(startup.FatalError, match=r"--steps=2147483648: allowed an integer in "
                                               r"\[0, 2147483647\]"):
    startup.check_settings(tiny.get_config(), steps_flag=2**31)


def test_batch_size_flags_upper_bound():
  """eval.py's and the FM export's ``--batch_size`` (``devices.check_batch_size``) are bounded
  as ``data.batch_size`` is (before: 2**40 passed, and the padded batch was an allocation)."""
  mesh = M.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
  rules = devices.get_rules("fsdp")
  devices.check_batch_size(2**20, mesh, rules, "--batch_size")
  with pytest.raises(startup.FatalError) as e:
    devices.check_batch_size(2**40, mesh, rules, "--batch_size")
  msg = str(e.value)
  assert "--batch_size=1099511627776: allowed at most 1048576" in msg and "\n" not in msg, msg
