"""Orbax checkpoints: one composite per step of params, optimizer state, meta (step, RNG) and the
grain iterator state (``data.elastic`` handler: restores under another process count), saved
asynchronously, keeping the last K (jax_stack_notes §8).

Restores take abstract targets (``jax.ShapeDtypeStruct`` with shardings), so a checkpoint written
under one mesh restores onto another. ``restore_params`` reads the params item only (eval).

Damage (issue 15):
* A step counts only when its directory holds orbax's commit marker (``commit_success.txt``,
  written before the atomic rename of the finished step): a partly written or partly copied
  step is never used (``all_steps``).
* ``restore_latest`` restores the newest step that restores. A newer step that fails is moved
  aside (renamed ``<step>.corrupt-<time>``, never deleted) with a warning once an older step has
  restored, so a restarted job does not stay down; if no step restores (e.g. the model no longer
  matches), nothing is moved and the newest step's error is raised. ``strict`` raises at once.
* A save that fails (disk full, I/O error; also in the async commit) is reported and training
  goes on; the step stays uncommitted, the previous steps are untouched. ``wait`` raises if the
  last save failed (the final checkpoint of a run must exist).
* Content checksums: orbax / TensorStore do not checksum array data, so bytes flipped inside a
  param file restore silently as other values. Every save stores, in its ``meta`` item, a
  checksum of each array (``tree_digest``: a position-weighted wrapping sum of the bit patterns,
  computed on device, independent of the sharding), of the data position and of ``meta``
  itself; a restore recomputes and compares them, so a changed file is a restore failure (and
  the fallback above applies). Checkpoints written before this carry no checksums and are not
  verified.
* Errors are one line (no TensorStore spec dumps).

The optimizer state is stored in its per-leaf layout (``kunlun.train.opt_layout.to_per_leaf``; the
flat AdamW buffers are mesh-dependent) and converted back on restore, so a checkpoint restores
onto another mesh, and those written before the flat optimizer restore as they are. The state's
16-bit parameter copies (``optim.FlatAdamWState.copies``) are not stored: a restore casts them
from the restored params.

Readers and a full disk (issue 20):
* A read-only ``Checkpointer`` (eval.py, the exports) lists the committed steps from the
  directory each time it is asked, never from a list cached at open (orbax 0.12.8's read-only
  manager keeps the list it read at open: after a running trainer saved newer steps and deleted
  those, it lists none). ``restore_params`` without a step restores the newest committed step
  and, if that step disappears while it is read (the trainer's cleanup), retries with the newest
  one then. The step reported is the one saved in the checkpoint's ``meta``; a directory whose
  name differs from it (renamed, copied) gets a warning.
* A save that fails for lack of space (ENOSPC / EDQUOT) sets ``disk_full``; train.py then stops:
  ``remove_tmp_dirs`` deletes the partial ``*.orbax-checkpoint-tmp*`` steps failed saves left,
  one more save of the current step is tried, and the newest committed step is kept.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from data import elastic
from kunlun.train import opt_layout
from kunlun.train.startup import FatalError

ITEMS = ("params", "opt_state", "meta", "data_iter")
COMMIT_MARKER = "commit_success.txt"
TMP_MARKER = ".orbax-checkpoint-tmp"          # orbax's name for a step being written
RETRIES = 5                                   # restores of a step deleted while being read
TMP_SETTLE_S = 5.0                            # how long remove_tmp_dirs outlasts a late writer


def is_disk_full(e: BaseException) -> bool:
  """Whether ``e`` (or an exception it was raised from) is ENOSPC / EDQUOT; TensorStore and
  orbax wrap the OS error, so its text counts too."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
      return True
    e = e.__cause__ or e.__context__
  return False


def space_error(e: BaseException, directory: str) -> str:
  """A short 'No space left on device' line naming the file being written (or ``directory``)."""
  where = getattr(e, "filename", None)
  if not where:
    m = re.search(r'writing local file "([^"]+)"', str(e))
    where = m.group(1) if m else directory
  quota = "Disk quota exceeded" in str(e) or getattr(e, "errno", None) == errno.EDQUOT
  return f"{'Disk quota exceeded' if quota else 'No space left on device'} writing {where}"


def remove_tmp_dirs(directory: str) -> list[str]:
  """Deletes the partial steps (``<step>.orbax-checkpoint-tmp-*``) in ``directory``; returns
  their names. For a directory no save is writing to; a failed save's background writer that
  still adds files is outlasted: the removal repeats, for up to ``TMP_SETTLE_S``, until a
  listing finds no partial step."""
  gone: dict[str, None] = {}                    # names in order, once each
  deadline = time.monotonic() + TMP_SETTLE_S
  while os.path.isdir(directory) and time.monotonic() <= deadline:
    left = sorted(n for n in os.listdir(directory) if TMP_MARKER in n)
    if not left:
      break
    for name in left:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    gone.update(dict.fromkeys(left))
    time.sleep(0.02)
  return list(gone)


class CheckpointError(FatalError):
  """A missing, incomplete, unreadable or unwritable checkpoint (a one-line message)."""


def check_layout(directory: str, steps: bool = True) -> None:
  """The checkpoint directory's layout, before orbax opens it (issue 39): something that is
  not a directory at ``directory`` (a file named ``checkpoints``: orbax's saves waited minutes
  each and the process never exited) and, with ``steps`` (a writer: it deletes old steps), a
  step entry that is a symbolic link (orbax cannot delete it: a committed save was reported as
  failed and ``keep_checkpoints`` stopped being honoured) or not a directory is a one-line
  CheckpointError; nothing is moved or deleted."""
  if os.path.lexists(directory) and not os.path.isdir(directory):
    raise CheckpointError(f"{directory} is not a directory: move it away (checkpoints go in a "
                          "directory of that name)")
  if not steps or not os.path.isdir(directory):
    return
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if not name.isdigit():
      continue
    if os.path.islink(path):
      raise CheckpointError(f"checkpoint step {path} is a symbolic link (to "
                            f"{os.readlink(path)}): old steps are deleted, a link cannot be; "
                            "replace it with a copy (cp -rL) or move it away")
    if not os.path.isdir(path):
      raise CheckpointError(f"checkpoint step {path} is not a directory: move it away")


def abstract_like(tree):
  """``ShapeDtypeStruct``s (with the arrays' shardings) of a tree of arrays."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _bits_u32(x):
  """The bit pattern of ``x`` as uint32 (64-bit values: two words on a trailing axis)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  n = jnp.dtype(x.dtype).itemsize
  if n in (1, 2):
    return jax.lax.bitcast_convert_type(x, jnp.uint8 if n == 1 else jnp.uint16).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)


@jax.jit
def _leaf_sums(leaves):
  """Per leaf ``[sum(bits), sum(bits * h(position))]`` (uint32, wrapping): exact integer sums,
  so any sharding gives the same result; the position weights catch moved values."""
  out = []
  for x in leaves:
    b = _bits_u32(x)
    pos = jnp.zeros(b.shape, jnp.uint32)
    for ax in range(b.ndim):                   # row-major position, no reshape of sharded data
      stride = int(np.prod(b.shape[ax + 1:], dtype=np.uint64) % (1 << 32))
      pos = pos + jax.lax.broadcasted_iota(jnp.uint32, b.shape, ax) * jnp.uint32(stride)
    w = (pos * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
    out.append(jnp.stack([jnp.sum(b, dtype=jnp.uint32), jnp.sum(b * w, dtype=jnp.uint32)]))
  return out


def tree_digest(tree) -> dict[str, str]:
  """{leaf path: 16 hex digits} of a tree of arrays (``_leaf_sums``), sharding-independent."""
  flat = jax.tree_util.tree_leaves_with_path(tree)
  sums = jax.device_get(_leaf_sums([x for _, x in flat])) if flat else []
  return {jax.tree_util.keystr(p): f"{int(a):08x}{int(b):08x}" for (p, _), (a, b) in
          zip(flat, sums, strict=True)}


def _plan_digest(data_iter) -> str:
  """SHA-256 of the iterator's global plan state (the data position, any process count)."""
  state = elastic.global_state(data_iter.get_state())["plan"]
  return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]


def _meta_check(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k != "check"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def short_error(e: BaseException, limit: int = 300) -> str:
  """``Type: message`` on one line, without TensorStore specs and driver chains."""
  msg = " ".join(str(e).split())
  msg = re.sub(r" ?\[tensorstore_spec.*", "", msg)
  msg = re.sub(r'(Error opening "\w+" driver: )+', "", msg)
  if len(msg) > limit:
    msg = msg[:limit] + "..."
  return f"{type(e).__name__}: {msg}"


def _warn(msg: str) -> None:
  print(f"warning: {msg}", file=sys.stderr, flush=True)


def _all_processes(ok: bool) -> bool:
  """``ok`` on every process (a restore is collective: all processes take the same branch)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _save_whole_shards_on_cpu() -> None:
  """On CPU devices, saves each replicated shard whole from one replica. Orbax's default there
  (replica-parallel: each replica writes a slice) slices every replicated array with an eager
  op that compiles once per shape, seconds of compiles on a run's first save, to split a copy
  that stays in host memory anyway (orbax itself turns it off only where ``JAX_PLATFORMS`` names
  a GPU). Restores read either layout."""
  if any(d.platform != "cpu" for d in jax.local_devices()):
    return
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(handler, "_use_replica_parallel", False):
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        array_metadata_store=getattr(handler, "_array_metadata_store", None),
        use_replica_parallel=False), override=True)


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` for ``<workdir>/checkpoints``."""

  def __init__(self, directory: str, *, keep: int = 3, read_only: bool = False, warn=_warn):
    self.directory = os.path.abspath(directory)
    self.read_only, self.warn = read_only, warn
    if read_only and not os.path.lexists(self.directory):
      raise CheckpointError(f"no checkpoint directory at {self.directory}")
    check_layout(self.directory, steps=not read_only)
    if not read_only:
      _save_whole_shards_on_cpu()
    try:
      self.mngr = ocp.CheckpointManager(
          self.directory, item_names=ITEMS,
          options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                               enable_async_checkpointing=True,
                                               read_only=read_only))
    except (OSError, ValueError) as e:
      raise CheckpointError(f"cannot open checkpoints at {self.directory} "
                            f"({short_error(e)})") from None
    self._pending: int | None = None          # step of the async save in flight
    self._last_failed: int | None = None      # step of the last save that failed
    self.disk_full: str | None = None         # the error of a save that found no space

  # ---- steps -----------------------------------------------------------------------------------
  def _committed(self, step: int) -> bool:
    return os.path.exists(os.path.join(self.directory, str(step), COMMIT_MARKER))

  def _listed(self) -> list[int]:
    """Step directories: orbax's list for the writer (it tracks its own saves); read from the
    directory now for a reader (a trainer may have saved and deleted steps since it opened)."""
    if not self.read_only:
      return list(self.mngr.all_steps())
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return [int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(self.directory, n))]

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first (a step directory without the commit marker is ignored)."""
    return sorted(s for s in self._listed() if self._committed(s))

  def uncommitted_steps(self) -> list[int]:
    return sorted(s for s in self._listed() if not self._committed(s))

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def move_aside(self, step: int, why: str) -> str:
    """Renames step ``step`` to ``<step>.<why>-<time>`` (process 0; never deletes); returns it."""
    src = os.path.join(self.directory, str(step))
    dst = f"{src}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
      n = 1
      while os.path.exists(dst):
        dst, n = f"{src}.{why}-{time.strftime('%Y%m%d-%H%M%S')}-{n}", n + 1
      os.rename(src, dst)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint_move_{step}")
    self.mngr.reload()
    return dst

  # ---- save ------------------------------------------------------------------------------------
  def _check_pending(self) -> None:
    """Waits for the async save in flight (as orbax's next save would); its error is reported,
    not raised."""
    if self._pending is None:
      return
    step, self._pending = self._pending, None
    try:
      self.mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- any write error: report, keep training
      self._save_failed(step, e)

  def settle(self) -> None:
    """Waits for the async save in flight; a failure is reported (``disk_full`` set for lack of
    space), not raised."""
    self._check_pending()

  def remove_tmp_dirs(self) -> list[str]:
    """Deletes the partial steps failed saves left (process 0; call when no save is running)."""
    gone = remove_tmp_dirs(self.directory) if jax.process_index() == 0 else []
    if gone:
      self.warn(f"removed {len(gone)} partial checkpoint(s) left by failed saves: "
                f"{', '.join(gone)}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoint_remove_tmp")
    return gone

  def _save_failed(self, step: int, e: BaseException) -> None:
    self._last_failed = step
    if is_disk_full(e):
      self.disk_full = space_error(e, self.directory)
    good = self.latest_step()
    then = "stopping" if self.disk_full else "training continues"
    self.warn(f"checkpoint of step {step} could not be written ({short_error(e)}); {then}, the "
              f"newest good checkpoint is {'step ' + str(good) if good is not None else 'none'}")

  def save(self, step: int, params, opt_state, rng, data_iter, *, last_try: bool = False) -> None:
    """Starts an async save of ``step`` (no-op if that step is already saved). A failure (also
    of the previous async save) is reported as a warning; the step is then not committed. Once
    ``disk_full`` is set only a ``last_try`` save is started."""
    self._check_pending()
    if self.disk_full and not last_try:          # no space: only the caller's last attempt
      return
    if step in self.mngr.all_steps():
      if self._committed(step):
        return
      self.move_aside(step, "uncommitted")
    opt_state = opt_layout.to_per_leaf(opt_state, params)     # the mesh-independent stored layout
    meta = {"step": int(step), "rng": np.asarray(jax.random.key_data(rng)).tolist(),
            "digest": {"params": tree_digest(params), "opt_state": tree_digest(opt_state)}}
    if isinstance(data_iter, elastic.BatchIterator):
      meta["digest"]["data_iter"] = _plan_digest(data_iter)
    meta["check"] = _meta_check(meta)
    try:
      self.mngr.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
          meta=ocp.args.JsonSave(meta), data_iter=elastic.CheckpointSave(data_iter)),
          force=True)
      self._pending, self._last_failed = step, None
    except Exception as e:  # noqa: BLE001
      self._save_failed(step, e)

  # ---- restore ---------------------------------------------------------------------------------
  def _check_step(self, step: int | None, items) -> int:
    steps = self.all_steps()
    if step is not None and step in self.uncommitted_steps():
      raise CheckpointError(f"checkpoint {os.path.join(self.directory, str(step))} has no commit "
                            f"marker ({COMMIT_MARKER}): written or copied only in part; "
                            f"committed steps: {steps}")
    if not steps:
      raise CheckpointError(f"no checkpoint found in {self.directory}")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; "
                            f"available: {steps}")
    step_dir = os.path.join(self.directory, str(step))
    for item in items:
      if not os.path.isdir(os.path.join(step_dir, item)):
        raise CheckpointError(f"checkpoint {step_dir} is incomplete or corrupt: "
                              f"item '{item}' missing")
    return step

  def _restore(self, step, **args):
    try:
      return self.mngr.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:  # orbax / tensorstore raise many types; name the checkpoint instead
      older = [s for s in self.all_steps() if s < step]
      hint = f"; older steps: {older}" if older else ""
      raise CheckpointError(
          f"checkpoint {os.path.join(self.directory, str(step))} could not be restored, it is "
          f"corrupt or does not match the model ({short_error(e)}){hint}") from None

  def _verify(self, step: int, meta: dict | None, **restored) -> None:
    """Compares restored content with the checksums saved in ``meta`` (none: not verified)."""
    where = os.path.join(self.directory, str(step))
    # every digest first, on every process alike: they are collectives (jit over the global
    # arrays), so a process that found a problem early must still take part (else: a hang)
    digests = {item: _plan_digest(value) if item == "data_iter" else tree_digest(value)
               for item, value in restored.items()}
    if not isinstance(meta, dict) or "digest" not in meta:
      return
    if meta.get("check") != _meta_check(meta):
      raise CheckpointError(f"checkpoint {where} is corrupt: its meta item fails its checksum")
    for item in restored:
      want = meta["digest"].get(item)
      if want is None:
        continue
      got = digests[item]
      if got != want:
        bad = [k for k in want if got.get(k) != want[k]] if isinstance(want, dict) else [""]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise CheckpointError(
            f"checkpoint {where} is corrupt: {item}{bad[0]}{more} differs from what was saved "
            "(checksum mismatch: files changed after the save)")

  def _saved_step(self, step: int, meta: dict | None) -> int:
    """The step recorded in the checkpoint's meta (the directory name without one); a differing
    directory name (renamed, copied) is a warning."""
    saved = meta.get("step") if isinstance(meta, dict) else None
    if saved is None:
      return int(step)
    if int(saved) != int(step):
      self.warn(f"checkpoint directory {os.path.join(self.directory, str(step))} holds step "
                f"{saved} (its meta): renamed or copied from another name; reporting step {saved}")
    return int(saved)

  def restore(self, abstract_params, abstract_opt_state, data_iter, step: int | None = None):
    """Full training state. Returns ``(step, params, opt_state, rng)``; ``data_iter`` (a fresh
    grain iterator) is moved to the saved position in place. Content is checked against the
    saved checksums; the step returned is the one saved in meta."""
    step = self._check_step(step, ITEMS)
    flat = opt_layout.is_flat(abstract_opt_state)   # stored per leaf (opt_layout.to_per_leaf)
    stored = opt_layout.per_leaf_abstract(abstract_params) if flat else abstract_opt_state
    r = self._restore(step, params=ocp.args.StandardRestore(abstract_params),
                      opt_state=ocp.args.StandardRestore(stored),
                      meta=ocp.args.JsonRestore(),
                      data_iter=elastic.CheckpointRestore(data_iter))
    extra = {"data_iter": data_iter} if isinstance(data_iter, elastic.BatchIterator) else {}
    self._verify(step, r.meta, params=r.params, opt_state=r.opt_state, **extra)
    rng = jax.random.wrap_key_data(np.asarray(r.meta["rng"], np.uint32))
    opt_state = (opt_layout.from_per_leaf(r.opt_state, abstract_params, abstract_opt_state,
                                          values=r.params) if flat else r.opt_state)
    return self._saved_step(step, r.meta), r.params, opt_state, rng

  def restore_latest(self, abstract_params, abstract_opt_state, data_iter, *,
                     strict: bool = False):
    """``restore`` of the newest step that restores (``None`` without checkpoints).

    Uncommitted steps are moved aside first. If the newest step fails and an older one
    restores, the failed newer steps are moved aside with a warning (unless ``strict``: the
    first failure raises). If none restores, nothing is moved and the newest error is raised.
    """
    if not self.read_only:
      for s in self.uncommitted_steps():
        self.warn(f"checkpoint step {s} has no commit marker (written or copied only in part); "
                  f"moved to {self.move_aside(s, 'uncommitted')}")
    failed: list[tuple[int, CheckpointError]] = []
    for step in reversed(self.all_steps()):
      try:
        out = self.restore(abstract_params, abstract_opt_state, data_iter, step)
        ok = True
      except CheckpointError as e:
        ok, err = False, e
      if not _all_processes(ok):
        if ok:
          err = CheckpointError(f"checkpoint step {step} failed to restore on another process")
        if strict:
          raise CheckpointError(f"{err} (--strict_restore: not falling back to an older step)")
        failed.append((step, err))
        continue
      for s, e in failed:
        dst = self.move_aside(s, "corrupt") if not self.read_only else "(read-only: not moved)"
        self.warn(f"{e}; moved it to {dst}")
      return out
    if failed:
      raise failed[0][1]
    return None

  def restore_params(self, abstract_params, step: int | None = None):
    """Params only (no optimizer state). Returns ``(step, params)`` (the step saved in meta).

    Without ``step``: the newest committed step at the time of the call; if it is deleted while
    being read (a trainer's cleanup of old steps), the newest committed step then is restored
    instead (up to ``RETRIES`` times)."""
    for attempt in range(RETRIES + 1):
      listed = self.all_steps()
      want = step if step is not None else (listed[-1] if listed else None)
      step_dir = os.path.join(self.directory, str(want))
      try:
        self._check_step(want, ("params",))
        has_meta = os.path.isdir(os.path.join(step_dir, "meta"))
        r = self._restore(want, params=ocp.args.StandardRestore(abstract_params),
                          **({"meta": ocp.args.JsonRestore()} if has_meta else {}))
        self._verify(want, r.meta if has_meta else None, params=r.params)
      except CheckpointError:
        if want not in listed or (os.path.isdir(step_dir) and self._committed(want)):
          raise                         # never there, or still there: really unreadable
        if step is not None:
          raise CheckpointError(f"checkpoint {step_dir} was deleted while it was read (by a "
                                "running train.py's cleanup of old steps?); committed steps "
                                f"now: {self.all_steps()}") from None
        if attempt == RETRIES:
          raise
        self.warn(f"checkpoint step {want} was deleted while it was read (a running train.py "
                  "keeps only the newest steps); restoring the newest committed step instead")
        continue
      return self._saved_step(want, r.meta if has_meta else None), r.params

  def wait(self) -> None:
    """Waits for the async save; raises ``CheckpointError`` if the last save failed."""
    try:
      self.mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      if self._pending is not None:
        self._save_failed(self._pending, e)
    self._pending = None
    if self._last_failed is not None:
      good = self.latest_step()
      raise CheckpointError(f"checkpoint of step {self._last_failed} could not be written (see "
                            f"the warning above); the newest good checkpoint in {self.directory} "
                            f"is {'step ' + str(good) if good is not None else 'none'}")

  def close(self) -> None:
    try:
      self.mngr.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      if self._pending is not None:
        self._save_failed(self._pending, e)
    self._pending = None
    try:
      self.mngr.close()        # re-raises a failed background write (e.g. its metadata)
    except Exception as e:  # noqa: BLE001 -- reported in one line, never a traceback
      if not (self.disk_full or self._last_failed is not None):
        self.warn(f"closing the checkpoints in {self.directory}: {short_error(e)}")
    if self.disk_full or self._last_failed is not None:
      # a save that failed while starting (no pending save to wait for) may still have had
      # orbax's background thread create its partial step after the caller's clean-up; nothing
      # writes any more once the manager is closed
      self.remove_tmp_dirs()
