"""Head tuning and prompt tuning on a frozen backbone (paper Sections 2-5).

The tunable parameters are a pytree ``{"head": ...}`` (head tuning),
``{"prompt": [P, D], "head": ...}`` (prompt tuning) or ``{"backbone": ...,
"head": ...}`` (full fine-tuning, the paper's point of comparison; only for
backbones with ``finetunable`` set), updated by optax. The frozen backbone's
params are an argument of every function here and are never differentiated:
``jax.value_and_grad`` is taken with respect to the tunable pytree only
(fine-tuning starts its own copy from them).

Head tuning computes the frozen backbone's outputs once per example (no
prompt) and trains on those cached features. Prompt tuning runs the backbone
on ``(prompt, MASK, x_1, ...)`` at every step; the linear head reads the
output at the ``MASK`` position (:func:`hmmprompt.tasks.mask_index`).

Methods are :class:`Method` objects in :data:`METHODS` and heads are
:class:`hmmprompt.heads.Head` objects in :data:`hmmprompt.heads.HEADS`; the
training loop only uses their interfaces, so a new one is one object and one
registry entry.

:func:`tune_many` runs independent seeds / tasks as one vmapped, compiled
program; each seed's result equals :func:`tune` on that seed alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hmmprompt import heads
from hmmprompt import tasks as tasks_lib
from hmmprompt import validation
from hmmprompt.backbones import Backbone

SPLITS = ("train", "val", "test")


@dataclasses.dataclass(frozen=True)
class Method:
  """What a tuning method trains and how a head sees an example.

  Attributes:
    name: its key in :data:`METHODS`.
    init_extra: ``(key, backbone, bparams, cfg) -> dict``: the tunable
      entries besides ``"head"`` (none, ``"prompt"``, ``"backbone"``, ...).
    head_inputs: ``(backbone, bparams, tunable, cfg, tokens [T]) -> (G,
      emb)``, what the head reads (see :func:`backbone_head_inputs`).
    caches_features: ``head_inputs`` does not depend on ``tunable``, so it
      is computed once per example before training (and the training loop
      sees the cached ``(G, emb)`` as the example).
    uses_prompt: inputs carry ``cfg.prompt_len`` soft prompt vectors in
      front of the ``MASK`` (sets :attr:`TuneConfig.num_prompt`).
    slow_keys: tunable entries trained at ``cfg.backbone_lr`` instead of
      ``cfg.lr``.
    needs_finetunable: only for backbones whose params are free parameters.
  """

  name: str
  init_extra: Callable[..., dict]
  head_inputs: Callable[..., tuple]
  caches_features: bool = False
  uses_prompt: bool = False
  slow_keys: frozenset = frozenset()
  needs_finetunable: bool = False


@dataclasses.dataclass(frozen=True)
class TuneConfig:
  """Downstream tuning (defaults: the paper, Appendix D).

  Attributes:
    method: ``"head"`` (frozen backbone, train the head), ``"prompt"``
      (train a soft prompt and the head) or ``"finetune"`` (train a copy of
      the backbone and the head); any key of :data:`METHODS`.
    head: ``"linear"`` (on the ``MASK`` position) or ``"attention"``; any
      key of :data:`hmmprompt.heads.HEADS`.
    features: see :mod:`hmmprompt.heads`.
    prompt_len: soft prompt vectors (paper: 20).
    prompt_init: raw prompt entries start Uniform[-prompt_init, prompt_init].
    lr: peak learning rate of Adam (paper: 0.01).
    backbone_lr: peak learning rate of the backbone's params when
      fine-tuning (0.01 would wreck a pretrained transformer).
    warmup_steps: linear warmup; ``None`` means ``warmup_frac`` of the steps.
      Then linear decay to 0.
    epochs: passes over the training set (paper: 5).
    batch_size: examples per step (the paper does not say; 32 here).
    max_len: truncate inputs to this many positions, prompt included
      (``None``: no truncation; the authors' scripts used 80).
    eval_chunk: examples per chunk when computing accuracies.
  """

  method: str = "head"
  head: str = "linear"
  features: str = "raw"
  prompt_len: int = 20
  prompt_init: float = 0.5
  lr: float = 0.01
  backbone_lr: float = 1e-3
  warmup_steps: int | None = None
  warmup_frac: float = 0.1
  epochs: int = 5
  batch_size: int = 32
  max_len: int | None = None
  eval_chunk: int = 250

  def __post_init__(self):
    for field, registry in (("method", METHODS), ("head", heads.HEADS),
                            ("features", heads.TRANSFORMS)):
      if getattr(self, field) not in registry:
        raise ValueError(f"TuneConfig.{field} must be one of "
                         f"{tuple(registry)}, got {getattr(self, field)!r}")
    validation.require_positive(self, "prompt_len", "epochs", "batch_size",
                                "eval_chunk")
    for name in ("lr", "backbone_lr"):
      if not getattr(self, name) > 0:
        raise ValueError(f"TuneConfig.{name} must be > 0, got "
                         f"{getattr(self, name)}")
    if not 0 <= self.warmup_frac < 1:
      raise ValueError("TuneConfig.warmup_frac must be in [0, 1)")
    if (self.max_len is not None
        and self.max_len < tasks_lib.input_len(self.num_prompt, 0)):
      raise ValueError(f"TuneConfig.max_len = {self.max_len} leaves no room "
                       f"for the MASK after {self.num_prompt} prompt vectors")

  @property
  def num_prompt(self) -> int:
    return self.prompt_len if METHODS[self.method].uses_prompt else 0

  @classmethod
  def authors(cls, **overrides) -> "TuneConfig":
    """The original fine-tuning scripts: batch 128, 100 epochs, 500 warmup
    steps, inputs truncated to 80 positions (prompt included)."""
    kw = dict(lr=0.01, warmup_steps=500, batch_size=128, epochs=100,
              max_len=80)
    kw.update(overrides)
    return cls(**kw)


class Data(NamedTuple):
  """Arrays of one seed: ``tokens [N, T]`` and ``labels [N]`` per split."""

  train_tokens: jax.Array
  train_labels: jax.Array
  val_tokens: jax.Array
  val_labels: jax.Array
  test_tokens: jax.Array
  test_labels: jax.Array


def _tokens(data: Data, split: str) -> jax.Array:
  return getattr(data, split + "_tokens")


def _labels(data: Data, split: str) -> jax.Array:
  return getattr(data, split + "_labels")


def data_from_task(task: tasks_lib.Task, cfg: TuneConfig) -> Data:
  """Split arrays, truncated to ``cfg.max_len`` positions with the prompt."""
  # Task tokens are (MASK, x_1, ...); keeping ``keep`` of them makes the
  # backbone input (prompt, MASK, x_1, ...) exactly ``max_len`` long.
  keep = None if cfg.max_len is None else cfg.max_len - cfg.num_prompt
  cut = lambda t: jnp.asarray(t)[:, :keep]
  return Data(cut(task.train.tokens), task.train.labels,
              cut(task.val.tokens), task.val.labels,
              cut(task.test.tokens), task.test.labels)


def num_steps(num_train: int, cfg: TuneConfig) -> int:
  return cfg.epochs * max(num_train // cfg.batch_size, 1)


def _schedule(total: int, cfg: TuneConfig):
  warmup = cfg.warmup_steps
  if warmup is None:
    warmup = int(cfg.warmup_frac * total)
  warmup = min(warmup, total - 1)
  if warmup <= 0:
    return optax.linear_schedule(cfg.lr, 0.0, total)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, warmup),
       optax.linear_schedule(cfg.lr, 0.0, max(total - warmup, 1))], [warmup])


# ----------------------------------------------------------------------------
# Methods.


def backbone_head_inputs(backbone: Backbone, params, cfg: TuneConfig,
                         tokens_T: jax.Array, prompt_raw_PxD=None):
  """``(G, emb)`` that ``cfg.head`` reads from one backbone input.

  The backbone sees ``(prompt, MASK, x_1, ...)``. Heads reading all
  positions get ``(G [P+T, V], emb [P+T, D])``; the others get ``(G [V],
  None)`` at the ``MASK``, which is all head tuning then needs to cache.
  """
  probs_TxV, emb_TxD = backbone.outputs(params, tokens_T, prompt_raw_PxD)
  if heads.HEADS[cfg.head].reads_all_positions:
    return probs_TxV, emb_TxD
  return probs_TxV[tasks_lib.mask_index(cfg.num_prompt)], None


def _nothing_extra(key, backbone, bparams, cfg):
  del key, backbone, bparams, cfg
  return {}


def _frozen_inputs(backbone, bparams, tunable, cfg, tokens_T):
  del tunable  # Nothing tunable before the head: cacheable.
  return backbone_head_inputs(backbone, bparams, cfg, tokens_T)


def _init_prompt(key, backbone, bparams, cfg):
  del bparams
  return {"prompt": jax.random.uniform(
      key, (cfg.prompt_len, backbone.embed_dim), minval=-cfg.prompt_init,
      maxval=cfg.prompt_init)}


def _prompted_inputs(backbone, bparams, tunable, cfg, tokens_T):
  return backbone_head_inputs(backbone, bparams, cfg, tokens_T,
                              tunable["prompt"])


def _copy_backbone(key, backbone, bparams, cfg):
  del key, backbone, cfg
  return {"backbone": bparams}


def _finetuned_inputs(backbone, bparams, tunable, cfg, tokens_T):
  del bparams
  return backbone_head_inputs(backbone, tunable["backbone"], cfg, tokens_T)


METHODS: dict[str, Method] = {
    "head": Method("head", init_extra=_nothing_extra,
                   head_inputs=_frozen_inputs, caches_features=True),
    "prompt": Method("prompt", init_extra=_init_prompt,
                     head_inputs=_prompted_inputs, uses_prompt=True),
    # A pretrained backbone is wrecked by the head's learning rate.
    "finetune": Method("finetune", init_extra=_copy_backbone,
                       head_inputs=_finetuned_inputs,
                       slow_keys=frozenset({"backbone"}),
                       needs_finetunable=True),
}


# ----------------------------------------------------------------------------
# One seed, step by step (all traceable).


def _init_tunable(key, backbone: Backbone, bparams, cfg: TuneConfig,
                  num_tokens: int) -> dict:
  """``{"head": ..., **extra}``; ``num_tokens`` counts the ``MASK``."""
  k_head, k_extra = jax.random.split(key)
  length = tasks_lib.input_len(cfg.num_prompt, num_tokens - 1)
  head = heads.HEADS[cfg.head].init(k_head, backbone.vocab_size,
                                    backbone.embed_dim, length)
  return {"head": head, **METHODS[cfg.method].init_extra(k_extra, backbone,
                                                         bparams, cfg)}


def _prepare_examples(backbone: Backbone, bparams, tunable, data: Data,
                      cfg: TuneConfig):
  """``(inputs_fn, examples)``: ``examples[split]`` has one leading ``N``
  axis and ``inputs_fn(tunable, example) -> (G, emb)``.

  A caching method's examples are its head inputs, computed once; the
  others' are the tokens ``[N, T]``.
  """
  method = METHODS[cfg.method]
  inputs_fn = lambda tunable, tokens_T: method.head_inputs(
      backbone, bparams, tunable, cfg, tokens_T)
  if not method.caches_features:
    return inputs_fn, {s: _tokens(data, s) for s in SPLITS}
  examples = {s: jax.lax.map(lambda t: inputs_fn(tunable, t), _tokens(data, s),
                             batch_size=cfg.eval_chunk) for s in SPLITS}
  return lambda tunable, example: example, examples


def _feature_stats(inputs_fn, tunable, train_examples, cfg: TuneConfig):
  """Statistics of the training set's ``G`` at initialisation, or ``None``
  if ``cfg.features`` reads none."""
  if not heads.TRANSFORMS[cfg.features].needs_stats:
    return None
  g_train = jax.lax.map(lambda ex: inputs_fn(tunable, ex)[0], train_examples,
                        batch_size=cfg.eval_chunk)
  return heads.feature_stats(g_train)


def _logits_fn(inputs_fn, stats, cfg: TuneConfig):
  """``(tunable, example) -> logits [C]``."""
  head = heads.HEADS[cfg.head]

  def logits(tunable, example):
    g, emb = inputs_fn(tunable, example)
    feats = heads.transform(g, cfg.features, stats)
    return head.apply(tunable["head"], feats, emb)

  return logits


def _batch_indices(key, n: int, cfg: TuneConfig) -> jax.Array:
  """``[S, B]`` training example indices: a fresh permutation per epoch
  (``fold_in(key, epoch)``), its tail that fills no batch dropped."""
  steps_per_epoch = max(n // cfg.batch_size, 1)
  batch = min(cfg.batch_size, n)
  perms = jax.vmap(lambda e: jax.random.permutation(
      jax.random.fold_in(key, e), n)[:steps_per_epoch * batch])(
          jnp.arange(cfg.epochs))
  return perms.reshape(cfg.epochs * steps_per_epoch, batch)


def _optimizer(total: int, cfg: TuneConfig):
  """Adam on a warmup / linear-decay schedule; the method's ``slow_keys`` on
  its own schedule peaking at ``cfg.backbone_lr``."""
  opt = optax.adam(_schedule(total, cfg))
  slow_keys = METHODS[cfg.method].slow_keys
  if not slow_keys:
    return opt
  slow = optax.adam(_schedule(total, dataclasses.replace(
      cfg, lr=cfg.backbone_lr)))
  return optax.multi_transform(
      {"fast": opt, "slow": slow},
      lambda t: {k: jax.tree.map(lambda _, k=k: "slow" if k in slow_keys
                                 else "fast", v) for k, v in t.items()})


def _train(logits_fn, opt, tunable, examples, labels_N, idx_SxB):
  """Scans the steps. Returns ``(tunable, losses [S])``."""

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
                                      idx_SxB)
  return tunable, losses


def _accuracy(logits_fn, tunable, examples, labels_N, cfg: TuneConfig):
  preds_N = jax.lax.map(lambda ex: jnp.argmax(logits_fn(tunable, ex)),
                        examples, batch_size=cfg.eval_chunk)
  return jnp.mean(preds_N == labels_N)


def _run(key, bparams, data: Data, backbone: Backbone, cfg: TuneConfig):
  """One seed, end to end. Traceable; vmapped by :func:`tune_many`.

  Returns ``(tunable, losses [S], {split: accuracy})``.
  """
  k_init, k_perm = jax.random.split(key)
  n, num_tokens = data.train_tokens.shape
  tunable = _init_tunable(k_init, backbone, bparams, cfg, num_tokens)
  inputs_fn, examples = _prepare_examples(backbone, bparams, tunable, data,
                                          cfg)
  stats = _feature_stats(inputs_fn, tunable, examples["train"], cfg)
  logits_fn = _logits_fn(inputs_fn, stats, cfg)
  idx_SxB = _batch_indices(k_perm, n, cfg)
  opt = _optimizer(idx_SxB.shape[0], cfg)
  tunable, losses = _train(logits_fn, opt, tunable, examples["train"],
                           data.train_labels, idx_SxB)
  accs = {s: _accuracy(logits_fn, tunable, examples[s], _labels(data, s), cfg)
          for s in SPLITS}
  return tunable, losses, accs


_run_one = jax.jit(_run, static_argnums=(3, 4))
_run_many = jax.jit(jax.vmap(_run, in_axes=(0, None, 0, None, None)),
                    static_argnums=(3, 4))
# Trials x tasks: each trial's backbone params shared by its tasks.
_run_trials = jax.jit(
    jax.vmap(jax.vmap(_run, in_axes=(0, None, 0, None, None)),
             in_axes=(0, 0, 0, None, None)), static_argnums=(3, 4))


def _record(cfg, accs, losses, steps, seconds, num_batched):
  return {
      "config": dataclasses.asdict(cfg),
      "train_accuracy": float(accs["train"]),
      "val_accuracy": float(accs["val"]),
      "test_accuracy": float(accs["test"]),
      "final_loss": float(np.mean(np.asarray(losses)[-10:])),
      "steps": int(steps),
      "seconds": float(seconds),
      "seeds_in_program": int(num_batched),
  }


def _check_data(data: Data):
  for name in SPLITS:
    toks, labels = _tokens(data, name), _labels(data, name)
    if toks.ndim < 2 or labels.shape != toks.shape[:-1]:
      raise ValueError(f"{name} tokens [.., N, T] and labels [.., N] "
                       f"disagree: {toks.shape} vs {labels.shape}")


def _check_method(backbone: Backbone, cfg: TuneConfig):
  if METHODS[cfg.method].needs_finetunable and not backbone.finetunable:
    raise ValueError(f"the {backbone.name!r} backbone cannot be fine-tuned "
                     f"(its params are not free parameters); use head or "
                     f"prompt tuning")


def tune(key, backbone: Backbone, bparams, data: Data,
         cfg: TuneConfig) -> tuple[dict, Any]:
  """Tunes one seed. Returns ``(record, tunable_params)``."""
  _check_method(backbone, cfg)
  _check_data(data)
  t0 = time.perf_counter()
  tunable, losses, accs = jax.block_until_ready(
      _run_one(key, bparams, data, backbone, cfg))
  steps = num_steps(data.train_tokens.shape[0], cfg)
  return _record(cfg, accs, losses, steps, time.perf_counter() - t0,
                 1), tunable


def stack_data(datas: Sequence[Data]) -> Data:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *datas)


def _tune_lanes(run, keys, backbone: Backbone, bparams, data: Data,
                cfg: TuneConfig):
  """Runs ``run`` over lanes (leading axes of ``keys`` and ``data``);
  returns ``(tunable, losses, accs, seconds, steps)``, losses and
  accuracies on the host."""
  _check_method(backbone, cfg)
  _check_data(data)
  t0 = time.perf_counter()
  tunable, losses, accs = jax.block_until_ready(
      run(keys, bparams, data, backbone, cfg))
  seconds = time.perf_counter() - t0
  losses, accs = jax.device_get((losses, accs))  # index on the host
  return (tunable, losses, accs, seconds,
          num_steps(data.train_tokens.shape[-2], cfg))


def tune_many(keys, backbone: Backbone, bparams, datas: Sequence[Data],
              cfg: TuneConfig) -> tuple[list[dict], Any]:
  """Tunes ``len(datas)`` seeds in one vmapped program on a shared backbone.

  Returns one record per seed and the stacked tunable params.
  """
  if len(keys) != len(datas):
    raise ValueError(f"{len(keys)} keys for {len(datas)} datasets")
  tunable, losses, accs, seconds, steps = _tune_lanes(
      _run_many, jnp.stack(list(keys)), backbone, bparams, stack_data(datas),
      cfg)
  n = len(datas)
  return [_record(cfg, {s: a[i] for s, a in accs.items()}, losses[i], steps,
                  seconds, n) for i in range(n)], tunable


def tune_trials(keys, backbone: Backbone, bparams_K,
                datas: Sequence[Sequence[Data]],
                cfg: TuneConfig) -> tuple[list[list[dict]], Any]:
  """Tunes K trials x S tasks in one vmapped program, every trial on its
  own backbone params, shared by its tasks.

  ``bparams_K``: the backbone params of K models of one size stacked on a
  leading trial axis (``jax.vmap(models.as_hmm)`` of
  :func:`models.random_models` for the exact backbone, or
  :func:`pretrain.load_trials`' params); ``datas[k][s]`` and ``keys[k][s]``
  are trial ``k``'s task ``s`` (S the same for every trial). Returns
  ``records[k][s]`` and the tunable params stacked ``[K, S, ...]``; trial
  ``k``'s task ``s`` gets what :func:`tune` gives it alone.
  """
  k = jax.tree.leaves(bparams_K)[0].shape[0]
  if k != len(datas) or k != len(keys):
    raise ValueError(f"backbone params for {k} trials, {len(datas)} trials "
                     f"of datasets and {len(keys)} of keys")
  per_trial = {len(d) for d in datas} | {len(kk) for kk in keys}
  if len(per_trial) != 1 or 0 in per_trial:
    raise ValueError(f"every trial needs the same number (>= 1) of tasks "
                     f"and keys, got {[len(d) for d in datas]} datasets and "
                     f"{[len(kk) for kk in keys]} keys")
  tunable, losses, accs, seconds, steps = _tune_lanes(
      _run_trials, jnp.stack([jnp.stack(list(kk)) for kk in keys]), backbone,
      bparams_K, stack_data([stack_data(d) for d in datas]), cfg)
  n = len(datas[0])
  return [[_record(cfg, {s: a[i, j] for s, a in accs.items()}, losses[i, j],
                   steps, seconds, k * n) for j in range(n)]
          for i in range(k)], tunable
