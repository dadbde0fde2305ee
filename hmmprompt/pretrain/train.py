"""The train state, optimizer, loss and the jitted data-parallel step."""

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.backbones import depth
from hmmprompt.backbones import transformer
from hmmprompt.pretrain.config import PretrainConfig


@flax.struct.dataclass
class TrainState:
  """What a checkpoint holds (plain arrays, no functions); ``step`` int32."""

  step: jax.Array
  params: Any
  opt_state: Any


def lr_schedule(cfg: PretrainConfig):
  """Warmup then linear decay to 0, per cycle (one cycle without cycles)."""
  def cycle(length, peak):
    warmup = min(cfg.warmup_steps, max(length - 1, 0))
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, max(warmup, 1)),
         optax.linear_schedule(peak, 0.0, max(length - warmup, 1))], [warmup])
  parts = [cycle(n, cfg.lr * (cfg.cycle_lr if i else 1.0))
           for i, n in enumerate(cfg.cycles or (cfg.total_steps,))]
  return optax.join_schedules(parts, list(cfg.cycle_ends[:-1]))


def make_optimizer(cfg: PretrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (or Muon) on :func:`lr_schedule`."""
  lr, decay = lr_schedule(cfg), cfg.weight_decay
  opt = (optax.contrib.muon(lr, weight_decay=decay, adam_weight_decay=decay)
         if cfg.optimizer == "muon" else optax.adamw(lr, weight_decay=decay))
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)


def _masked_ce(logits_BxTxV, targets, weights_BxT):
  """:func:`mlm_loss` from the logits."""
  if targets.ndim == logits_BxTxV.ndim:
    # float32: soft targets would lose their small probabilities in bf16.
    ce_BxT = optax.softmax_cross_entropy(
        logits_BxTxV.astype(jnp.float32), targets.astype(jnp.float32))
  else:
    ce_BxT = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV,
                                                             targets)
  return jnp.sum(ce_BxT * weights_BxT) / jnp.maximum(jnp.sum(weights_BxT), 1.0)


def mlm_loss(params, model_cfg, inputs_BxT, targets, weights_BxT):
  """Mean CE over weighted positions, to tokens ``[B, T]`` or ``[B, T, V]``."""
  return _masked_ce(transformer.MLM(model_cfg).apply(params, inputs_BxT),
                    targets, weights_BxT)


def mlm_and_state_loss(params, model_cfg, inputs_BxT, targets, weights_BxT,
                       posterior_BxTxH, state_weight):
  """``(total, mlm)``: :func:`mlm_loss` plus ``state_weight`` times the mean
  CE from the state readout to the exact posterior ``[B, T, H]``."""
  logits_BxTxV, states_BxTxH = transformer.MLM(model_cfg).apply(
      params, inputs_BxT, method=transformer.MLM.logits_and_states)
  mlm = _masked_ce(logits_BxTxV, targets, weights_BxT)
  aux = jnp.mean(optax.softmax_cross_entropy(states_BxTxH, posterior_BxTxH))
  return mlm + state_weight * aux, mlm


def _at_zero(params, cfg: PretrainConfig) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=make_optimizer(cfg).init(params))


@functools.partial(jax.jit, static_argnums=1)
def init_states(keys_K, cfg: PretrainConfig) -> TrainState:
  """``K`` train states stacked ``[K, ...]``, model ``k`` from ``keys_K[k]``."""
  return jax.vmap(lambda k: _at_zero(transformer.init_params(k, cfg.model),
                                     cfg))(keys_K)


def abstract_states(cfg: PretrainConfig, num: int) -> TrainState:
  """The shapes of ``num`` stacked train states (what a restore fills)."""
  return jax.eval_shape(lambda: init_states(
      jax.random.split(jax.random.PRNGKey(0), num), cfg))


@functools.partial(jax.jit, static_argnums=2)
def grown_states(states_K: TrainState, keys_K, cfg: PretrainConfig
                 ) -> TrainState:
  """``cfg``'s deeper models grown from ``states_K`` (the same functions,
  :func:`~hmmprompt.backbones.depth.grow_layers`), at step 0."""
  return jax.vmap(lambda params, key: _at_zero(depth.grow_layers(
      params, transformer.init_params(key, cfg.model)), cfg))(
          states_K.params, keys_K)


def targets_ahead(inputs, tokens) -> bool:
  """Whether ``tokens`` are exact targets ``[..., V]`` computed ahead."""
  return tokens.ndim == inputs.ndim + 1


def loss_targets(cfg: PretrainConfig, hmm, inputs_BxT, tokens_BxT, weights_BxT):
  """The true tokens ``[B, T]``, or (``cfg.targets == "exact"``) their
  exact conditionals ``[B, T, V]`` given the inputs (causal: the tokens
  before) under ``hmm``, unless passed as the tokens (:func:`exact_window`)."""
  if cfg.targets == "sampled" or targets_ahead(inputs_BxT, tokens_BxT):
    return tokens_BxT
  if cfg.model.causal:  # P[X_t | x_<t]: the forward scan alone
    return jax.lax.stop_gradient(jax.vmap(
        hmm_lib.token_next_conditionals, in_axes=(None, 0))(hmm, tokens_BxT))
  exact = functools.partial(corpus_lib.exact_targets, method=(
      hmm_lib.resolve_method(cfg.exact_method, inputs_BxT.shape[-1])))
  return jax.lax.stop_gradient(jax.vmap(exact, in_axes=(None, 0, 0))(
      hmm, inputs_BxT, weights_BxT))


def exact_window(cfg: PretrainConfig) -> int:
  """Steps whose exact targets the loop computes in one call ahead (1 with
  sampled targets): ``cfg.exact_window``, else 1 on the CPU (arithmetic
  bounds the scan) and 16 off it, where the targets' scan costs the latency
  of its 2T steps, nearly flat in batch."""
  if cfg.targets != "exact":
    return 1
  return cfg.exact_window or (1 if jax.default_backend() == "cpu" else 16)


def _step_fn(cfg: PretrainConfig):
  """One model's step ``(state, inputs, tokens, weights, hmm)``."""
  opt = make_optimizer(cfg)
  if cfg.state_loss > 0 and not cfg.model.state_readout:
    raise ValueError("PretrainConfig.state_loss needs model.state_readout = "
                     "the generating HMM's number of states")
  def step(state: TrainState, inputs_BxT, tokens_BxT, weights_BxT, hmm):
    targets = loss_targets(cfg, hmm, inputs_BxT, tokens_BxT, weights_BxT)
    if cfg.state_loss > 0:
      posterior = functools.partial(corpus_lib.exact_state_posterior, method=(
          hmm_lib.resolve_method(cfg.exact_method, inputs_BxT.shape[-1])))
      post_BxTxH = jax.lax.stop_gradient(jax.vmap(
          posterior, in_axes=(None, 0, 0))(hmm, inputs_BxT, weights_BxT))
      w = jnp.float32(cfg.state_loss)
      if cfg.state_loss_steps:
        w = w * jnp.maximum(0.0, 1.0 - state.step / cfg.state_loss_steps)
      (_, loss), grads = jax.value_and_grad(mlm_and_state_loss, has_aux=True)(
          state.params, cfg.model, inputs_BxT, targets, weights_BxT,
          post_BxTxH, w)
    else:
      loss, grads = jax.value_and_grad(mlm_loss)(
          state.params, cfg.model, inputs_BxT, targets, weights_BxT)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    return TrainState(step=state.step + 1,
                      params=optax.apply_updates(state.params, updates),
                      opt_state=opt_state), loss
  return step


def map_trials(f, xs, trials_per_vmap: int):
  """``f`` over the leading trial axis of ``xs``: one ``vmap`` (0), or
  ``trials_per_vmap`` at a time (a stack of one: the unbatched body)."""
  if trials_per_vmap == 0 and jax.tree.leaves(xs)[0].shape[0] > 1:
    return jax.vmap(f)(xs)
  return jax.lax.map(f, xs, batch_size=(None if trials_per_vmap <= 1
                                        else trials_per_vmap))


# Cached: each run_trials call would trace and lower the same program again.
@functools.lru_cache(maxsize=16)
def _jitted_step(cfg: PretrainConfig, mesh):
  rep = sharding_lib.replicated(mesh)
  bat = sharding_lib.trial_batch_sharded(mesh)
  one = _step_fn(cfg)
  def step(*args):  # (states, inputs, tokens, weights, hmms), each [K, ...]
    return map_trials(lambda a: one(*a), args, cfg.trials_per_vmap)
  return jax.jit(step, in_shardings=(rep, bat, bat, bat, rep),
                 out_shardings=(rep, rep), donate_argnums=0)


def make_train_step(cfg: PretrainConfig, mesh):
  """K models in one jitted ``step(states, inputs, tokens, weights, hmms=None)
  -> (states, losses_K)``: ``states`` (:func:`init_states`, donated) and
  ``hmms`` (``jax.vmap(generative.as_hmm)``) lead with ``[K]``, the batch ``[K,
  B, T]`` splits over the devices along ``B``; ``tokens`` may be exact targets
  ``[K, B, T, V]`` (:func:`loss_targets`): then, without the state loss, no
  ``hmms`` reach the step, so every ``|H|`` shares one compile."""
  jitted = _jitted_step(cfg, mesh)
  def train_step(states, inputs_KxBxT, tokens_KxBxT, weights_KxBxT, hmms=None):
    ahead = targets_ahead(inputs_KxBxT, tokens_KxBxT)
    needs_hmms = cfg.state_loss > 0 or (cfg.targets == "exact" and not ahead)
    if needs_hmms and hmms is None:
      what = "state_loss" if cfg.state_loss > 0 else "targets='exact'"
      raise ValueError(f"PretrainConfig.{what} needs the generating HMMs: "
                       "pass hmms=jax.vmap(generative.as_hmm)(models_K) to "
                       "the step")
    return jitted(states, inputs_KxBxT, tokens_KxBxT, weights_KxBxT,
                  hmms if needs_hmms else None)
  return train_step


def step_bytes(cfg: PretrainConfig, hmms_K, mesh) -> dict:
  """XLA's buffer sizes (``state_bytes``, ``argument_bytes``,
  ``output_bytes``, ``temp_bytes``) of :func:`make_train_step` for the
  ``[K]`` ``hmms_K``, compiled on shapes only (on the CPU, an upper bound)."""
  num = jax.tree.leaves(hmms_K)[0].shape[0]
  states = abstract_states(cfg, num)
  tokens = jax.ShapeDtypeStruct((num, cfg.batch_size, cfg.corpus.chunk_len),
                                jnp.int32)
  weights = jax.ShapeDtypeStruct(tokens.shape, jnp.float32)
  hmms = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                      hmms_K) if cfg.targets == "exact" else None
  analysis = _jitted_step(cfg, mesh).lower(
      states, tokens, tokens, weights, hmms).compile().memory_analysis()
  return {"state_bytes": sum(x.size * x.dtype.itemsize
                             for x in jax.tree.leaves(states)),
          **{f"{n}_bytes": getattr(analysis, f"{n}_size_in_bytes")
             for n in ("argument", "output", "temp")}}
