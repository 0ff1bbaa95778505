"""bench/experiments/scaling.py: the fits recover known laws, the summary's ratios, and --quick end
to end; bench/experiments/ladder.py: the examples rule, bootstrap fits and compute multiples against
known answers, held-out LR choice, the Bayes gap, and a --quick ladder with --resume."""

import contextlib
import itertools
import json
import math
import os
import sys

import jax
import numpy as np
import pytest

from tests import subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from bench.experiments import ladder as L  # noqa: E402
from bench.experiments import scaling as S  # noqa: E402

LADDER = os.path.join(ROOT, "bench", "experiments", "ladder.py")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

C = np.geomspace(1e5, 1e7, 5)


def test_fits_recover_known_laws():
  ne = 0.55 + 3.0 * C ** -0.25
  p = S.fit_power(C, ne)
  assert p["r2"] > 0.9999 and abs(p["alpha"] - 0.25) < 1e-3 and abs(p["ne_inf"] - 0.55) < 1e-3
  np.testing.assert_allclose(S.power_ne(p, C), ne, rtol=1e-5)
  ll = S.fit_loglinear(C, 1.0 + 2.5 * np.log10(C))
  assert abs(ll["eta"] - 2.5) < 1e-9 and abs(ll["a"] - 1.0) < 1e-9 and ll["r2"] == pytest.approx(1)
  assert S.fit_power(C[:3], ne[:3]) is None and S.fit_loglinear(C[:2], ne[:2]) is None
  # the FLOPs at which a fit reaches a target NE invert it
  need = S.flops_to_reach(float(ne[2]), p, None, 1.0)
  assert need["power"] == pytest.approx(C[2], rel=1e-3)
  assert S.flops_to_reach(0.5, p, None, 1.0)["power"] == float("inf")     # below NE_inf
  need = S.flops_to_reach(0.9, None, {"a": 1.0, "eta": 2.5}, 1.0)         # dNE% = 10
  assert need["loglinear"] == pytest.approx(10 ** ((10 - 1.0) / 2.5))


def test_summary_scaling_efficiency_ratio_per_seed():
  """Kunlun's NE falls twice as fast per decade as InterFormer's (seed 0) and 3x (seed 1)."""
  runs = []
  for seed, k_slope in ((0, 2.0), (1, 3.0)):
    for arch, slope, off in (("kunlun", k_slope, 0.0), ("interformer", 1.0, 0.01),
                             ("dlrm", 0.5, 0.05)):
      for k, c in enumerate(C):
        ne = 0.9 - 0.01 * slope * (np.log10(c) - 5) + off
        for lr, worse in ((1e-3, 0.0), (3e-3, 0.05)):      # the better LR is the one fitted
          runs.append({"kind": "ladder", "arch": arch, "size": k, "seed": seed, "lr": lr,
                       "train_flops_per_example": c,
                       "ne": {"click": ne + worse, "conversion": ne + worse}})
  s = S.summarize(runs, [0, 1], 5)
  assert {v["lr"] for v in s["lr_choice"].values()} == {1e-3}
  r = s["scaling_efficiency_ratio"]["click"]["eta"]
  np.testing.assert_allclose(r["per_seed"], [2.0, 3.0], rtol=1e-9)
  assert r["mean"] == pytest.approx(2.5) and r["std"] == pytest.approx(np.std([2, 3], ddof=1))
  m = s["interformer_flops_to_match_kunlun_best"]["click"]
  assert m["kunlun_flops"] == pytest.approx(1e7)
  # Kunlun's best (seed mean) is 0.85 at 1e7; InterFormer's line (0.91 at 1e5, -0.01 per
  # decade) reaches it at 1e11
  ne_i = lambda c: 0.91 - 0.01 * (np.log10(c) - 5)
  want = 10 ** (5 + (ne_i(1e5) - m["kunlun_best_ne"]) / 0.01)
  assert m["interformer_flops"]["loglinear"] == pytest.approx(want, rel=1e-6)


def test_scaling_quick(tmp_path):
  out = tmp_path / "scaling.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  subproc.run([sys.executable, os.path.join(ROOT, "bench", "experiments", "scaling.py"), "--quick",
               "--workdir", str(tmp_path / "work"), "--out", str(out)],
              check=True, env=env, cwd=ROOT)
  r = json.loads(out.read_text())
  assert (tmp_path / "scaling.png").stat().st_size > 1000
  assert {x["arch"] for x in r["runs"]} == set(S.ARCHS)
  for x in r["runs"]:
    for t in S.TASKS:
      assert math.isfinite(x["ne"][t]) and x["ne"][t] > 0
      assert 0 < x["bayes_ne"][t] < 1
    # padding: the model count at actual lengths is below the padded and the executed counts
    assert 0 < x["train_flops_per_example"] < x["train_flops_per_example_padded"]
    assert x["train_flops_per_example_padded"] < 1.2 * x["executed_flops_per_example"]
    assert x["examples"] == 512 and x["steps"] == 8
  flops = {x["arch"]: x["train_flops_per_example"] for x in r["runs"]}
  assert flops["dlrm"] < flops["kunlun"] < flops["interformer"]
  assert r["environment"]["jax"] and r["setup"]["preset"] == "tiny"


# ---- bench/experiments/ladder.py -----------------------------------------------------------------
def test_ladder_examples_rule():
  flops = [1.0, 4.0, 16.0, 100.0]          # sqrt: 1, 2, 4, 10 -> 1000, 2000, 4000, 10000 (cap 5000)
  want = [(int(x) // 64) * 64 for x in (1000, 2000, 4000, 5000)]
  assert L.examples_rule(flops, 1000, 5000, 64) == want
  assert L.examples_rule([1.0, 1.0], 10, 100, 64) == [64, 64]          # at least one batch


def _law(C, m):
  """A power law whose curve is Kunlun's shifted by a compute factor m: NE(C) = NE_K(C / m)."""
  return 0.5 + 50.0 * (np.asarray(C) / m) ** -0.3


def _points(m, noise, rng, sizes=5, seeds=3):
  C = np.geomspace(1e6, 1e9, sizes)
  return {k: [(C[k], float(_law(C[k], m)) + (noise * rng.standard_normal() if noise else 0.0))
              for _ in range(seeds)] for k in range(sizes)}


def test_ladder_fit_recovers_known_compute_multiple():
  """Noise-free seeds: InterFormer's law is Kunlun's at 2.5x the compute, DLRM's at 8x; the fits,
  the multiples and their (collapsed) bootstrap intervals recover them."""
  pts = {"kunlun": _points(1.0, 0, None), "interformer": _points(2.5, 0, None),
         "dlrm": _points(8.0, 0, None)}
  out = L.fit_ladder(pts, bootstrap=20)
  for arch in L.S.ARCHS:
    f = out["fits"][arch]
    assert f["power"]["ne_inf"] == pytest.approx(0.5, abs=1e-3)
    assert f["power"]["alpha"] == pytest.approx(0.3, rel=1e-3)
    assert f["ne_inf_ci"]["lo"] == pytest.approx(0.5, abs=1e-3)
    assert f["ne_inf_ci"]["hi"] == pytest.approx(0.5, abs=1e-3)
  for arch, m in (("interformer", 2.5), ("dlrm", 8.0)):
    rows = out["compute_multiple_to_match_kunlun"][arch]
    assert [r["kunlun_size"] for r in rows] == list(range(5))
    for r in rows:
      assert r["multiple"] == pytest.approx(m, rel=1e-2)
      assert r["lo"] == pytest.approx(m, rel=1e-2) and r["hi"] == pytest.approx(m, rel=1e-2)
      assert r["unreachable_fraction"] == 0.0


def test_ladder_bootstrap_intervals_against_exact_resampling():
  """With 3 seeds per size the seed-mean's bootstrap distribution has 27 equally likely draws;
  its exact 2.5% / 97.5% quantiles (enumerated with numpy) are the interval's ends (3 sizes: no
  power fit, so many draws are cheap)."""
  rng = np.random.default_rng(1)
  pts = {"kunlun": _points(1.0, 0.004, rng, sizes=3)}
  out = L.fit_ladder(pts, bootstrap=2000)
  assert out["fits"]["kunlun"]["power"] is None
  for k, ci in enumerate(out["fits"]["kunlun"]["ne_ci"]):
    y = np.array([v for _, v in pts["kunlun"][k]])
    means = np.sort([y[list(ix)].mean() for ix in itertools.product(range(3), repeat=3)])
    cdf = np.arange(1, 28) / 27
    assert ci["lo"] == pytest.approx(means[np.argmax(cdf >= 0.025)], abs=1e-12)
    assert ci["hi"] == pytest.approx(means[np.argmax(cdf >= 0.975)], abs=1e-12)
    assert out["fits"]["kunlun"]["ne"][k] == pytest.approx(y.mean())


def test_ladder_compute_multiple_with_noisy_seeds():
  """Noisy seeds: the multiple is the other fit inverted at Kunlun's seed-mean NE (closed form
  here), near the true 2.5x, inside its bootstrap interval."""
  rng = np.random.default_rng(1)
  pts = {"kunlun": _points(1.0, 0.002, rng), "interformer": _points(2.5, 0.002, rng)}
  out = L.fit_ladder(pts, bootstrap=60)
  p = out["fits"]["interformer"]["power"]
  for r in out["compute_multiple_to_match_kunlun"]["interformer"]:
    need = (p["A"] / (r["kunlun_ne"] - p["ne_inf"])) ** (1 / p["alpha"])
    assert r["multiple"] == pytest.approx(need / r["kunlun_compute"], rel=1e-9)
    assert r["multiple"] == pytest.approx(2.5, rel=0.3)
    assert r["lo"] <= r["median"] <= r["hi"]


def _trial(arch, size, seed, lr, holdout_click, eval_click, role="lr_trial"):
  return {"arch": arch, "size": size, "seed": seed, "lr": lr, "role": role, "examples": 100,
          "train_flops_per_example": 1.0, "holdout": {"ne": {"click": holdout_click}},
          "ne": {"click": eval_click, "conversion": eval_click}}


def test_ladder_lr_chosen_on_holdout_not_eval():
  plan = {"lrs": [5e-3, 2e-3], "seeds": [0, 1], "examples": [100]}
  # held-out prefers 2e-3, eval would prefer 5e-3
  runs = [_trial("kunlun", 0, 0, 5e-3, 0.70, 0.60), _trial("kunlun", 0, 0, 2e-3, 0.65, 0.62)]
  assert L.choose_lr(runs[:1], "kunlun", 0, plan) is None            # a trial still missing
  c = L.choose_lr(runs, "kunlun", 0, plan)
  assert c["lr"] == 2e-3 and c["holdout_click_ne_by_lr"] == {"0.005": 0.70, "0.002": 0.65}
  runs += [_trial("kunlun", 0, 1, 2e-3, 0.66, 0.63, "seed")]
  assert sorted((r["seed"], r["lr"]) for r in L.ladder_runs(runs, plan)) == [(0, 2e-3), (1, 2e-3)]


def test_ladder_bayes_gap_of_largest_kunlun():
  def run(size, seed, ne, bayes):
    return {"arch": "kunlun", "size": size, "seed": seed,
            "ne": {"click": ne, "conversion": ne}, "bayes_ne": {"click": bayes, "conversion": bayes},
            "ne_per_surface": {"feed": {"click": ne, "conversion": None}},
            "bayes_ne_per_surface": {"feed": {"click": bayes, "conversion": None}}}
  g = L.bayes_gap([run(0, 0, 0.9, 0.5), run(1, 0, 0.60, 0.5), run(1, 1, 0.64, 0.5)])
  assert g["size"] == 1 and g["seeds"] == [0, 1]
  assert g["per_surface"]["feed"]["click"]["ne"] == pytest.approx(0.62)
  assert g["per_surface"]["feed"]["click"]["ratio"] == pytest.approx(0.62 / 0.5)
  assert g["per_surface"]["feed"]["conversion"] is None                 # no labels there
  assert g["overall"]["click"]["gap"] == pytest.approx(0.12)


def test_ladder_summary_report_and_plot(tmp_path):
  """Finished runs on known laws (InterFormer needs 2x Kunlun's compute, DLRM 6x; LR 5e-3 worse on
  held-out and eval alike): the summary keeps the chosen LR's runs, recovers the multiples, puts
  the Kunlun fit's asymptote beside the Bayes NE, and the report and plot come out."""
  rng = np.random.default_rng(0)
  plan = {"lrs": [5e-3, 2e-3], "seeds": [0, 1, 2], "examples": [1000, 2000, 4000, 8000, 16000]}
  fin = []
  for arch, f0, m in (("kunlun", 1.0, 1.0), ("interformer", 3.0, 2.0), ("dlrm", 0.5, 6.0)):
    for k, n in enumerate(plan["examples"]):
      f = 1e3 * 4 ** k * f0
      for lr, seed in ((5e-3, 0), (2e-3, 0), (2e-3, 1), (2e-3, 2)):
        ne = float(_law(n * f, m)) + rng.normal(0, 0.002) + (0.05 if lr == 5e-3 else 0.0)
        fin.append({"arch": arch, "size": k, "seed": seed, "lr": lr, "examples": n,
                    "role": "lr_trial" if seed == 0 else "seed", "train_flops_per_example": f,
                    "ne": {"click": ne, "conversion": ne}, "holdout": {"ne": {"click": ne}},
                    "bayes_ne": {"click": 0.45, "conversion": 0.45},
                    "ne_per_surface": {"feed": {"click": ne, "conversion": ne}},
                    "bayes_ne_per_surface": {"feed": {"click": 0.45, "conversion": 0.45}}})
  s = L.summarize(fin, plan, 30)
  assert {c["lr"] for c in s["lr_choice"].values()} == {2e-3} and len(s["runs_used"]) == 45
  for arch, m in (("interformer", 2.0), ("dlrm", 6.0)):
    for r in s["tasks"]["click"]["compute_multiple_to_match_kunlun"][arch]:
      assert r["multiple"] == pytest.approx(m, rel=0.25)
  fit = s["bayes_gap"]["overall"]["click"]["kunlun_fit_ne_inf"]
  assert fit["ne_inf"] == pytest.approx(0.5, abs=0.02)
  assert fit["ratio_to_bayes"] == pytest.approx(fit["ne_inf"] / 0.45)
  assert "compute to match Kunlun" in L.report(s)
  L.plot(fin, plan, s, str(tmp_path / "p.png"), "t")
  assert (tmp_path / "p.png").stat().st_size > 1000


def _cli_error(capfd, argv) -> str:
  """``ladder.main(argv)`` in this interpreter, expected to exit with an error: what the command
  line would print on stderr (anything written to it, then the SystemExit message)."""
  capfd.readouterr()
  with _process_state_kept(), pytest.raises(SystemExit) as e:
    L.main(argv)
  assert isinstance(e.value.code, str), e.value.code          # a message: exit status 1
  return capfd.readouterr().err + e.value.code + "\n"


def test_ladder_dry_run_plan(tmp_path, capfd):
  """The full plan: 5 sizes over >= 30x Kunlun FLOPs per example, 3 seeds, a budget in hours;
  nothing is written. An out_dir that cannot be created is a one-line error. (Both in this
  interpreter: ``test_ladder_quick_resume`` starts the script as a command.)"""
  L.main(["--dry_run", "--out_dir", str(tmp_path / "o")])
  stdout = capfd.readouterr().out
  assert not (tmp_path / "o").exists()
  assert "seeds [0, 1, 2]" in stdout
  span = float(stdout.split("FLOPs per example span ")[1].split("x")[0])
  hours = float(stdout.split("estimated total ")[1].split(" h")[0])
  assert span >= 30 and 0 < hours < 24
  rows = [line.split() for line in stdout.splitlines() if line[:4].strip().isdigit()]
  assert [int(x[0]) for x in rows] == list(range(5))
  ex = [int(x[2]) for x in rows]
  assert ex == sorted(ex) and ex[-1] >= 5 * ex[0]
  (tmp_path / "f").write_text("")
  stderr = _cli_error(capfd, ["--quick", "--out_dir", str(tmp_path / "f" / "o")])
  assert stderr.strip().count("\n") == 0 and "cannot create" in stderr
  stderr = _cli_error(capfd, ["--dry_run", "--sizes", "4", "7", "--out_dir", str(tmp_path / "o")])
  assert stderr.strip().count("\n") == 0 and "has sizes 0..4" in stderr


def test_ladder_quick_resume(tmp_path, capfd):
  """--quick (2 sizes, 2 seeds, a few hundred examples; DLRM only, the cheapest to compile):
  one JSON per run, the LR of seed 1 chosen on the held-out split, a second invocation with
  --resume trains nothing (a killed writer's temporary file is no finished run), and without
  --resume a used out_dir is refused in one line. The first invocation is the command; the
  other two run in this interpreter (nothing to compile: an interpreter's start-up saved each)."""
  out, work = tmp_path / "out", tmp_path / "work"
  argv = ["--quick", "--archs", "dlrm", "--bootstrap", "20", "--out_dir", str(out),
          "--workdir", str(work)]
  r = subproc.run([sys.executable, LADDER, *argv], check=True, env=ENV, cwd=ROOT)
  assert "estimated total" in r.stdout and r.stdout.count("] run ") == 6
  plan = json.loads((out / "plan.json").read_text())
  f = np.asarray(plan["kunlun_flops"])
  assert plan["examples"] == [(int(x) // 64) * 64 for x in np.minimum(256 * np.sqrt(f / f[0]), 512)]
  files = sorted(p.name for p in (out / "runs").glob("*.json"))
  runs = {p.name: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}
  assert len(files) == 6                            # 2 sizes x (2 LR trials + 1 seed)
  for k in range(2):
    trials = {r["lr"]: r for r in runs.values() if r["size"] == k and r["role"] == "lr_trial"}
    assert set(trials) == {5e-3, 2e-3} and all(r["seed"] == 0 for r in trials.values())
    best = min(trials, key=lambda lr: trials[lr]["holdout"]["ne"]["click"])
    (seed1,) = [r for r in runs.values() if r["size"] == k and r["role"] == "seed"]
    assert seed1["seed"] == 1 and seed1["lr"] == best
    for r in [*trials.values(), seed1]:
      assert r["examples"] == plan["examples"][k] and r["steps"] == plan["examples"][k] // 64
      assert r["holdout"]["split"] == "pretrain" and r["holdout"]["examples"] > 0
      assert math.isfinite(r["ne"]["click"]) and math.isfinite(r["holdout"]["ne"]["click"])
      assert r["holdout"]["ne"]["click"] != r["ne"]["click"]          # another split
  s = json.loads((out / "summary.json").read_text())
  assert s["runs_finished"] == 6 and s["runs_planned"] == 18
  assert s["summary"]["lr_choice"]["dlrm/0"]["lr"] == runs[f"dlrm_0_1_lr{runs_lr(runs, 0)}.json"]["lr"]
  assert (out / "ladder.png").stat().st_size > 1000
  mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
  # a run killed while writing leaves at most its hidden temporary file: not a finished run
  (out / "runs" / f".{files[0]}.tmp-999").write_text('{"arch": "dl')
  capfd.readouterr()
  with _process_state_kept():
    L.main(argv + ["--resume"])
  stdout = capfd.readouterr().out
  assert "] run " not in stdout and "generating" not in stdout          # nothing trained
  assert {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")} == mtimes
  stderr = _cli_error(capfd, argv)
  assert "pass --resume" in stderr and stderr.strip().count("\n") == 0


@contextlib.contextmanager
def _process_state_kept():
  """A ladder run in this interpreter points JAX's persistent compilation cache at its workdir:
  put back afterwards (the next tests on this worker keep the suite's cache)."""
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  saved = {k: getattr(jax.config, k) for k in keys}
  try:
    yield
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)


def runs_lr(runs, size):
  (r,) = [r for r in runs.values() if r["size"] == size and r["role"] == "seed"]
  return f"{r['lr']:g}"
