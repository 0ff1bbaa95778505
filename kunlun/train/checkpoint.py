"""Orbax checkpoints: one composite per step of params, optimizer state, meta (step, RNG) and the
grain iterator state (``data.elastic`` handler: restores under another process count), saved
asynchronously, keeping the last K (jax_stack_notes §8).

Restores take abstract targets (``jax.ShapeDtypeStruct`` with shardings), so a checkpoint written
under one mesh restores onto another. ``restore_params`` reads the params item only (eval).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from data import elastic

ITEMS = ("params", "opt_state", "meta", "data_iter")


class CheckpointError(RuntimeError):
  """A missing, incomplete or unreadable checkpoint."""


def abstract_like(tree):
  """``ShapeDtypeStruct``s (with the arrays' shardings) of a tree of arrays."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` for ``<workdir>/checkpoints``."""

  def __init__(self, directory: str, *, keep: int = 3, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(f"no checkpoint directory at {self.directory}")
    self.mngr = ocp.CheckpointManager(
        self.directory, item_names=ITEMS,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                             enable_async_checkpointing=True,
                                             read_only=read_only))

  def latest_step(self) -> int | None:
    return self.mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.mngr.all_steps())

  def save(self, step: int, params, opt_state, rng, data_iter) -> None:
    """Starts an async save of ``step`` (no-op if that step is already saved)."""
    if step in self.mngr.all_steps():
      return
    meta = {"step": int(step), "rng": np.asarray(jax.random.key_data(rng)).tolist()}
    self.mngr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta), data_iter=elastic.CheckpointSave(data_iter)),
        force=True)

  def _check_step(self, step: int | None, items) -> int:
    steps = self.all_steps()
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
      raise CheckpointError(
          f"checkpoint {os.path.join(self.directory, str(step))} could not be restored, it is "
          f"corrupt or does not match the model ({type(e).__name__}: {str(e)[:500]})") from e

  def restore(self, abstract_params, abstract_opt_state, data_iter, step: int | None = None):
    """Full training state. Returns ``(step, params, opt_state, rng)``; ``data_iter`` (a fresh
    grain iterator) is moved to the saved position in place."""
    step = self._check_step(step, ITEMS)
    r = self._restore(step, params=ocp.args.StandardRestore(abstract_params),
                      opt_state=ocp.args.StandardRestore(abstract_opt_state),
                      meta=ocp.args.JsonRestore(),
                      data_iter=elastic.CheckpointRestore(data_iter))
    rng = jax.random.wrap_key_data(np.asarray(r.meta["rng"], np.uint32))
    return int(r.meta["step"]), r.params, r.opt_state, rng

  def restore_params(self, abstract_params, step: int | None = None):
    """Params only (no optimizer state). Returns ``(step, params)``."""
    step = self._check_step(step, ("params",))
    r = self._restore(step, params=ocp.args.StandardRestore(abstract_params))
    return step, r.params

  def wait(self) -> None:
    self.mngr.wait_until_finished()

  def close(self) -> None:
    self.mngr.wait_until_finished()
    self.mngr.close()
