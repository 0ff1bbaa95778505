"""data.ingest.public.movielens on hand-written fixtures in the published formats (ml-100k u.data,
RecBole .inter, ml-1m ratings.dat, ml-latest ratings.csv): labels, histories from strictly
earlier ratings only, history statistics and the time split, checked against a loop here."""

import numpy as np
import pytest

from data import verify
from data.ingest.public import movielens
from data.schema import Schema

T0 = 881250000
# user, movie, rating, time: same-second ratings (t0) and a user rating one movie twice
RATINGS = [(1, 10, 5, 0), (1, 11, 3, 0), (1, 12, 4, 10), (2, 10, 2, 5), (1, 13, 1, 20),
           (2, 11, 5, 30), (1, 10, 4, 40), (2, 12, 4, 40), (3, 13, 5, 50), (1, 14, 5, 60),
           (2, 14, 1, 70), (3, 10, 3, 80)]


def _write(tmp_path, fmt):
  rows = [(u, m, r, T0 + t) for u, m, r, t in RATINGS]
  if fmt == "u.data":
    text = "".join(f"{u}\t{m}\t{r}\t{t}\n" for u, m, r, t in rows)
    name = "u.data"
  elif fmt == "inter":
    text = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(
        f"{u}\t{m}\t{r}\t{t}\n" for u, m, r, t in rows)
    name = "ml-100k.inter"
  elif fmt == "ratings.dat":
    text = "".join(f"{u}::{m}::{r}::{t}\n" for u, m, r, t in rows)
    name = "ratings.dat"
  else:
    text = "userId,movieId,rating,timestamp\n" + "".join(
        f"{u},{m},{float(r)},{t}\n" for u, m, r, t in rows)
    name = "ratings.csv"
  p = tmp_path / name
  p.write_text(text)
  return str(p)


@pytest.mark.parametrize("fmt", ["u.data", "inter", "ratings.dat", "ratings.csv"])
def test_read_formats(tmp_path, fmt):
  r = movielens.read(_write(tmp_path, fmt))
  assert movielens.detect(_write(tmp_path, fmt)) == fmt
  want = np.array([(u, m, r_, T0 + t) for u, m, r_, t in RATINGS])
  np.testing.assert_array_equal(np.stack([r["user"], r["item"], r["rating"], r["ts"]], 1), want)


def test_half_stars_and_bad_lines(tmp_path):
  p = tmp_path / "ratings.csv"
  p.write_text("userId,movieId,rating,timestamp\n1,5,4.5,964982703\n1,6,3.5,964982704\n")
  t = movielens.table(movielens.read(str(p)))
  assert t.column("label.click").to_pylist() == [1, 0]
  assert t.column("rating_x2").to_pylist() == [9, 7]
  p.write_text("userId,movieId,rating,timestamp\n1,5,4.5\n")
  with pytest.raises(ValueError, match=r"ratings.csv: line 2: expected ratings.csv fields"):
    movielens.read(str(p))


def _expected(max_len):
  """Per rating: the liked / rated histories and the statistics, by an explicit loop."""
  rows = [(u, m, r, T0 + t) for u, m, r, t in RATINGS]
  out = {}
  for u, m, r, t in rows:
    earlier = sorted((k for k, x in enumerate(rows) if x[0] == u and x[3] < t),
                     key=lambda k: (rows[k][3], k))
    ev = lambda ks: [[rows[k][1], 2 * rows[k][2], 0, rows[k][3]] for k in ks[-max_len:]]
    liked = [k for k in earlier if rows[k][2] >= 4]
    ad_earlier = [k for k, x in enumerate(rows) if x[1] == m and x[3] < t]
    rate = lambda ks: (sum(rows[k][2] >= 4 for k in ks) + 1) / (len(ks) + 2)
    out[t, u, m] = {"liked": ev(liked), "rated": ev(earlier), "label": float(r >= 4),
                 "dense": [len(earlier), rate(earlier), len(ad_earlier), rate(ad_earlier)],
                 "item": m}
  return out


def test_convert_no_future_leakage(tmp_path):
  out = str(tmp_path / "ds")
  rep = movielens.convert(_write(tmp_path, "inter"), out, max_len=2, split="none")
  schema = Schema.load(out)
  assert schema.surfaces == ("movielens",) and schema.task_names == ("click",)
  assert schema.stream_names == ("liked", "rated")
  assert schema.stream("rated").action_vocab == 11 and schema.stream("rated").max_len == 2
  assert schema.dense == ("user_count", "user_click_rate", "ad_count", "ad_click_rate")
  assert [f.name for f in schema.sparse] == ["user_id", "ad_id"]
  want = _expected(2)
  got = [r for _, _, r in verify.read_split(out, "train")]
  assert len(got) == len(RATINGS) == rep["examples"]["train"]
  for r in got:
    w = want[int(r["request_ts"]), int(r["user_id"]), int(r["ad_id"])]
    assert r["events/liked"].tolist() == w["liked"]
    assert r["events/rated"].tolist() == w["rated"]
    assert r["labels"].tolist() == [w["label"]]
    np.testing.assert_allclose(r["dense"], w["dense"], rtol=1e-6)
    assert r["sparse/user_id"].tolist() == [int(r["user_id"])]
    assert r["sparse/ad_id"].tolist() == [w["item"]] == [int(r["ad_id"])]


def test_time_split_windows(tmp_path, capsys):
  out = str(tmp_path / "ds")
  assert movielens.main(["--input", _write(tmp_path, "u.data"), "--out", out,
                         "--split", "time:0.5,0.25,0.25"]) == 0
  got = {s: sorted(int(r["request_ts"]) for _, _, r in verify.read_split(out, s))
         for s in ("train", "valid", "eval")}
  ts = sorted(T0 + t for *_, t in RATINGS)
  assert got["train"] + got["valid"] + got["eval"] == ts
  assert got["train"][-1] < got["valid"][0] and got["valid"][-1] < got["eval"][0]
  assert movielens.main(["--input", str(tmp_path / "nope.data"), "--out", out]) == 2
  assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
      "data.ingest.public.movielens: error: ")


def _last_error(capsys):
  err = capsys.readouterr().err
  assert "Traceback" not in err
  return err.strip().splitlines()[-1]


@pytest.mark.parametrize("positive,word", [("nan", "nan"), ("inf", "inf"), ("6", "every label 0"),
                                           ("1", "every label 1")])
def test_positive_that_labels_every_rating_alike_is_refused(tmp_path, capsys, positive, word):
  code = movielens.main(["--input", _write(tmp_path, "u.data"), "--out", str(tmp_path / "o"),
                         "--positive", positive])
  last = _last_error(capsys)
  assert code == 2 and last.startswith("data.ingest.public.movielens: error: --positive")
  assert word in last and not (tmp_path / "o").exists()


@pytest.mark.parametrize("field,line", [("inf", "1\t10\t5\tinf"), ("nan", "1\t10\tnan\t881250000"),
                                        ("1e30", "1\t10\t5\t1e30")])
def test_non_finite_or_huge_fields_are_one_line(tmp_path, capsys, field, line):
  p = tmp_path / "u.data"
  p.write_text(f"1\t11\t3\t881250000\n{line}\n")
  code = movielens.main(["--input", str(p), "--out", str(tmp_path / "o")])
  last = _last_error(capsys)
  assert code == 2 and "u.data: line 2" in last and field in last, last


def test_max_len_is_bounded_before_reading(tmp_path, capsys):
  code = movielens.main(["--input", str(tmp_path / "absent.data"), "--out", str(tmp_path / "o"),
                         "--max_len", "10000000000"])
  assert code == 2 and "max_len=10000000000" in _last_error(capsys)
