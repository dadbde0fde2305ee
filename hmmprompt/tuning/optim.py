"""The optimisers of tuning: Adam on a warmup-then-decay schedule over
mini-batches (the paper's recipe), and full-batch L-BFGS on the head's
L2-regularised objective (the convex problem solved to its optimum)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from hmmprompt.tuning.config import METHODS
from hmmprompt.tuning.config import TuneConfig


def tuning_lr(total: int, cfg: TuneConfig):
  """The learning rate at each of ``total`` steps: a linear warmup over
  ``cfg.warmup_steps`` (or ``warmup_frac`` of ``total``; at most ``total -
  1``) from 0 to ``cfg.lr``, then a linear decay to 0 at ``total``."""
  warmup = cfg.warmup_steps
  if warmup is None:
    warmup = int(cfg.warmup_frac * total)
  warmup = min(warmup, total - 1)
  if warmup <= 0:
    return optax.linear_schedule(cfg.lr, 0.0, total)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, warmup),
       optax.linear_schedule(cfg.lr, 0.0, max(total - warmup, 1))], [warmup])


def tuning_optimizer(total: int, cfg: TuneConfig):
  """Adam on :func:`tuning_lr`; the method's ``slow_keys`` (fine-tuning's
  ``"backbone"``) on their own schedule peaking at ``cfg.backbone_lr``."""
  opt = optax.adam(tuning_lr(total, cfg))
  slow_keys = METHODS[cfg.method].slow_keys
  if not slow_keys:
    return opt
  slow = optax.adam(tuning_lr(total, dataclasses.replace(
      cfg, lr=cfg.backbone_lr)))
  return optax.multi_transform(
      {"fast": opt, "slow": slow},
      lambda t: {k: jax.tree.map(lambda _, k=k: "slow" if k in slow_keys
                                 else "fast", v) for k, v in t.items()})


def train_adam(logits_fn, opt, tunable, examples, labels_N, idx_UxB):
  """Scans the steps. Returns ``(tunable, losses [U])``."""

  def loss_fn(tunable, batch, labels_B):
    logits_BxC = jax.vmap(lambda ex: logits_fn(tunable, ex))(batch)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxC, labels_B).mean()

  def step(carry, idx_B):
    tunable, opt_state = carry
    batch = jax.tree.map(lambda a: a[idx_B], examples)
    loss, grads = jax.value_and_grad(loss_fn)(tunable, batch, labels_N[idx_B])
    updates, opt_state = opt.update(grads, opt_state, tunable)
    return (optax.apply_updates(tunable, updates), opt_state), loss

  (tunable, _), losses = jax.lax.scan(step, (tunable, opt.init(tunable)),
                                      idx_UxB)
  return tunable, losses


def l2_leaves(head_params) -> list:
  """The head leaves :attr:`TuneConfig.lbfgs_l2` penalises: all but those
  named ``bias`` (an offset, which a penalty would only pull off the
  class balance)."""
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      head_params) if getattr(path[-1], "key", None) != "bias"]


def lbfgs_objective(logits_fn, examples, labels_N, cfg: TuneConfig):
  """``tunable -> []``: what L-BFGS minimises, the mean cross-entropy over
  the whole training split plus ``lbfgs_l2 / 2`` times the squared norm of
  the head's weights (:func:`l2_leaves`)."""

  def objective(tunable):
    logits_NxC = jax.vmap(lambda ex: logits_fn(tunable, ex))(examples)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_NxC,
                                                         labels_N).mean()
    sq = sum(jnp.sum(jnp.square(w)) for w in l2_leaves(tunable["head"]))
    return ce + 0.5 * cfg.lbfgs_l2 * sq

  return objective


# L-BFGS stops after this many steps without a new lowest objective (and
# returns the lowest point): float32's floor, where the gradient's rounding
# keeps its norm above lbfgs_tol. One step is not enough: after a failed line
# search L-BFGS recovers (on log features, stopping at the first step without
# a decrease ended 11% above the optimum).
LBFGS_PATIENCE = 20


def solve_lbfgs(objective, tunable, cfg: TuneConfig):
  """Full-batch L-BFGS (``optax.lbfgs``, its zoom line search) from
  ``tunable``, in one ``lax.while_loop``, until the gradient norm is below
  ``cfg.lbfgs_tol``, after ``cfg.lbfgs_max_steps`` steps, or after
  :data:`LBFGS_PATIENCE` steps without a new lowest objective; returns
  the lowest point seen. The last rule is float32's: near the optimum the
  gradient's rounding can keep its norm above the tolerance for ever
  (measured: a floor of 2.5e-6 on 64 near-separable examples, 5e-5 on log
  features) while the steps only trade rounding noise.

  Under vmap the loop runs until every lane has stopped; a stopped lane's
  carry is held (the batching rule selects it), so each lane ends where it
  would alone, to rounding. The value and gradient the line search
  computed at the accepted point are carried to the next step, as
  ``optax.value_and_grad_from_state`` would fetch them from the state, but
  without its ``lax.cond``, which under vmap evaluates both branches (a
  full-batch gradient more per step).

  Returns:
    ``(tunable, losses [U], steps [])``: ``U`` = ``cfg.lbfgs_max_steps``,
    ``losses[u]`` the lowest objective after step ``u`` (the final one
    repeated after the last step), ``steps`` the steps taken (0 when the
    start already meets the tolerance).
  """
  opt = optax.lbfgs()
  total = cfg.lbfgs_max_steps
  value, grad = jax.value_and_grad(objective)(tunable)

  def going(carry):
    _, _, grad, step, _, since_best, _ = carry
    return ((step < total) & (since_best < LBFGS_PATIENCE)
            & (optax.tree.norm(grad) >= cfg.lbfgs_tol))

  def step_fn(carry):
    (params, value), state, grad, step, best, since_best, losses_U = carry
    updates, state = opt.update(grad, state, params, value=value, grad=grad,
                                value_fn=objective)
    params = optax.apply_updates(params, updates)
    value = optax.tree.get(state, "value")
    better = value < best[1]  # False for NaN
    best = jax.tree.map(lambda b, n: jnp.where(better, n, b), best,
                        (params, value))
    since_best = jnp.where(better, 0, since_best + 1)
    return ((params, value), state, optax.tree.get(state, "grad"), step + 1,
            best, since_best, losses_U.at[step].set(best[1]))

  zero = jnp.zeros((), jnp.int32)
  carry = ((tunable, value), opt.init(tunable), grad, zero, (tunable, value),
           zero, jnp.zeros((total,), value.dtype))
  _, _, _, steps, (tunable, value), _, losses_U = jax.lax.while_loop(
      going, step_fn, carry)
  losses_U = jnp.where(jnp.arange(total) < steps, losses_U, value)
  return tunable, losses_U, steps
