"""The jitted train and predict steps; ``build`` makes the train step with its optimizer,
initial state and shardings (train.py's set-up, kunlun/train/loop.py, and bench/train_step.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kunlun.configs.fields import REMAT_ORDER, default
from kunlun.nn.inputs import GROUP_SEP, LOOKUP_IDS, ROW_TAPS
from kunlun.nn.losses import masked_bce
from kunlun.train import optim, param_copies
from kunlun.train.sparse_update import make_sparse_update
from sharding import checks, partition


def _per_task_sums(logits_bk, labels_bk, mask_bk):
  """Per-task log-loss sum, positive count and valid count (for the running NE)."""
  x = logits_bk.astype(jnp.float32)
  bce = jax.nn.relu(x) - x * labels_bk + jax.nn.softplus(-jnp.abs(x))
  return (jnp.sum(bce * mask_bk, 0), jnp.sum(labels_bk * mask_bk, 0), jnp.sum(mask_bk, 0))


def label_mask(batch):
  """``label_mask`` with padded rows (``example_mask == 0``) removed, f32[B, K]."""
  mask = batch["label_mask"]
  if "example_mask" in batch:
    mask = mask * batch["example_mask"][:, None]
  return mask


@dataclasses.dataclass(eq=False)
class TrainStep:
  """``build``'s jitted step with its optimizer and shardings."""
  fn: object                  # (params, opt_state, batch, rng, step) -> (params, opt_state, stats)
  tx: object
  param_shardings: object
  opt_shardings: object
  batch_sharding: object


def build(config, model, example, mesh, rules, rng, *, task_weights=(), abstract=False):
  """The train step of ``config`` (optimizer scheduled over ``train.schedule_steps`` or
  ``train.steps``, the sparse embedding update if on, microbatches) with parameters initialised
  from ``rng`` into their sharded layout on ``mesh`` / ``rules`` and the optimizer state.
  Returns ``(TrainStep, params, opt_state)``; ``abstract``: ShapeDtypeStructs with shardings
  instead of arrays (compile without initialising)."""
  schedule_steps = int(config.train.get("schedule_steps", 0)) or int(config.train.steps)
  sparse = config.train.get("sparse_embedding_update", default("train.sparse_embedding_update"))
  sparse_update = (make_sparse_update(config.train, schedule_steps,
                                      backend=config.model.get("backend", "xla"))
                   if sparse else None)
  if abstract:
    params = partition.abstract_params(model, rng, example, mesh, rules)
    p_shard = jax.tree.map(lambda x: x.sharding, params)
  else:
    params, p_shard = partition.init_sharded(model, rng, example, mesh, rules)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        params)
  copies = None
  if config.train.get("param_copies", default("train.param_copies")) and config.model.get(
      "dtype", "float32") != "float32":
    with partition.activate(mesh, rules):       # as the step traces the model
      copies = param_copies.copy_dtypes(
          lambda p, b: model.apply({"params": p}, b, train=True, rngs={"dropout": rng}),
          shapes, example)
  tx = optim.make_optimizer(config.train, schedule_steps, copies=copies,
                            backend=config.model.get("backend", "xla"))
  o_shard = optim.opt_state_shardings(tx, shapes, p_shard, mesh)
  if abstract:
    opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             jax.eval_shape(tx.init, params), o_shard)
  else:
    opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
  b_shard = partition.batch_sharding(mesh, rules)
  weights = np.asarray(task_weights, np.float32) if task_weights else None
  fn = make_train_step(model, tx, weights, sparse_update=sparse_update, param_shardings=p_shard,
                       opt_shardings=o_shard, batch_sharding=b_shard,
                       microbatches=int(config.train.get("microbatches", 1)))
  return TrainStep(fn, tx, p_shard, o_shard, b_shard), params, opt_state


def device_memory() -> int | None:
  """Bytes a device's allocator may hold (its ``memory_stats`` limit), None where it has no such
  figure (the CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def pick_remat(make_model, config, example, mesh, rules, rng, budget: int | None, *,
               task_weights=(), log=print) -> tuple[str, dict]:
  """``train.remat=auto``: the first policy of ``fields.REMAT_ORDER`` (none, dots_saveable,
  dots_no_batch, full: least recompute first) whose compiled train step's peak memory per device
  (``sharding.checks.memory_per_device``) is at most ``budget`` bytes, and ``{policy: peak
  bytes}`` of those compiled. ``make_model(policy)`` builds the model; ``budget`` None (no
  memory figure, the CPU): "none" without compiling. Each candidate costs one compile (abstract
  parameters, nothing initialised). ValueError when even "full" does not fit."""
  if budget is None:
    return "none", {}
  peaks = {}
  for name in REMAT_ORDER:
    ts, params, opt_state = build(config, make_model(name), example, mesh, rules, rng,
                                  task_weights=task_weights, abstract=True)
    spec = lambda x, s=ts.batch_sharding: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                              sharding=s)
    batch = jax.tree.map(spec, example)
    with partition.activate(mesh, rules):       # as the loop traces it
      compiled = ts.fn.lower(params, opt_state, batch, rng, np.int32(0)).compile()
    peaks[name] = checks.memory_per_device(compiled)["peak_estimate"]
    log(f"train.remat=auto: {name} needs {peaks[name] / 2**30:.1f} GiB of the "
        f"{budget / 2**30:.1f} GiB budget per device")
    if peaks[name] <= budget:
      return name, peaks
  raise ValueError(f"train.remat=auto: no policy fits {budget / 2**30:.1f} GiB per device (full "
                   f"remat needs {peaks['full'] / 2**30:.1f} GiB); use a smaller batch, more "
                   "train.microbatches or more devices")


def make_train_step(model, tx, task_weights=None, *, sparse_update=None, param_shardings=None,
                    opt_shardings=None, batch_sharding=None, microbatches: int = 1):
  """Returns ``train_step(params, opt_state, batch, rng, step) -> (params, opt_state, stats)``.

  ``stats``: loss f32[], per_task f32[K], grad_norm f32[], ok bool[], and per-task sums
  ``loss_sum``, ``pos_sum``, ``count`` f32[K]. Params and optimizer state are donated.
  ``sparse_update``: ``make_sparse_update(...)`` (``config.train.sparse_embedding_update``)
  switches to the sparse embedding step (``_sparse_train_step``); ``tx`` then only defines the
  optimizer-state layout (``tx.init``). ``param_shardings``: the gradients are constrained to
  them (under FSDP each device reduces only its own shard of every gradient).
  ``microbatches`` (``config.train.microbatches``): the batch is split into that many
  microbatches (``split_microbatches``; every device keeps an equal share of each), their
  gradients are accumulated in a ``lax.scan`` and one optimizer update follows: the same loss
  and update as the whole batch (per-task means over the whole batch; sums reassociated), with
  the activation memory of one microbatch. With the sparse update the looked-up rows' ids and
  gradients of every microbatch are kept (``[k, ...]``, the size of the whole batch's) and
  applied in one sparse update.

  Mixed precision is the model's business (``config.model.dtype`` = "bfloat16" computes in bf16;
  parameters, optimizer state, norms and the loss stay float32). Where the optimizer state holds
  16-bit copies of parameters (``optim.FlatAdamWState.copies``, ``build`` with
  ``train.param_copies``) the model reads those instead, and their gradients are cast back: the
  same loss and gradients, without a cast per weight in the step. A step whose loss or gradient
  global norm is not finite keeps the old params and optimizer state and reports ``ok = False``
  (the host counts these and stops after too many in a row): a ``lax.cond`` around the optimizer
  update, so a good step runs the update alone (no select over every leaf). The statistics stay
  on the device (fetched lagged, ``progress.LaggedStats``); the loss runs under the named scope
  ``loss`` and the optimizer under ``optimizer`` (profiles and bench/train_step.py group by
  scope).
  """
  if microbatches < 1:
    raise ValueError(f"config.train.microbatches = {microbatches} must be >= 1")
  constrain = sparse_constrain = lambda g: g
  if param_shardings is not None:
    for opt in (tx, sparse_update):              # the flat optimizer groups leaves by sharding
      if hasattr(opt, "bind"):
        opt.bind(param_shardings)
    constrain = lambda g: jax.lax.with_sharding_constraint(g, param_shardings)
    by_key = {jax.tree_util.keystr(k): v
              for k, v in jax.tree_util.tree_leaves_with_path(param_shardings)}
    sparse_constrain = lambda g: {k: jax.lax.with_sharding_constraint(v, by_key[k])
                                  for k, v in g.items()}

  def train_step(params, opt_state, batch, rng, step):
    if sparse_update is not None:
      return _sparse_train_step(model, sparse_update, task_weights, params, opt_state, batch,
                                rng, step, sparse_constrain, microbatches)
    mask = label_mask(batch)
    rngs = {"dropout": jax.random.fold_in(rng, step)}
    leaves, treedef = jax.tree.flatten(params)      # the model reads the 16-bit copies
    read = treedef.unflatten(optim.with_copies(leaves, optim.state_copies(opt_state)))
    if microbatches == 1:
      def loss_fn(p):
        logits = model.apply({"params": p}, batch, train=True, rngs=rngs)
        with jax.named_scope("loss"):
          loss, per_task = masked_bce(logits, batch["labels"], mask, task_weights)
        return loss, (per_task, logits)

      (loss, (per_task, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(read)
      grads = constrain(_in_dtypes(grads, params, tx))
      with jax.named_scope("loss"):
        loss_sum, pos_sum, count = _per_task_sums(logits, batch["labels"], mask)
    else:
      loss, per_task, grads, (loss_sum, pos_sum, count) = _accumulated_grads(
          model, params, read, batch, mask, rngs, task_weights, microbatches, constrain)
    with jax.named_scope("optimizer"):
      if hasattr(tx, "prepare"):                 # optim.Optimizer: norms once, flat buffers
        prep = tx.prepare(grads, params)
        grad_norm = jnp.sqrt(prep.dense_sq + prep.emb_sq)
        apply = lambda p, o, g, prep: tx.step(prep, g, o, p)
      else:                                      # any optax transformation
        prep, grad_norm = None, optax.tree.norm(grads)

        def apply(p, o, g, _):
          updates, new_o = tx.update(g, o, p)
          return optax.apply_updates(p, updates), new_o
      ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

      def update(state):
        p, o, g, pr = state
        return apply(p, o, g, pr)

      new_params, new_opt = jax.lax.cond(ok, update, lambda state: state[:2],
                                         (params, opt_state, grads, prep))
    stats = {"loss": loss, "per_task": per_task, "grad_norm": grad_norm, "ok": ok,
             "loss_sum": loss_sum, "pos_sum": pos_sum, "count": count}
    return new_params, new_opt, stats

  kw = {}
  if param_shardings is not None:
    kw["in_shardings"] = (param_shardings, opt_shardings, batch_sharding, None, None)
    kw["out_shardings"] = (param_shardings, opt_shardings, None)
  return jax.jit(train_step, donate_argnums=(0, 1), compiler_options=COMPILER_OPTIONS, **kw)


# The train step's XLA options. ``xla_allow_excess_precision`` off: a value the model rounds to
# its compute dtype stays rounded where XLA would otherwise drop the round trip and keep (and
# write) it in float32 for a float32 consumer, e.g. each tower's bf16 output before the next
# module's residual (mid b256 on the H200 program: 38.8 -> 37.8 GB per step).
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def _in_dtypes(grads, params, tx=None):
  """Gradients w.r.t. the params' 16-bit copies cast back to the params' dtypes (the cast's
  transpose: the gradient w.r.t. the float32 leaf, bit for bit); as they are where the optimizer
  ``tx`` widens them itself (``optim.Optimizer.reads_grads_as_given``: the same values)."""
  if tx is not None and getattr(tx, "reads_grads_as_given", lambda: False)():
    return grads
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)


def packed_blocks(batch) -> int:
  """The block count S of a batch's packed (jagged) streams (``len(offsets) - B``,
  ``data/schema.py``); 0 for a padded batch."""
  for ev in batch.get("events", {}).values():
    if "offsets" in ev:
      return int(np.shape(ev["offsets"])[0] - np.shape(batch["surface"])[0])
  return 0


def split_microbatches(tree, k: int, blocks: int = 0):
  """``[X, ...]`` leaves -> ``[k, X / k, ...]``. Padded (``blocks`` 0): microbatch ``j`` holds rows
  ``j, j + k, ...``, so a device holding a contiguous block of the batch holds an equal share of
  every microbatch. Packed in ``blocks`` = S k blocks (``packed_blocks``; the pipeline packs k
  blocks per batch x context shard): every leaf (rows, tokens, offsets) is S k equal parts, one a
  block, and microbatch ``j`` holds part ``j`` of each run of k, i.e. block ``j`` of every
  device's k: a packed batch in S blocks, its rows those blocks' examples."""
  if blocks and blocks % k:
    raise ValueError(f"a batch packed in {blocks} blocks does not split into {k} microbatches "
                     "(the pipeline packs microbatches x the batch x context shards' blocks)")

  def split(x):
    x = jnp.asarray(x)
    if x.shape[0] % max(blocks, k):
      raise ValueError(f"batch of {x.shape[0]} rows does not split into {k} microbatches")
    if blocks:
      parts = x.reshape((blocks // k, k, x.shape[0] // blocks) + x.shape[1:])
      return jnp.swapaxes(parts, 0, 1).reshape((k, x.shape[0] // k) + x.shape[1:])
    return jnp.swapaxes(x.reshape((x.shape[0] // k, k) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, tree)


def _microbatch_share(mask, task_weights):
  """``(share, w f32[K], count_total f32[K])`` for a batch's ``mask [B, K]``: ``share(logits,
  labels, m) -> (loss, per-task sums)`` of one microbatch, its loss being its share of the whole
  batch's masked mean (``sum_b bce m / max(count_total, 1)`` per task, weighted)."""
  count_total = jnp.sum(mask, 0)
  w = (jnp.ones((mask.shape[1],), jnp.float32) if task_weights is None
       else jnp.asarray(task_weights, jnp.float32))

  def share(logits, labels, m):
    with jax.named_scope("loss"):
      s = _per_task_sums(logits, labels, m)
      return jnp.sum(w * s[0] / jnp.maximum(count_total, 1.0)), s
  return share, w, count_total


def _accumulated_grads(model, params, read, batch, mask, rngs, task_weights, k, constrain):
  """Loss, per-task loss, summed gradients and per-task sums of the whole batch from ``k``
  microbatches (``lax.scan``); the model reads ``read`` (``params`` with their 16-bit copies).
  Each microbatch's loss is its share of the whole batch's masked mean (``sum_b bce m /
  max(count_total, 1)`` per task), so the microbatch losses and gradients add up to the whole
  batch's."""
  share, w, count_total = _microbatch_share(mask, task_weights)
  K = mask.shape[1]
  mbs = split_microbatches({"batch": batch, "mask": mask}, k, packed_blocks(batch))

  def body(carry, xs):
    g_acc, sums = carry
    mb, m, j = xs["batch"], xs["mask"], xs["j"]

    def loss_fn(p):
      logits = model.apply({"params": p}, mb, train=True,
                           rngs={n: jax.random.fold_in(r, j) for n, r in rngs.items()})
      return share(logits, mb["labels"], m)

    (_, s), g = jax.value_and_grad(loss_fn, has_aux=True)(read)
    g_acc = constrain(jax.tree.map(jnp.add, g_acc, _in_dtypes(g, params)))
    return (g_acc, tuple(a + b for a, b in zip(sums, s, strict=True))), None

  zeros = constrain(jax.tree.map(jnp.zeros_like, params))
  sums0 = tuple(jnp.zeros((K,), jnp.float32) for _ in range(3))
  (grads, sums), _ = jax.lax.scan(body, (zeros, sums0),
                                  {"batch": mbs["batch"], "mask": mbs["mask"],
                                   "j": jnp.arange(k)})
  per_task = sums[0] / jnp.maximum(count_total, 1.0)
  return jnp.sum(w * per_task), per_task, grads, sums


def _sparse_train_step(model, sparse_update, task_weights, params, opt_state, batch, rng, step,
                       constrain=lambda g: g, microbatches: int = 1):
  """The train step with sparse embedding-table updates (``constrain``: maps the dense gradients
  ``{keystr: grad}`` to their parameters' shardings).

  Tables read through ``kunlun.nn.inputs`` look-ups are not differentiated: the model is applied
  with each table group's ids recorded (``LOOKUP_IDS``) and a zero tap added to the group's
  looked-up rows (``ROW_TAPS``), and the gradient is taken w.r.t. the other parameters and the
  taps, i.e. w.r.t. the gathered rows ``[M, D]`` (no table-sized gradient exists).
  ``sparse_update`` then applies AdamW to the dense leaves and the row-wise Adagrad to the
  looked-up rows only. ``microbatches = k > 1``: a ``lax.scan`` over the microbatches
  (``split_microbatches``) sums the dense gradients and stacks each microbatch's ids and row
  gradients (``[k, M_mb]``, ``[k, M_mb, D]``); the stacks go to one sparse update, which sums
  repeated ids across microbatches as the dense gradient sums them.
  ``grad_norm`` is the dense path's norm (the per-row summed table gradients count once per row);
  on a skipped step it is computed from the unsummed row gradients instead (it is then non-finite
  or the loss is). A looked-up table must be read only through those look-ups: any other read of
  it would get no gradient here (the tiny-model equivalence test in tests/kunlun/train/test_step.py
  checks the real input stage).
  """
  mask = label_mask(batch)
  rngs = {"dropout": jax.random.fold_in(rng, step)}
  n_mb = microbatches
  mbs = (split_microbatches({"batch": batch, "mask": mask}, n_mb, packed_blocks(batch))
         if n_mb > 1 else None)
  apply = lambda variables, mutable, b, r: model.apply(variables, b, train=True, rngs=r,
                                                       mutable=mutable)
  # which table groups are looked up and the shapes of their rows (tracing only, no computation)
  first = batch if n_mb == 1 else jax.tree.map(lambda x: x[0], mbs["batch"])
  taps = jax.eval_shape(lambda p: apply({"params": p}, [LOOKUP_IDS, ROW_TAPS], first, rngs)[1],
                        params)
  taps = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), taps.get(ROW_TAPS, {}))
  groups = {}                       # group keystr -> member tables' keystrs
  for path, _ in jax.tree_util.tree_leaves_with_path(taps):
    members = path[-1].key.split(GROUP_SEP)
    groups[jax.tree_util.keystr(path)] = tuple(
        jax.tree_util.keystr(path[:-1] + (jax.tree_util.DictKey(m),)) for m in members)
  tables = {m for members in groups.values() for m in members}
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = [jax.tree_util.keystr(k) for k, _ in flat]
  own = {k: v for k, (_, v) in zip(keys, flat, strict=True) if k not in tables}
  read = optim.with_copies([v for _, v in flat], optim.state_copies(opt_state))
  diff = {k: v for k, v in zip(keys, read, strict=True) if k in own}   # the 16-bit copies

  def grads_of(loss_of, b, r):
    """``((loss, aux), dense grads, ids, row grads)`` of batch ``b`` (``loss_of(logits)``)."""
    def loss_fn(diff, taps):
      p = treedef.unflatten([diff[k] if k in diff else v
                             for k, (_, v) in zip(keys, flat, strict=False)])
      logits, state = apply({"params": p, ROW_TAPS: taps}, [LOOKUP_IDS], b, r)
      loss, aux = loss_of(logits)
      return loss, (aux, logits, state.get(LOOKUP_IDS, {}))

    (loss, (aux, logits, ids)), (grads, g_taps) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(diff, taps)
    return (loss, aux, logits), constrain(_in_dtypes(grads, own, sparse_update)), ids, g_taps

  if n_mb == 1:
    def whole(logits):
      with jax.named_scope("loss"):
        return masked_bce(logits, batch["labels"], mask, task_weights)
    (loss, per_task, logits), grads, ids, g_taps = grads_of(whole, batch, rngs)
    with jax.named_scope("loss"):
      sums = _per_task_sums(logits, batch["labels"], mask)
  else:
    share, w, count_total = _microbatch_share(mask, task_weights)

    def body(carry, xs):
      g_acc, sums = carry
      mb, m, j = xs["batch"], xs["mask"], xs["j"]
      (_, s, _), g, ids, g_taps = grads_of(lambda lg: share(lg, mb["labels"], m), mb,
                                           {n: jax.random.fold_in(r, j) for n, r in rngs.items()})
      g_acc = constrain(jax.tree.map(jnp.add, g_acc, g))
      return (g_acc, tuple(a + b for a, b in zip(sums, s, strict=True))), (ids, g_taps)

    zeros = constrain(jax.tree.map(jnp.zeros_like, own))
    sums0 = tuple(jnp.zeros((mask.shape[1],), jnp.float32) for _ in range(3))
    (grads, sums), (ids, g_taps) = jax.lax.scan(
        body, (zeros, sums0), {"batch": mbs["batch"], "mask": mbs["mask"], "j": jnp.arange(n_mb)})
    # [k, M_mb, ...] -> [M_mb, k, ...]: a device's block of a microbatch's rows stays its own
    ids, g_taps = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), (ids, g_taps))
    per_task = sums[0] / jnp.maximum(count_total, 1.0)
    loss = jnp.sum(w * per_task)
  loss_sum, pos_sum, count = sums
  key_of = lambda tree: {jax.tree_util.keystr(k): v
                         for k, v in jax.tree_util.tree_leaves_with_path(tree)}
  ids, g_taps = key_of(ids), key_of(g_taps)
  with jax.named_scope("optimizer"):
    rows = {GROUP_SEP.join(members): (ids[gk], g_taps[gk]) for gk, members in groups.items()}
    if hasattr(sparse_update, "prepare"):        # norms once, packed dense gradients
      prep = sparse_update.prepare(params, grads)
      dense_sq, extra = prep.dense_sq + prep.emb_sq, {"prepared": prep}
    else:
      dense_sq, extra = optax.tree.norm(grads, squared=True), {}
    # the row gradients' squared norm is finite iff they are (barring an overflow past ~1e19,
    # which skips the step too): no separate isfinite pass over them
    raw_sq = optim.sum_or_zero([optim.f32_sq(g) for g in g_taps.values()])
    ok = jnp.isfinite(loss) & jnp.isfinite(dense_sq) & jnp.isfinite(raw_sq)
    new_params, new_opt, table_sq = sparse_update(params, opt_state, grads, rows, ok, **extra)
    grad_norm = jnp.sqrt(dense_sq + jnp.where(ok, table_sq, raw_sq))
  stats = {"loss": loss, "per_task": per_task, "grad_norm": grad_norm, "ok": ok,
           "loss_sum": loss_sum, "pos_sum": pos_sum, "count": count}
  return new_params, new_opt, stats


def make_predict_step(model):
  """``predict(params, batch) -> probabilities f32[B, K]`` (sigmoid of the eval-mode logits)."""

  @jax.jit
  def predict(params, batch):
    logits = model.apply({"params": params}, batch, train=False)
    return jax.nn.sigmoid(logits.astype(jnp.float32))

  return predict
