"""Tuning's optimisers: the paper's mini-batch Adam, and full-batch L-BFGS."""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from hmmprompt.tuning.config import METHODS, TuneConfig


def tuning_lr(total: int, cfg: TuneConfig):
  """The learning rate of ``total`` steps: linear from 0 to ``cfg.lr`` over
  the warmup (at most ``total - 1`` steps), then linear to 0 at ``total``."""
  warmup = min(int(cfg.warmup_frac * total) if cfg.warmup_steps is None
               else cfg.warmup_steps, total - 1)
  if warmup <= 0:
    return optax.linear_schedule(cfg.lr, 0.0, total)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, warmup),
       optax.linear_schedule(cfg.lr, 0.0, max(total - warmup, 1))], [warmup])


def tuning_optimizer(total: int, cfg: TuneConfig):
  """Adam on :func:`tuning_lr`; the method's ``slow_keys`` (fine-tuning's
  ``"backbone"``) on their own schedule peaking at ``cfg.backbone_lr``."""
  opt = optax.adam(tuning_lr(total, cfg))
  if not (slow_keys := METHODS[cfg.method].slow_keys):
    return opt
  slow = optax.adam(tuning_lr(total, dataclasses.replace(
      cfg, lr=cfg.backbone_lr)))
  return optax.multi_transform({"fast": opt, "slow": slow}, lambda t: {
      k: jax.tree.map(lambda _, k=k: "slow" if k in slow_keys else "fast", v)
      for k, v in t.items()})


def train_adam(logits_fn, opt, tunable, examples, labels_N, idx_UxB):
  """Scans the steps. Returns ``(tunable, losses [U])``."""
  def loss_fn(tunable, batch, labels_B):
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(
        lambda ex: logits_fn(tunable, ex))(batch), labels_B).mean()
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
  named ``bias`` (a penalty would pull an offset off the class balance)."""
  return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      head_params) if getattr(path[-1], "key", None) != "bias"]


def lbfgs_objective(logits_fn, examples, labels_N, cfg: TuneConfig):
  """``tunable -> []``: the mean cross-entropy over the whole training
  split plus ``lbfgs_l2 / 2`` times the squared :func:`l2_leaves`."""
  def objective(tunable):
    ce = optax.softmax_cross_entropy_with_integer_labels(jax.vmap(
        lambda ex: logits_fn(tunable, ex))(examples), labels_N).mean()
    sq = sum(jnp.sum(jnp.square(w)) for w in l2_leaves(tunable["head"]))
    return ce + 0.5 * cfg.lbfgs_l2 * sq
  return objective


# L-BFGS's steps without a new lowest objective before it stops (not 1: it
# recovers after a failed line search; stopping there ends above the optimum).
LBFGS_PATIENCE = 20


def solve_lbfgs(objective, tunable, cfg: TuneConfig):
  """Full-batch L-BFGS (``optax.lbfgs``) in one ``lax.while_loop``, until the
  gradient norm is below ``cfg.lbfgs_tol``, ``cfg.lbfgs_max_steps`` steps or
  :data:`LBFGS_PATIENCE` steps without a new lowest objective (float32 can keep
  the norm above the tolerance); under vmap each lane ends as alone. Returns
  ``(lowest point, lowest objective after each step [U], steps taken [])``."""
  opt = optax.lbfgs()
  total = cfg.lbfgs_max_steps
  value, grad = jax.value_and_grad(objective)(tunable)
  def going(carry):
    _, _, grad, step, _, since_best, _ = carry
    return ((step < total) & (since_best < LBFGS_PATIENCE)
            & (optax.tree.norm(grad) >= cfg.lbfgs_tol))
  def step_fn(carry):
    # The line search's value and grad are carried, not refetched by
    # value_and_grad_from_state, whose lax.cond runs both branches in vmap.
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
