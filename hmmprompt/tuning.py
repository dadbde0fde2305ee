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
output at the ``MASK`` position, index ``P``.

:func:`tune_many` runs independent seeds / tasks as one vmapped, compiled
program; each seed's result equals :func:`tune` on that seed alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hmmprompt import heads
from hmmprompt import tasks as tasks_lib
from hmmprompt import validation
from hmmprompt.backbones import Backbone

METHODS = ("head", "prompt", "finetune")


@dataclasses.dataclass(frozen=True)
class TuneConfig:
  """Downstream tuning (defaults: the paper, Appendix D).

  Attributes:
    method: ``"head"`` (frozen backbone, train the head), ``"prompt"``
      (train a soft prompt and the head) or ``"finetune"`` (train a copy of
      the backbone and the head).
    head: ``"linear"`` (on the ``MASK`` position) or ``"attention"``.
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
    if self.method not in METHODS:
      raise ValueError(f"TuneConfig.method must be one of {METHODS}, got "
                       f"{self.method!r}")
    if self.head not in heads.HEADS:
      raise ValueError(f"TuneConfig.head must be one of {heads.HEADS}, got "
                       f"{self.head!r}")
    if self.features not in heads.FEATURES:
      raise ValueError(f"TuneConfig.features must be one of "
                       f"{heads.FEATURES}, got {self.features!r}")
    validation.require_positive(self, "prompt_len", "epochs", "batch_size",
                                "eval_chunk")
    for name in ("lr", "backbone_lr"):
      if not getattr(self, name) > 0:
        raise ValueError(f"TuneConfig.{name} must be > 0, got "
                         f"{getattr(self, name)}")
    if not 0 <= self.warmup_frac < 1:
      raise ValueError("TuneConfig.warmup_frac must be in [0, 1)")
    if self.max_len is not None and self.max_len < self.num_prompt + 1:
      raise ValueError(f"TuneConfig.max_len = {self.max_len} leaves no room "
                       f"for the MASK after {self.num_prompt} prompt vectors")

  @property
  def num_prompt(self) -> int:
    return self.prompt_len if self.method == "prompt" else 0

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


def data_from_task(task: tasks_lib.Task, cfg: TuneConfig) -> Data:
  """Split arrays, truncated to ``cfg.max_len`` positions with the prompt."""
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
# Forward pieces.


def _backbone_inputs(backbone: Backbone, bparams, cfg: TuneConfig, prompt,
                     tokens_T):
  """``(G, emb)`` a head needs for one example (G at MASK for linear)."""
  probs_TxV, emb_TxD = backbone.outputs(bparams, tokens_T, prompt)
  if cfg.head == "linear":
    return probs_TxV[cfg.num_prompt], None
  return probs_TxV, emb_TxD


def _head_logits(cfg: TuneConfig, head_params, stats, inputs):
  g, emb = inputs
  feats = heads.transform(g, cfg.features, stats)
  if cfg.head == "linear":
    return heads.apply_linear(head_params, feats)
  return heads.apply_attention(head_params, feats, emb)


def _make_inputs_fn(backbone, cfg):
  """Example -> head inputs. Head tuning: the example *is* cached inputs."""
  if cfg.method == "head":
    return lambda tunable, bparams, example: example
  if cfg.method == "finetune":
    return lambda tunable, bparams, example: _backbone_inputs(
        backbone, tunable["backbone"], cfg, None, example)
  return lambda tunable, bparams, example: _backbone_inputs(
      backbone, bparams, cfg, tunable["prompt"], example)


def _cache(backbone, bparams, cfg, tokens_NxT):
  """Frozen-backbone head inputs for every example, computed once."""
  fn = lambda t: _backbone_inputs(backbone, bparams, cfg, None, t)
  return jax.lax.map(fn, tokens_NxT, batch_size=cfg.eval_chunk)


def _init_tunable(key, backbone: Backbone, bparams, cfg: TuneConfig,
                  seq_len: int):
  k_head, k_prompt = jax.random.split(key)
  total_len = cfg.num_prompt + seq_len
  if cfg.head == "linear":
    head = heads.init_linear(k_head, backbone.vocab_size)
  else:
    head = heads.init_attention(k_head, backbone.vocab_size,
                                backbone.embed_dim, total_len)
  tunable = {"head": head}
  if cfg.method == "finetune":
    tunable["backbone"] = bparams
  if cfg.method == "prompt":
    tunable["prompt"] = jax.random.uniform(
        k_prompt, (cfg.prompt_len, backbone.embed_dim),
        minval=-cfg.prompt_init, maxval=cfg.prompt_init)
  return tunable


def _run(key, bparams, data: Data, backbone: Backbone, cfg: TuneConfig):
  """One seed, end to end. Traceable; vmapped by :func:`tune_many`."""
  k_init, k_perm = jax.random.split(key)
  n, seq_len = data.train_tokens.shape
  tunable = _init_tunable(k_init, backbone, bparams, cfg, seq_len)
  inputs_fn = _make_inputs_fn(backbone, cfg)

  if cfg.method == "head":
    examples = {s: _cache(backbone, bparams, cfg, getattr(data, s + "_tokens"))
                for s in ("train", "val", "test")}
  else:
    examples = {s: getattr(data, s + "_tokens")
                for s in ("train", "val", "test")}

  stats = None
  if cfg.features == "standardized":
    g_train = jax.lax.map(lambda ex: inputs_fn(tunable, bparams, ex)[0],
                          examples["train"], batch_size=cfg.eval_chunk)
    stats = heads.feature_stats(g_train)

  def logits_fn(tunable, example):
    return _head_logits(cfg, tunable["head"], stats,
                        inputs_fn(tunable, bparams, example))

  def loss_fn(tunable, batch, labels_B):
    logits_BxC = jax.vmap(lambda ex: logits_fn(tunable, ex))(batch)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxC, labels_B).mean()

  steps_per_epoch = max(n // cfg.batch_size, 1)
  batch = min(cfg.batch_size, n)
  total = cfg.epochs * steps_per_epoch
  perms = jax.vmap(lambda e: jax.random.permutation(
      jax.random.fold_in(k_perm, e), n)[:steps_per_epoch * batch])(
          jnp.arange(cfg.epochs))
  idx_SxB = perms.reshape(total, batch)
  opt = optax.adam(_schedule(total, cfg))
  if cfg.method == "finetune":
    slow = optax.adam(_schedule(total, dataclasses.replace(
        cfg, lr=cfg.backbone_lr)))
    opt = optax.multi_transform(
        {"fast": opt, "slow": slow},
        lambda t: {k: jax.tree.map(lambda _, k=k: "slow" if k == "backbone"
                                   else "fast", v) for k, v in t.items()})

  def step(carry, idx_B):
    tunable, opt_state = carry
    batch_ex = jax.tree.map(lambda a: a[idx_B], examples["train"])
    loss, grads = jax.value_and_grad(loss_fn)(tunable, batch_ex,
                                              data.train_labels[idx_B])
    updates, opt_state = opt.update(grads, opt_state, tunable)
    return (optax.apply_updates(tunable, updates), opt_state), loss

  (tunable, _), losses = jax.lax.scan(step, (tunable, opt.init(tunable)),
                                      idx_SxB)

  def accuracy(split):
    preds = jax.lax.map(lambda ex: jnp.argmax(logits_fn(tunable, ex)),
                        examples[split], batch_size=cfg.eval_chunk)
    return jnp.mean(preds == getattr(data, split + "_labels"))

  accs = {s: accuracy(s) for s in ("train", "val", "test")}
  return tunable, losses, accs


_run_one = jax.jit(_run, static_argnums=(3, 4))
_run_many = jax.jit(jax.vmap(_run, in_axes=(0, None, 0, None, None)),
                    static_argnums=(3, 4))


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
  for name in ("train", "val", "test"):
    toks = getattr(data, name + "_tokens")
    labels = getattr(data, name + "_labels")
    if toks.ndim < 2 or labels.shape != toks.shape[:-1]:
      raise ValueError(f"{name} tokens [.., N, T] and labels [.., N] "
                       f"disagree: {toks.shape} vs {labels.shape}")


def _check_method(backbone: Backbone, cfg: TuneConfig):
  if cfg.method == "finetune" and not backbone.finetunable:
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


def tune_many(keys, backbone: Backbone, bparams, datas: Sequence[Data],
              cfg: TuneConfig) -> tuple[list[dict], Any]:
  """Tunes ``len(datas)`` seeds in one vmapped program on a shared backbone.

  Returns one record per seed and the stacked tunable params.
  """
  if len(keys) != len(datas):
    raise ValueError(f"{len(keys)} keys for {len(datas)} datasets")
  _check_method(backbone, cfg)
  data = stack_data(datas)
  _check_data(data)
  t0 = time.perf_counter()
  tunable, losses, accs = jax.block_until_ready(
      _run_many(jnp.stack(list(keys)), bparams, data, backbone, cfg))
  seconds = time.perf_counter() - t0
  steps = num_steps(data.train_tokens.shape[1], cfg)
  records = [
      _record(cfg, jax.tree.map(lambda a: a[i], accs), losses[i], steps,
              seconds, len(datas)) for i in range(len(datas))
  ]
  return records, tunable
