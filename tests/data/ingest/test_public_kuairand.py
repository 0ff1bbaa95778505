"""data.ingest.public.kuairand on a hand-written fixture in the published KuaiRand CSV layout: tabs as
surfaces, click / like / follow tasks, histories from strictly earlier impressions (whole
seconds) carrying tab and label bits, user features joined, outcome columns never features."""

import numpy as np

from data import verify
from data.ingest.public import kuairand
from data.schema import Schema

HEADER = ("user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,"
          "is_forward,is_hate,long_view,play_time_ms,duration_ms,profile_stay_time,"
          "comment_stay_time,is_profile_enter,is_rand,tab")
# user, video, date, hourmin, time_ms, click, like, follow, ..., play_time_ms, duration_ms, ..., tab
LOG = """\
3,1071,20220408,1600,1649408076860,1,0,0,0,0,0,1,175045,87433,0,0,0,0,1
3,2012,20220408,1600,1649408076990,0,0,0,0,0,0,0,1200,34000,0,0,0,0,1
3,88,20220409,1100,1649473001000,1,1,0,0,0,0,1,60000,59000,0,0,0,0,0
5,1071,20220409,1200,1649476800500,1,0,1,0,0,0,0,5000,87433,0,0,0,1,1
3,300,20220409,1200,1649477000000,0,0,0,1,0,0,0,0,15000,0,0,0,0,4
5,88,20220410,900,1649552400000,1,1,1,0,0,0,1,70000,59000,0,0,0,0,0
5,2012,20220410,1000,1649556000000,0,0,0,0,0,1,0,300,34000,0,0,0,0,1
3,1071,20220411,800,1649635200000,1,1,0,0,0,0,1,90000,87433,0,0,0,0,0
"""
USERS = """\
user_id,user_active_degree,is_lowactive_period,is_live_streamer,is_video_author,follow_user_num,follow_user_num_range,fans_user_num,fans_user_num_range,friend_user_num,friend_user_num_range,register_days,register_days_range,onehot_feat0,onehot_feat1
3,high_active,0,0,0,5,"(0,10]",0,0,0,0,107,61-90,0,1
5,full_active,0,0,1,386,"(250,500]",4,"[1,10)",2,"[1,5)",327,181-365,1,
"""


def _rows():
  return [line.split(",") for line in LOG.strip().splitlines()]


def test_kuairand_fixture(tmp_path):
  log = tmp_path / "log_standard_4_08_to_4_21_pure.csv"
  log.write_text(HEADER + "\n" + LOG)
  users = tmp_path / "user_features_pure.csv"
  users.write_text(USERS)
  out = str(tmp_path / "ds")
  kuairand.convert([str(log)], out, user_features=str(users), max_len=3, min_surface_rows=2,
                   split="none")
  schema = Schema.load(out)
  assert schema.surfaces == ("tab0", "tab1", "tab_other")       # tab 4 is rare: pooled
  assert schema.task_names == ("click", "like", "follow")
  assert schema.stream_names == ("click", "impression")
  assert schema.stream("impression").action_vocab == 8          # click | like << 1 | follow << 2
  names = {f.name for f in schema.sparse}
  assert {"user_id", "ad_id", "hour", "is_rand", "user_active_degree", "onehot_feat1"} <= names
  assert {"duration_s", "follow_user_num", "user_count", "ad_like_rate"} <= set(schema.dense)
  leaks = ("play_time", "long_view", "comment", "forward", "hate", "profile")
  assert not [c for c in (*names, *schema.dense) if any(x in c for x in leaks)]
  surf = {"0": 0, "1": 1, "4": 2}
  rows = _rows()
  sec = [int(r[4]) // 1000 for r in rows]
  bits = [int(r[5]) | int(r[6]) << 1 | int(r[7]) << 2 for r in rows]
  got = [r for _, _, r in verify.read_split(out, "train")]
  assert len(got) == len(rows)
  di = schema.dense.index("duration_s")
  for g in got:
    i = next(k for k, r in enumerate(rows) if sec[k] == g["request_ts"]
             and int(r[0]) == g["user_id"] and int(r[1]) == g["ad_id"])
    r = rows[i]
    assert g["surface"] == surf[r[18]]
    assert g["labels"].tolist() == [float(r[5]), float(r[6]), float(r[7])]
    assert g["dense"][di] == np.float32(int(r[13]) / 1000)
    earlier = sorted((k for k in range(len(rows)) if rows[k][0] == r[0] and sec[k] < sec[i]),
                     key=lambda k: (sec[k], k))
    ev = lambda ks: [[int(rows[k][1]), bits[k], surf[rows[k][18]], sec[k]] for k in ks[-3:]]
    assert g["events/impression"].tolist() == ev(earlier)
    assert g["events/click"].tolist() == ev([k for k in earlier if rows[k][5] == "1"])
    assert all(e[3] < g["request_ts"] for e in g["events/impression"].tolist())


def test_empty_tab_cell_is_refused(tmp_path, capsys):
  log = tmp_path / "log.csv"
  rows = LOG.strip().splitlines()
  rows[2] = rows[2][:rows[2].rindex(",") + 1]                  # the third impression's tab: empty
  log.write_text(HEADER + "\n" + "\n".join(rows) + "\n")
  code = kuairand.main(["--input", str(log), "--out", str(tmp_path / "o"), "--split", "none"])
  err = capsys.readouterr().err
  last = err.strip().splitlines()[-1]
  assert code == 2 and "Traceback" not in err and not (tmp_path / "o").exists()
  assert last.startswith("data.ingest.public.kuairand: error: ") and "tab" in last, last
  assert "1 row" in last and "row 3" in last, last
