"""The train state, optimizer, loss and the jitted data-parallel step."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from hmmprompt import corpus as corpus_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.backbones import transformer
from hmmprompt.pretrain.config import PretrainConfig


@flax.struct.dataclass
class TrainState:
  """What a checkpoint holds: ``step`` (int32 ``[]``), ``params`` (the
  ``MLM`` variables) and ``opt_state`` (AdamW's moments and count).

  Our own frozen pytree dataclass rather than flax's ``TrainState``: the
  optimizer is rebuilt from the config, so the state carries no functions
  and orbax saves and restores it as plain arrays.
  """

  step: jax.Array
  params: Any
  opt_state: Any


def lr_schedule(cfg: PretrainConfig):
  """Warmup then linear decay to 0, per cycle (one cycle without cycles)."""

  def cycle(length, peak):
    warmup = min(cfg.warmup_steps, max(length - 1, 0))
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, max(warmup, 1)),
         optax.linear_schedule(peak, 0.0, max(length - warmup, 1))],
        [warmup])

  lengths = cfg.cycles or (cfg.total_steps,)
  parts = [cycle(n, cfg.lr * (0.5 if i else 1.0))
           for i, n in enumerate(lengths)]
  return optax.join_schedules(parts, list(cfg.cycle_ends[:-1]))


def make_optimizer(cfg: PretrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on :func:`lr_schedule`."""
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(lr_schedule(cfg),
                                 weight_decay=cfg.weight_decay))


def mlm_loss(params, model_cfg, inputs_BxT, targets, weights_BxT):
  """Mean cross-entropy over the weighted (masked) positions.

  ``targets``: the true tokens ``int [B, T]``, or distributions
  ``[B, T, V]`` (exact conditionals).
  """
  logits_BxTxV = transformer.MLM(model_cfg).apply(params, inputs_BxT)
  if targets.ndim == logits_BxTxV.ndim:
    # float32: soft targets would lose their small probabilities in bf16.
    ce_BxT = optax.softmax_cross_entropy(
        logits_BxTxV.astype(jnp.float32), targets.astype(jnp.float32))
  else:
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV,
                                                             targets)
  return jnp.sum(ce_BxT * weights_BxT) / jnp.maximum(jnp.sum(weights_BxT),
                                                     1.0)


def init_state(key, cfg: PretrainConfig) -> TrainState:
  params = transformer.init_params(key, cfg.model)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=make_optimizer(cfg).init(params))


def init_states(key, cfg: PretrainConfig, num: int | None):
  """One :class:`TrainState` (``num`` None) or ``num`` stacked, each from
  its own key (``key`` is then ``[num]`` keys or one key to split)."""
  if num is None:
    return init_state(key, cfg)
  keys = key if key.ndim == 2 else jax.random.split(key, num)
  return jax.vmap(lambda k: init_state(k, cfg))(keys)


def loss_targets(cfg: PretrainConfig, hmm, inputs_BxT, tokens_BxT,
                 weights_BxT):
  """What the loss is taken against: the true tokens ``[B, T]``, or with
  ``cfg.targets == "exact"`` their exact conditionals ``[B, T, V]`` given
  the corrupted inputs (``hmm``: the generating model's vanilla form)."""
  if cfg.targets == "sampled":
    return tokens_BxT
  exact_BxTxV = jax.vmap(corpus_lib.exact_targets, in_axes=(None, 0, 0))(
      hmm, inputs_BxT, weights_BxT)
  return jax.lax.stop_gradient(exact_BxTxV)


def _step_fn(cfg: PretrainConfig):
  """The pure step ``(state, inputs, tokens, weights, hmm) -> (state, loss)``
  for one model (shared by the single and the stacked jitted steps)."""
  opt = make_optimizer(cfg)

  def step(state: TrainState, inputs_BxT, tokens_BxT, weights_BxT, hmm):
    targets = loss_targets(cfg, hmm, inputs_BxT, tokens_BxT, weights_BxT)
    loss, grads = jax.value_and_grad(mlm_loss)(
        state.params, cfg.model, inputs_BxT, targets, weights_BxT)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1,
                      params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), loss

  return step


def _needs_hmm(cfg: PretrainConfig, hmm):
  if cfg.targets == "exact" and hmm is None:
    raise ValueError("PretrainConfig.targets='exact' needs the generating "
                     "HMM: pass hmm=models.as_hmm(model) to the step")
  return hmm if cfg.targets == "exact" else None


def make_train_step(cfg: PretrainConfig, mesh):
  """``step(state, inputs, tokens, weights, hmm=None) -> (state, loss)``.

  Jitted; params and ``hmm`` replicated, the batch split along the mesh's
  data axis; the old state's buffers are donated. ``hmm`` (the generating
  model as a vanilla :class:`HMM`, :func:`models.as_hmm`) is needed only for
  ``cfg.targets == "exact"``: the targets are computed inside the step, per
  device on its share of the batch.
  """
  rep = sharding_lib.replicated(mesh)
  bat = sharding_lib.batch_sharded(mesh)
  jitted = jax.jit(_step_fn(cfg), in_shardings=(rep, bat, bat, bat, rep),
                   out_shardings=(rep, rep), donate_argnums=0)

  def train_step(state, inputs_BxT, tokens_BxT, weights_BxT, hmm=None):
    return jitted(state, inputs_BxT, tokens_BxT, weights_BxT,
                  _needs_hmm(cfg, hmm))

  return train_step


def map_trials(f, xs, trials_per_vmap: int):
  """``f`` over the leading trial axis of ``xs``: one ``vmap`` (0), one
  trial after another (1: the unbatched body in a ``scan``), or groups of
  ``trials_per_vmap`` vmapped."""
  if trials_per_vmap == 0:
    return jax.vmap(f)(xs)
  return jax.lax.map(f, xs, batch_size=(None if trials_per_vmap == 1
                                        else trials_per_vmap))


def make_stacked_train_step(cfg: PretrainConfig, mesh):
  """K models of one config in one jitted step (trials, issue 12).

  ``step(states, inputs, tokens, weights, active, hmms=None) -> (states,
  losses)``: every leaf of ``states`` and ``hmms`` (stacked vanilla HMMs,
  :func:`models.as_hmm` of :func:`models.stack`) has a leading trial axis
  ``[K]``; the batch arrays are ``[K, B, T]``, split over the devices along
  ``B``; trials run ``cfg.trials_per_vmap`` at a time (``lax.map`` with
  that batch size; 0: one ``vmap``); ``active [K]`` bool: an inactive trial (one that reached its
  target) keeps its state unchanged (a masked update), so the stack keeps
  one shape and one compiled program. ``losses [K]``. Trial ``k`` computes
  what :func:`make_train_step` computes for it alone.
  """
  rep = sharding_lib.replicated(mesh)
  bat = sharding_lib.trial_batch_sharded(mesh)
  one = _step_fn(cfg)

  def step(states, inputs_KxBxT, tokens_KxBxT, weights_KxBxT, active_K,
           hmms):
    new, losses_K = map_trials(
        lambda a: one(*a), (states, inputs_KxBxT, tokens_KxBxT,
                            weights_KxBxT, hmms), cfg.trials_per_vmap)
    keep = lambda n, o: jnp.where(
        active_K.reshape(active_K.shape + (1,) * (n.ndim - 1)), n, o)
    return jax.tree.map(keep, new, states), losses_K

  jitted = jax.jit(step, in_shardings=(rep, bat, bat, bat, rep, rep),
                   out_shardings=(rep, rep), donate_argnums=0)

  def train_step(states, inputs_KxBxT, tokens_KxBxT, weights_KxBxT, active_K,
                 hmms=None):
    return jitted(states, inputs_KxBxT, tokens_KxBxT, weights_KxBxT,
                  jnp.asarray(active_K, bool), _needs_hmm(cfg, hmms))

  return train_step
