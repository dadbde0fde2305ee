"""Tuning one seed (:func:`run_seed`) and the host driver (:func:`tune`)."""

import functools
import math
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import heads
from hmmprompt import tasks as tasks_lib
from hmmprompt.backbones import Backbone
from hmmprompt.tuning import optim
from hmmprompt.tuning.config import (METHODS, SPLITS, Data, TuneConfig,
                                     num_steps)


def init_tunable(key, backbone: Backbone, bparams, cfg: TuneConfig,
                 train_tokens_NxT: jax.Array) -> dict:
  """The tunable params before training, ``{"head": ..., **extra}``, from
  the training split's ``train_tokens_NxT`` (rows from the ``MASK``);
  :func:`run_seed` passes it ``jax.random.split(key)[0]``."""
  k_head, k_extra = jax.random.split(key)
  length = tasks_lib.input_len(cfg.num_prompt, train_tokens_NxT.shape[-1] - 1)
  head = heads.HEADS[cfg.head].init(k_head, backbone.vocab_size,
                                    backbone.embed_dim, length)
  return {"head": head, **METHODS[cfg.method].init_extra(
      k_extra, backbone, bparams, cfg, train_tokens_NxT)}


def num_trainable(backbone: Backbone, bparams, cfg: TuneConfig,
                  train_tokens_NxT: jax.Array) -> int:
  """The parameters a run trains, the head's included (shapes alone)."""
  shapes = jax.eval_shape(lambda p, t: init_tunable(
      jax.random.PRNGKey(0), backbone, p, cfg, t), bparams, train_tokens_NxT)
  return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


def _prepare_examples(backbone: Backbone, bparams, tunable, data: Data,
                      cfg: TuneConfig):
  """``(inputs_fn, examples)``: ``inputs_fn(tunable, example) -> (G, emb)``;
  ``examples[split]`` ``[N, ...]``: the head inputs if cached, else tokens."""
  method = METHODS[cfg.method]
  inputs_fn = lambda tunable, tokens_T: method.head_inputs(
      backbone, bparams, tunable, cfg, tokens_T)
  tokens = {s: data.split(s)[0] for s in SPLITS}
  if not method.caches_features:
    return inputs_fn, tokens
  examples = {s: jax.lax.map(lambda t: inputs_fn(tunable, t), toks_NxT,
                             batch_size=cfg.eval_chunk)
              for s, toks_NxT in tokens.items()}
  return lambda tunable, example: example, examples


def _logits_fn(inputs_fn, tunable, train_examples, cfg: TuneConfig):
  """``(tunable, example) -> logits [C]``; a transform that needs them reads
  the training set's ``G`` statistics at init (``tunable``)."""
  head, stats = heads.HEADS[cfg.head], None
  if heads.TRANSFORMS[cfg.features].needs_stats:
    stats = heads.feature_stats(jax.lax.map(
        lambda ex: inputs_fn(tunable, ex)[0], train_examples,
        batch_size=cfg.eval_chunk))
  def logits(tunable, example):
    g, emb = inputs_fn(tunable, example)
    feats = heads.transform(g, cfg.features, stats)
    logits_C = head.apply(tunable["head"], feats, emb)
    # A head's contract (the loss and argmax below read one example's [C]:
    # a [T, C] would argmax over the flattened array); checked at trace time.
    chex.assert_shape(logits_C, (heads.NUM_CLASSES,))
    return logits_C
  return logits


def _batch_indices(key, n: int, cfg: TuneConfig) -> jax.Array:
  """``[U, B]`` training example indices: a fresh permutation per epoch
  (``fold_in(key, epoch)``), the tail that fills no batch dropped."""
  steps_per_epoch = max(n // cfg.batch_size, 1)
  batch = min(cfg.batch_size, n)
  perms = jax.vmap(lambda e: jax.random.permutation(
      jax.random.fold_in(key, e), n)[:steps_per_epoch * batch])(
          jnp.arange(cfg.epochs))
  return perms.reshape(cfg.epochs * steps_per_epoch, batch)


def _accuracy(logits_fn, tunable, examples, labels_N, cfg: TuneConfig):
  preds_N = jax.lax.map(lambda ex: jnp.argmax(logits_fn(tunable, ex)),
                        examples, batch_size=cfg.eval_chunk)
  chex.assert_equal_shape([preds_N, labels_N])  # [N] == [N, 1] broadcasts
  return jnp.mean(preds_N == labels_N)


def run_seed(key, bparams, data: Data, backbone: Backbone, cfg: TuneConfig):
  """One seed end to end, pure (jit or vmap it over ``key``, ``bparams`` or
  ``data``, as :func:`tune` does): ``(tunable, losses [U], {split: accuracy
  []})``, ``U`` = :func:`num_steps` (:func:`optim.solve_lbfgs`' losses for
  L-BFGS); ``data`` holds ``tokens [N, T]`` and ``labels [N]``."""
  return _run(key, bparams, data, backbone, cfg)[:3]


def _run(key, bparams, data: Data, backbone: Backbone, cfg: TuneConfig):
  """:func:`run_seed`, and the steps taken ``[]`` (Adam: all of ``U``)."""
  k_init, k_perm = jax.random.split(key)
  tunable = init_tunable(k_init, backbone, bparams, cfg, data.train_tokens)
  inputs_fn, examples = _prepare_examples(backbone, bparams, tunable, data, cfg)
  logits_fn = _logits_fn(inputs_fn, tunable, examples["train"], cfg)
  if cfg.optimizer == "lbfgs":  # TuneConfig: only on cached features
    tunable, losses, steps = optim.solve_lbfgs(optim.lbfgs_objective(
        logits_fn, examples["train"], data.train_labels, cfg), tunable, cfg)
  else:
    idx_UxB = _batch_indices(k_perm, data.train_tokens.shape[0], cfg)
    opt = optim.tuning_optimizer(idx_UxB.shape[0], cfg)
    tunable, losses = optim.train_adam(
        logits_fn, opt, tunable, examples["train"], data.train_labels, idx_UxB)
    steps = jnp.asarray(idx_UxB.shape[0], jnp.int32)
  accs = {s: _accuracy(logits_fn, tunable, examples[s], data.split(s)[1],
                       cfg) for s in SPLITS}
  return tunable, losses, accs, steps


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _run_lanes(key_L, bparams, data_L: Data, backbone: Backbone,
               cfg: TuneConfig, param_axes: int, lane_group: int | None):
  """:func:`run_seed` vmapped over the lanes (``bparams``: the first
  ``param_axes``); ``lane_group`` lanes of the first axis at a time (a
  ``lax.map`` over vmapped groups, bounding memory; ``None``: all)."""
  fn = functools.partial(_run, backbone=backbone, cfg=cfg)
  for axis in reversed(range(1, data_L.train_labels.ndim - 1)):
    fn = jax.vmap(fn, in_axes=(0, 0 if axis < param_axes else None, 0))
  if data_L.train_labels.ndim == 1:  # one seed, no lanes
    return fn(key_L, bparams, data_L)
  if lane_group is None or lane_group >= data_L.train_labels.shape[0]:
    return jax.vmap(fn, in_axes=(0, 0 if param_axes else None, 0))(
        key_L, bparams, data_L)
  if param_axes:
    return jax.lax.map(lambda a: fn(*a), (key_L, bparams, data_L),
                       batch_size=lane_group)
  return jax.lax.map(lambda a: fn(a[0], bparams, a[1]), (key_L, data_L),
                     batch_size=lane_group)


def lane_group_for(lanes_per_vmap: int | None) -> int | None:
  """:func:`tune`'s ``lane_group`` from a "lanes per vmap" setting: ``None``
  (auto) is 1 on CPU (fastest there) and all lanes elsewhere; 0 is all."""
  if lanes_per_vmap is None:
    return 1 if jax.default_backend() == "cpu" else None
  return lanes_per_vmap or None


class Result(NamedTuple):
  """What :func:`tune` measured: host arrays ``[*L]`` (0-d for one seed)."""

  train_accuracy: np.ndarray
  val_accuracy: np.ndarray
  test_accuracy: np.ndarray
  final_loss: np.ndarray  # Adam: mean of the last 10 losses; L-BFGS: final
  steps: int  # Adam: num_steps; L-BFGS: the most any lane took
  seconds: float  # the whole program's wall time, compilation included
  lane_steps: np.ndarray | None = None  # [*L] steps each lane took


def _check_lanes(key_L, bparams, data_L: Data, param_axes: int) -> None:
  """``ValueError`` where an argument's leading axes are not the lanes."""
  lanes = data_L.train_labels.shape[:-1]
  shapes = {s: tuple(a.shape for a in data_L.split(s)) for s in SPLITS}
  if any(len(t) < 2 or t[:-1] != l or l[:-1] != lanes
         for t, l in shapes.values()):
    raise ValueError(f"tokens [*L, N, T] and labels [*L, N] disagree: {shapes}")
  typed = jax.dtypes.issubdtype(key_L.dtype, jax.dtypes.prng_key)
  param_lanes = {x.shape[:param_axes] for x in jax.tree.leaves(bparams)}
  if ((key_L.shape if typed else key_L.shape[:-1]) != lanes
      or param_axes > len(lanes) or param_lanes - {lanes[:param_axes]}):
    raise ValueError(f"lanes {lanes} (the data's), keys of shape "
                     f"{key_L.shape}, backbone params leading with "
                     f"{param_lanes} (param_axes={param_axes})")
  for s in SPLITS:
    labels = np.asarray(data_L.split(s)[1])
    if labels.size and (labels.min() < 0 or labels.max() >= heads.NUM_CLASSES):
      raise ValueError(
          f"{s} labels must be in [0, {heads.NUM_CLASSES}) (the heads are "
          f"binary, as the paper's tasks), got {labels.min()}..{labels.max()}"
          f"; a TaskConfig with num_classes > {heads.NUM_CLASSES} cannot be "
          f"tuned")


def tune(key_L, backbone: Backbone, bparams, data_L: Data, cfg: TuneConfig,
         param_axes: int = 0, lane_group: int | None = None
         ) -> tuple[Result, Any]:
  """Tunes every lane of ``data_L`` in one jitted program.

  Lanes ``L`` are leading axes (none for one seed): ``data_L`` has ``tokens [*L,
  N, T]`` and ``labels [*L, N]``, ``key_L`` a key per lane, ``bparams`` the
  first ``param_axes`` (1: one backbone per trial, as :func:`tune_trials`);
  ``lane_group``: :func:`lane_group_for`. Each lane gets what :func:`run_seed`
  gives it alone, to float rounding. Returns ``(Result, tunable)``, the tunable
  params stacked ``[*L, ...]``; ``ValueError`` for shapes that disagree, or
  fine-tuning a backbone without free parameters."""
  if METHODS[cfg.method].needs_finetunable and not backbone.finetunable:
    raise ValueError(f"method {cfg.method!r} has no meaning on the "
                     f"{backbone.name!r} backbone (its params are not a "
                     f"transformer's free parameters); use head or prompt "
                     f"tuning")
  _check_lanes(key_L, bparams, data_L, param_axes)
  t0 = time.perf_counter()
  tunable, losses, accs, lane_steps = jax.block_until_ready(
      _run_lanes(key_L, bparams, data_L, backbone, cfg, param_axes, lane_group))
  seconds = time.perf_counter() - t0
  losses, accs, lane_steps = jax.device_get((losses, accs, lane_steps))
  if cfg.optimizer == "lbfgs":
    final_loss, steps = losses[..., -1], int(np.max(lane_steps, initial=0))
  else:
    final_loss = np.mean(losses[..., -10:], axis=-1)
    steps = num_steps(data_L.train_tokens.shape[-2], cfg)
  return Result(accs["train"], accs["val"], accs["test"], final_loss, steps,
                seconds, np.asarray(lane_steps)), tunable


def stack_data(datas: Sequence[Data]) -> Data:
  """One :class:`Data` with a new leading lane axis: every array of
  ``datas`` stacked (``[S, N, T]`` tokens, ``[S, N]`` labels), as
  :func:`tune` takes lanes; stack twice for ``[K, S]`` (:func:`tune_trials`).
  The datasets must share their shapes (the same task sizes)."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *datas)


def tune_many(keys, backbone: Backbone, bparams, datas: Sequence[Data],
              cfg: TuneConfig, lane_group: int | None = None
              ) -> tuple[Result, Any]:
  """:func:`tune` on ``[S]`` seeds (or tasks), one backbone."""
  if len(keys) != len(datas):
    raise ValueError(f"{len(keys)} keys for {len(datas)} datasets")
  return tune(jnp.stack(list(keys)), backbone, bparams, stack_data(datas),
              cfg, lane_group=lane_group)


def tune_trials(keys, backbone: Backbone, bparams_K,
                datas: Sequence[Sequence[Data]], cfg: TuneConfig,
                lane_group: int | None = None) -> tuple[Result, Any]:
  """:func:`tune` on K trials x S tasks (lanes ``[K, S]``), ``bparams_K``
  stacked per trial (:func:`pretrain.load_trials`' params, or exact HMMs);
  ``datas[k][s]`` and ``keys[k][s]`` are trial ``k``'s task ``s``."""
  k = jax.tree.leaves(bparams_K)[0].shape[0]
  if k != len(datas) or k != len(keys):
    raise ValueError(f"backbone params for {k} trials, {len(datas)} trials "
                     f"of datasets and {len(keys)} of keys")
  per_trial = {len(d) for d in datas} | {len(kk) for kk in keys}
  if len(per_trial) != 1 or 0 in per_trial:
    raise ValueError(f"every trial needs the same number (>= 1) of tasks "
                     f"and keys, got {[len(d) for d in datas]} datasets and "
                     f"{[len(kk) for kk in keys]} keys")
  return tune(jnp.stack([jnp.stack(list(kk)) for kk in keys]), backbone,
              bparams_K, stack_data([stack_data(d) for d in datas]), cfg,
              param_axes=1, lane_group=lane_group)
