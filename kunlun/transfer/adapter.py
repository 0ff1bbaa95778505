"""Student Adapter distillation (GEM post-training toolkit, spec g.2).

FM (teacher) predictions are stale and do not match the VM's surface/objective. A tiny MLP, trained
with BCE on the freshest labels, maps ``[teacher_logit, surface emb, task emb, staleness age]`` to a
calibrated logit; its sigmoid is the soft target of the student's KD term:

  loss = BCE(student, labels) + lam * BCE(student, sigmoid(adapter(teacher)))
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax


def bce_with_logits(logits, targets):
  """Elementwise binary cross-entropy with (soft) targets in [0, 1], float32, stable."""
  x = logits.astype(jnp.float32)
  y = targets.astype(jnp.float32)
  return jnp.maximum(x, 0) - x * y + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _masked_mean(v, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(v * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def distill_loss(student_logits, labels, mask, soft_targets, lam, soft_mask=None):
  """BCE on labels + lam * BCE on soft targets; all ``[B, K]``; returns a float32 scalar.

  Each term is a mean over its valid entries (``mask`` for labels; ``soft_mask``, default
  ``mask``, for the soft targets -- pass ones to distill where labels are missing).
  """
  soft_mask = mask if soft_mask is None else soft_mask
  hard = _masked_mean(bce_with_logits(student_logits, labels), mask)
  soft = _masked_mean(bce_with_logits(student_logits, jax.lax.stop_gradient(soft_targets)),
                      soft_mask)
  return hard + lam * soft


class StudentAdapter(nn.Module):
  """Maps teacher logits to calibrated logits, per surface and task.

  ``(teacher_logits f32[B, K], surface i32[B], age f32[B] or [B, K]) -> f32[B, K]``.
  Output ``t * (1 + h0) + h1`` with ``h = MLP(t, log1p(age / age_scale), emb(surface), emb(task))``;
  the last layer starts at zero, so the untrained adapter is the identity. ``age_range``
  (``fit_adapter`` sets it to the ages it was fitted on) clamps the age input: the adapter is
  fitted on the freshest labels, and applying it to other staleness values must not extrapolate.
  """
  num_surfaces: int
  num_tasks: int
  hidden: int = 32
  emb_dim: int = 8
  age_scale: float = 3600.0
  age_range: tuple[float, float] | None = None

  @nn.compact
  def __call__(self, teacher_logits, surface, age):
    B, K = teacher_logits.shape
    if K != self.num_tasks:
      raise ValueError(f"StudentAdapter: teacher_logits has {K} tasks, adapter built for "
                       f"{self.num_tasks}")
    t = teacher_logits.astype(jnp.float32)
    age = jnp.broadcast_to(age.reshape(B, -1).astype(jnp.float32), (B, K))
    if self.age_range is not None:
      age = jnp.clip(age, *self.age_range)
    s_e = nn.Embed(self.num_surfaces, self.emb_dim, name="surface_embedding")(surface)  # [B, e]
    k_e = nn.Embed(self.num_tasks, self.emb_dim, name="task_embedding")(jnp.arange(K))  # [K, e]
    feats = jnp.concatenate([
        t[..., None], jnp.log1p(jnp.maximum(age, 0) / self.age_scale)[..., None],
        jnp.broadcast_to(s_e[:, None], (B, K, self.emb_dim)),
        jnp.broadcast_to(k_e[None], (B, K, self.emb_dim))], axis=-1)
    h = nn.gelu(nn.Dense(self.hidden, name="hidden")(feats))
    h = nn.Dense(2, kernel_init=nn.initializers.zeros, name="out")(h)
    return t * (1.0 + h[..., 0]) + h[..., 1]


def fit_adapter(teacher_logits, surface, age, labels, label_mask, *, num_surfaces, steps=500,
                lr=1e-2, batch_size=None, seed=0, **adapter_kw):
  """Trains a ``StudentAdapter`` with masked BCE on (fresh) labels; numpy inputs ``[N, K]``/``[N]``.

  Returns ``(module, params)``; the module's ``age_range`` is the fitted ages' range.
  ``batch_size=None`` uses full-batch steps.
  """
  teacher_logits = np.asarray(teacher_logits, np.float32)
  N, K = teacher_logits.shape
  a = np.asarray(age, np.float32)
  if N and "age_range" not in adapter_kw:
    adapter_kw["age_range"] = (float(a.min()), float(a.max()))
  module = StudentAdapter(num_surfaces=num_surfaces, num_tasks=K, **adapter_kw)
  data = (teacher_logits, np.asarray(surface, np.int32), np.asarray(age, np.float32),
          np.asarray(labels, np.float32), np.asarray(label_mask, np.float32))
  if not all(len(d) == N for d in data):
    raise ValueError("fit_adapter: all inputs need the same leading size")
  params = module.init(jax.random.key(seed), data[0][:1], data[1][:1], data[2][:1])["params"]
  tx = optax.adam(lr)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt, t, s, a, y, m):
    def loss_fn(p):
      return _masked_mean(bce_with_logits(module.apply({"params": p}, t, s, a), y), m)
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    if batch_size is None or batch_size >= N:
      batch = data
    else:
      idx = rng.integers(0, N, batch_size)
      batch = tuple(d[idx] for d in data)
    params, opt, _ = step(params, opt, *batch)
  return module, params


def soft_targets(module, params, teacher_logits, surface, age):
  """Calibrated soft targets ``sigmoid(adapter(teacher))``, f32[B, K]."""
  return jax.nn.sigmoid(module.apply({"params": params}, teacher_logits, surface, age))
