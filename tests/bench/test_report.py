"""bench/report/: the committed results pages match the committed JSON, and go stale (one
line) when a results JSON changes without them."""

import json
import os
import shutil

import pytest

from bench import report

RESULTS = report.RESULTS


def _page(name: str) -> list[str]:
  with open(os.path.join(report.OUT, name)) as f:
    return f.read().splitlines()


def _json(rel: str) -> dict:
  with open(os.path.join(RESULTS, rel)) as f:
    return json.load(f)


def test_check_passes_on_the_committed_tree(capsys):
  assert report.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("rel, page, change", [
    ("train_step_gpu_packed_h200.json", "gpu_measured_h200.md",
     lambda d: d["summary"]["prod_auto_b1024_packed"].update(step_ms=d["summary"][
         "prod_auto_b1024_packed"]["step_ms"] + 0.1)),
    ("jagged_buckets_mid_auto_b256_h200.json", "speed_h200.md",
     lambda d: d["buckets"].update(useful_mfu_bound=0.5)),
])
def test_check_fails_in_one_line_after_a_json_change(tmp_path, capsys, rel, page, change):
  res, out = tmp_path / "results", tmp_path / "pages"
  shutil.copytree(RESULTS, res)
  assert report.main(["--results", str(res), "--out", str(out)]) == 0
  assert report.main(["--check", "--results", str(res), "--out", str(out)]) == 0
  capsys.readouterr()
  d = json.loads((res / rel).read_text())
  change(d)
  (res / rel).write_text(json.dumps(d, indent=1))
  # against the pages written from the copy, and against the committed pages
  for args, shown in ((["--out", str(out)], str(out / page)),
                      ([], f"docs/results/{page}")):
    assert report.main(["--check", "--results", str(res), *args]) == 1
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"bench.report: {shown} is stale: run python -m bench.report")


def test_gpu_row_is_the_json_formatted():
  d = _json("train_step_gpu_packed_h200.json")
  s, r = d["summary"]["prod_auto_b1024_packed"], d["runs"]["prod_auto_b1024_packed"]
  row = (f"| prod_auto_b1024_packed | prod auto b1024 | packed | {r['remat']} | "
         f"{r['steps']} ({r['warmup']}) | {s['step_ms']:.1f} | {s['pipelined_ms']:.1f} | "
         f"{s['bound_ms']:.1f} | {s['step_over_bound']:.2f}x | {s['mfu_actual_lengths']:.1%} | "
         f"{s['useful_mfu_bound']:.1%} | {s['live_peak_GiB']:.2f} |")
  assert row in _page("gpu_measured_h200.md")


def test_bucket_rows_are_the_json_formatted():
  d = _json("jagged_buckets_mid_auto_b256_h200.json")
  b, k = d["buckets"], len(d["programs"])
  row = (f"| mid auto b256 | {k} buckets | {d['batches']} | {b['useful_share']:.2f} | "
         f"{b['bytes_per_real_event'] / 1e6:.3f} | {b['bound_ms_mean']:.2f} | "
         f"{b['useful_mfu_bound']:.1%} | {d['launches_per_batch']:.0f} |")
  t = d["targets_fused"]["useful_mfu_bound"]
  target = (f"| mid auto b256 | useful_mfu_bound | >= {t['target']:.1%} | {t['value']:.1%} | "
            f"{'met' if t['met'] else '**missed**'} | - |")
  g = d["targets_fused"]["floor_ratio/attention"]          # with its least ratio, where known
  least = f"{g['least']:.2f}x" if "least" in g else "-"
  group = (f"| mid auto b256 | floor_ratio/attention | <= {g['target']:.2f}x | "
           f"{g['value']:.2f}x | {'met' if g['met'] else '**missed**'} | {least} |")
  lines = _page("speed_h200.md")
  assert row in lines
  assert target in lines
  assert group in lines


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.mkdir()],
                         ids=["missing", "no-json"])
def test_a_results_folder_without_json_is_a_one_line_error_that_writes_nothing(
    tmp_path, capsys, make):
  """A mistyped --results must not regenerate (empty) pages over the committed ones, nor
  remove them as no longer generated."""
  res, out = tmp_path / "results", tmp_path / "pages"
  make(res)
  out.mkdir()
  (out / "speed_h200.md").write_text("kept\n")
  with pytest.raises(SystemExit) as e:
    report.main(["--results", str(res), "--out", str(out)])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and str(res) in err, err
  assert sorted(os.listdir(out)) == ["speed_h200.md"]
  assert (out / "speed_h200.md").read_text() == "kept\n"
