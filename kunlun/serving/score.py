"""Request-level serving (spec d.6): score one user's request against N candidate ads, computing
the request's work once and broadcasting it to the ads (``request_index i32[N]``).
What is request-level and why: docs/architecture.md, ``kunlun/serving/score.py``.

Request events come padded (``{field: [R, T]}``, ``length i32[R]``) or packed per stream
(``pack_requests``: the R requests' real events back to back at a static capacity C, the layout
of ``data/schema.py``: ``{field: [C]}``, ``offsets i32[R+1]``, ``seg``/``pos i32[C]``,
``length i32[R]``); a packed tower computes its request-level work on real events only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from data import jagged
from data.schema import Schema
from kunlun.configs.types import ModelConfig, parse
from kunlun.models import flops
from kunlun.models.ablated import ablated_config
from kunlun.models.kunlun import Kunlun
from kunlun.nn.stages import is_packed_stream
from kunlun.nn.towers import schedule
from kunlun.serving.loader import check_packed
from pallas_kernels import jagged as jagged_ops

AD_KEYS = ("sparse", "dense", "surface")


def serving_batch(request_events: dict, ads: dict, request_index=None) -> dict:
  """``request_events {stream: {field: [R, T], length [R]}}`` (a stream may be packed,
  ``pack_requests``) + ``ads {sparse, dense, surface}`` (``N`` rows) -> a serving batch.
  ``request_index`` defaults to all zeros (one request)."""
  n = int(np.shape(ads["surface"])[0])
  ri = np.zeros(n, np.int32) if request_index is None else np.asarray(request_index, np.int32)
  return {"sparse": dict(ads["sparse"]), "dense": ads["dense"], "surface": ads["surface"],
          "events": request_events, "request_index": ri}


def pack_requests(request_events: dict, capacity) -> dict:
  """Padded request events ``{stream: {field: [R, T], length [R]}}`` -> the same with the
  streams of ``capacity`` (an int: every stream; or ``{stream: C}``) packed at ``C`` tokens
  (``data.jagged.pack_events``). More events than ``C`` is a ValueError (serving scores the
  events it is given; nothing is dropped)."""
  caps = capacity if isinstance(capacity, dict) else dict.fromkeys(request_events, capacity)
  out = dict(request_events)
  for s, c in caps.items():
    if s not in request_events:
      raise ValueError(f"pack_requests: no event stream {s!r} (has {sorted(request_events)})")
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 64 or c % 64:
      raise ValueError(f"pack_requests: capacity of {s!r} = {c!r} must be a positive multiple "
                       "of 64")
    ev = request_events[s]
    length = np.asarray(ev["length"])
    if length.sum() > c:
      raise ValueError(f"events[{s!r}]: the {len(length)} requests have {int(length.sum())} "
                       f"events, over the packed capacity {c} (fewer requests per call, or a "
                       "larger capacity)")
    toks, offsets, seg, pos, _ = jagged.pack_events(
        {f: a for f, a in ev.items() if f != "length"}, length, int(c))
    out[s] = {**toks, "offsets": offsets, "seg": seg, "pos": pos,
              "length": np.diff(offsets).astype(np.int32)}
  return out


def expand(batch: dict, seq_lens: dict | None = None) -> dict:
  """The naive form of a serving batch: ``N`` separate examples (each ad row with its request's
  events), in the padded training batch layout; a packed stream is unpacked to rows of
  ``seq_lens[stream]`` (default: its longest request)."""
  ri = np.asarray(batch["request_index"])
  out = {k: batch[k] for k in AD_KEYS}
  out["events"] = {}
  for s, ev in batch["events"].items():
    if is_packed_stream(ev):
      toks = {f: a for f, a in ev.items() if f not in ("offsets", "seg", "pos", "length")}
      T = (seq_lens or {}).get(s) or max(1, int(np.max(np.diff(ev["offsets"]), initial=0)))
      ev, length = jagged.unpack_events(toks, ev["offsets"], T)
      ev["length"] = length
    out["events"][s] = {f: np.asarray(a)[ri] for f, a in ev.items()}
  return out


def check_batch(schema: Schema, batch: dict, seq_lens: dict | None = None) -> None:
  """Validates a serving batch's keys, row counts and ``request_index`` range, and each packed
  stream's descriptor (``loader.check_packed``; requests over ``seq_lens[stream]`` events when
  given) (ValueError naming the problem). Values of ids are the model's concern (they are
  wrapped / hashed there)."""
  missing = [k for k in AD_KEYS + ("events", "request_index") if k not in batch]
  if missing:
    raise ValueError(f"serving batch lacks {missing}")
  ri = np.asarray(batch["request_index"])
  n = ri.shape[0] if ri.ndim == 1 else -1
  if n < 1:
    raise ValueError(f"request_index must be i32[N] with N >= 1, got shape {ri.shape}")
  for k in ("dense", "surface"):
    if np.shape(batch[k])[0] != n:
      raise ValueError(f"{k} has {np.shape(batch[k])[0]} rows, request_index has {n}")
  for f in schema.sparse:
    if f.name not in batch["sparse"]:
      raise ValueError(f"sparse feature {f.name!r} missing (has {sorted(batch['sparse'])})")
    if np.shape(batch["sparse"][f.name])[0] != n:
      raise ValueError(f"sparse[{f.name!r}] has {np.shape(batch['sparse'][f.name])[0]} rows, "
                       f"request_index has {n}")
  r = None
  for st in schema.streams:
    ev = batch["events"].get(st.name)
    if ev is None or "length" not in ev:
      raise ValueError(f"events[{st.name!r}] missing or without 'length'")
    n_req = np.shape(ev["length"])[0]
    r = n_req if r is None else r
    if n_req != r:
      raise ValueError(f"events[{st.name!r}] has {n_req} requests, the other streams {r}")
    if is_packed_stream(ev):
      check_packed(st.name, ev, (seq_lens or {}).get(st.name))
      continue
    bad = [f for f, a in ev.items() if np.shape(a)[0] != r]
    if bad:
      raise ValueError(f"events[{st.name!r}] fields {bad} do not have {r} request rows")
  if ri.min() < 0 or ri.max() >= r:
    raise ValueError(f"request_index must lie in [0, {r}) (the request rows), got "
                     f"[{ri.min()}, {ri.max()}]")


def supports_sharing(model) -> bool:
  """Kunlun (and ``kunlun_ablated``, built on it) share; InterFormer, DLRM and models that add
  inputs through ``extra_inputs`` (LoopFM) are served naively."""
  return isinstance(model, Kunlun) and type(model).extra_inputs is Kunlun.extra_inputs


def make_scorer(model, *, shared: bool = True, jit: bool = True):
  """``fn(params, batch) -> {"logits": f32[N, K], "prob": f32[N, K]}`` for a serving batch.

  ``shared=True`` runs the request-level parts once per request (falls back to the naive path
  for models without sharing, ``supports_sharing``); ``shared=False`` scores ``expand(batch)``.
  """
  share = shared and supports_sharing(model)
  kept = {t.name: t.kept_len for t in getattr(model.cfg, "towers", ())}

  def fn(params, batch):
    if share:
      reps = model.apply({"params": params}, {k: batch[k] for k in AD_KEYS + ("events",)},
                         method="representations", request_index=batch["request_index"])
    else:
      ri = jnp.asarray(batch["request_index"], jnp.int32)
      b = {k: batch[k] for k in AD_KEYS}
      b["events"] = jax.tree.map(lambda a: jnp.take(jnp.asarray(a), ri, axis=0),
                                 _padded_events(batch["events"], kept))
      reps = model.apply({"params": params}, b, method="representations")
    logits = reps["logits"].astype(jnp.float32)
    return {"logits": logits, "prob": jax.nn.sigmoid(logits)}
  return jax.jit(fn) if jit else fn


def _padded_events(events: dict, kept: dict) -> dict:
  """Request events with each packed stream unpacked (in the graph) to ``[R, kept[stream]]``
  rows: the naive path's input."""
  out = dict(events)
  for s, ev in events.items():
    if is_packed_stream(ev):
      jag = jagged_ops.Jagged(*(jnp.asarray(ev[k], jnp.int32) for k in ("offsets", "seg", "pos")))
      out[s] = {f: jagged_ops.unpack(jnp.asarray(a), jag, kept[s]) for f, a in ev.items()
                if f not in ("offsets", "seg", "pos", "length")}
      out[s]["length"] = jag.lengths
  return out


# ---- what is shared, in FLOPs ------------------------------------------------------------------
def sharing_plan(cfg: ModelConfig) -> dict[str, list[str]]:
  """Module paths (as in the params tree) by level: ``{"request": [...], "ad": [...]}``.

  Follows the layer code: a tower's sequence is request-level until its first PFFN; HSP and
  attention on a request-level sequence are request-level; everything reading ``X`` is ad-level.
  The PFFN itself is listed as ad-level (its query side, ``LN(s)``, is computed per request).
  """
  if cfg.arch == "kunlun_ablated":
    cfg = ablated_config(cfg)
  req = [f"embed_{st}" for st in cfg.streams] if cfg.seq_mode == "towers" else (
      [f"embed_{st}" for st in cfg.streams] + ["oneseq_merge"])
  ad = ["context"]
  shared = {t.name: True for t in cfg.seq_towers}
  for l in range(cfg.num_layers):
    for t in cfg.seq_towers:
      p = schedule(t, l, cfg.comp_skip)
      if p.weightgen:
        ad.append(f"layer_{l}/{t.name}_weightgen")
      if p.hsp:
        (req if shared[t.name] else ad).append(f"layer_{l}/{t.name}_hsp")
    ad.append(f"layer_{l}/mowe")
    for t in cfg.seq_towers:
      p = schedule(t, l, cfg.comp_skip)
      if p.pffn:
        ad.append(f"layer_{l}/{t.name}_pffn")
        shared[t.name] = False
      if p.attention:
        (req if shared[t.name] else ad).append(f"layer_{l}/{t.name}_attention")
      if p.final_hsp:
        (req if shared[t.name] else ad).append(f"layer_{l}/{t.name}_final_hsp")
  ad.append("heads")
  return {"request": req, "ad": ad}


def flops_split(config, schema: Schema) -> dict[str, float]:
  """Analytic forward FLOPs per candidate (``kunlun.models.flops``): ``{"total", "request", "ad"}``;
  ``request`` is what the shared path computes once per request (event embeddings and the
  request-level HSP / attention of ``sharing_plan``), ``ad = total - request``. Speed-up bound
  at ``N`` candidates per request: ``total / (ad + request / N)``."""
  cfg = config if isinstance(config, ModelConfig) else parse(config, schema)
  total = flops.model_flops(cfg, schema)["forward"]
  if cfg.arch in ("dlrm", "interformer"):          # served naively (supports_sharing)
    return {"total": total, "request": 0.0, "ad": total}
  c = cfg
  if cfg.arch == "kunlun_ablated":
    c = ablated_config(cfg)
  plan = set(sharing_plan(cfg)["request"])
  req = 0.0
  for st in schema.streams:
    t = c.oneseq if c.seq_mode == "oneseq" else c.tower(st.name)
    req += flops.event_embed_flops(st, _stream_len(c, st.name), t.width)
  for l in range(c.num_layers):
    for t in c.seq_towers:
      for suffix in ("hsp", "final_hsp"):
        if f"layer_{l}/{t.name}_{suffix}" in plan:
          req += flops.pooling_flops(c, t)
      if f"layer_{l}/{t.name}_attention" in plan:
        req += flops.attention_flops(t.kept_len, t.width, c.attention.kind, t.window,
                                     c.attention.block_size)
  return {"total": total, "request": req, "ad": total - req}


def _stream_len(cfg: ModelConfig, stream: str) -> int:
  return next(t.kept_len for t in cfg.towers if t.name == stream)
