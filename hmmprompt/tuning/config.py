"""What a tuning run is: :class:`TuneConfig`, :data:`METHODS`, :class:`Data`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hmmprompt import identity as identity_lib
from hmmprompt import heads
from hmmprompt import tasks as tasks_lib
from hmmprompt import validation
from hmmprompt.backbones import Backbone
from hmmprompt.backbones import transformer

SPLITS = ("train", "val", "test")
OPTIMIZERS = ("adam", "lbfgs")
BACKBONE_DTYPES = ("float32", "bfloat16")
PROMPT_INITS = ("uniform", "tokens")


@dataclasses.dataclass(frozen=True)
class Method:
  """What a tuning method trains and how a head sees an example:
  ``init_extra(key, backbone, bparams, cfg, train_tokens [N, T])``, the
  tunable entries besides ``"head"``; ``head_inputs(backbone, bparams,
  tunable, cfg, tokens [T])``, ``(G, emb)`` (:func:`backbone_head_inputs`)."""

  name: str  # its key in :data:`METHODS`
  init_extra: Callable[..., dict]
  head_inputs: Callable[..., tuple]
  caches_features: bool = False  # ``head_inputs`` ignores ``tunable``: cached
  uses_prompt: bool = False  # inputs carry ``cfg.prompt_len`` prompt vectors
  slow_keys: frozenset = frozenset()  # tunable, trained at ``cfg.backbone_lr``
  needs_finetunable: bool = False  # a backbone of free params (a transformer)


@dataclasses.dataclass(frozen=True)
class TuneConfig:
  """Downstream tuning (defaults: the paper, Appendix D); each field says
  what it is on its line. ``optimizer="lbfgs"`` solves the head on cached
  features (:func:`optim.solve_lbfgs`), to the optimum for the convex
  linear head; ``lr``, ``warmup_*``, ``epochs`` and ``batch_size`` are then
  unused, and ``lbfgs_l2`` keeps separable features' optimum finite.
  ``backbone_dtype="bfloat16"`` (the ``gpu`` preset) runs a pretrained
  transformer in bfloat16, and nothing else; the exact backbone ignores it."""

  method: str = "head"  # a key of :data:`METHODS` (docs/adaptation.md)
  head: str = "linear"  # a key of :data:`hmmprompt.heads.HEADS`
  features: str = "raw"  # see :mod:`hmmprompt.heads`
  prompt_len: int = 20  # soft prompt vectors, or a prefix's positions
  prompt_init: float = 0.5  # uniform prompts: U[-prompt_init, prompt_init]
  lr: float = 0.01  # Adam's peak learning rate (paper: 0.01)
  backbone_lr: float = 1e-3  # fine-tuning's (0.01 would wreck the backbone)
  warmup_steps: int | None = None  # linear warmup, then decay to 0
  warmup_frac: float = 0.1  # of all steps, where ``warmup_steps`` is None
  epochs: int = 5  # passes over the training set (paper: 5)
  batch_size: int = 32  # examples per step (the paper does not say)
  max_len: int | None = None  # inputs cut to this, prompt included (None: no)
  eval_chunk: int = 250  # examples per chunk when computing accuracies
  # Added after results were keyed: out of identities at their defaults.
  optimizer: str = identity_lib.added("adam")  # "adam" (paper's) or "lbfgs"
  lbfgs_tol: float = identity_lib.added(1e-6)  # stop: gradient L2 norm below
  lbfgs_max_steps: int = identity_lib.added(500)  # at most this many steps
  lbfgs_l2: float = identity_lib.added(1e-4)  # :func:`optim.lbfgs_objective`
  backbone_dtype: str = identity_lib.added("float32")  # a transformer's compute
  prompt_init_mode: str = identity_lib.added("uniform")  # or "tokens" (PEFT's)
  lora_r: int = identity_lib.added(4)  # LoRA's rank; ``B`` starts at 0
  lora_alpha: float | None = identity_lib.added(None)  # scale alpha/r (None: 1)
  lora_targets: str = identity_lib.added("q,v")  # adapted, from q, k, v

  def __post_init__(self):
    validation.require_choices(
        self, backbone_dtype=BACKBONE_DTYPES, method=METHODS,
        head=heads.HEADS, features=heads.TRANSFORMS, optimizer=OPTIMIZERS,
        prompt_init_mode=PROMPT_INITS)
    targets = self.lora_targets.split(",")
    if set(targets) - {"q", "k", "v"} or len(set(targets)) < len(targets):
      raise ValueError(f"TuneConfig.lora_targets must name distinct "
                       f"projections from q,k,v, got {self.lora_targets!r}")
    validation.require(self, "lora_alpha", self.lora_alpha is None
                       or self.lora_alpha > 0, "> 0 or None")
    if self.optimizer == "lbfgs" and not METHODS[self.method].caches_features:
      cached = tuple(m for m, v in METHODS.items() if v.caches_features)
      raise ValueError(
          f"TuneConfig.optimizer='lbfgs' solves a head on cached features, but "
          f"method={self.method!r} does not cache them (it trains through the "
          f"backbone); use optimizer='adam' for it, or a method from {cached}")
    validation.require_positive(self, "prompt_len", "epochs", "batch_size",
                                "eval_chunk", "lbfgs_max_steps", "lora_r")
    validation.require(self, "lbfgs_l2", self.lbfgs_l2 >= 0, ">= 0")
    for name in ("lbfgs_tol", "lr", "backbone_lr"):
      validation.require(self, name, getattr(self, name) > 0, "> 0")
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
  def authors(cls, **overrides) -> TuneConfig:
    """The recipe of the authors' original fine-tuning scripts."""
    return cls(**{**dict(lr=0.01, warmup_steps=500, batch_size=128,
                         epochs=100, max_len=80), **overrides})


class Data(NamedTuple):
  """Arrays of one seed: ``tokens [N, T]`` and ``labels [N]`` per split
  (``[*L, N, T]`` and ``[*L, N]`` stacked over lanes ``L``)."""

  train_tokens: jax.Array
  train_labels: jax.Array
  val_tokens: jax.Array
  val_labels: jax.Array
  test_tokens: jax.Array
  test_labels: jax.Array

  def split(self, name: str) -> tuple[jax.Array, jax.Array]:
    """``(tokens, labels)`` of split ``name`` (one of :data:`SPLITS`)."""
    return getattr(self, name + "_tokens"), getattr(self, name + "_labels")


def data_from_task(task: tasks_lib.Task, cfg: TuneConfig) -> Data:
  """Split arrays, truncated to ``cfg.max_len`` positions with the prompt."""
  # Task tokens are (MASK, x_1, ...); keeping ``keep`` of them makes the
  # backbone input (prompt, MASK, x_1, ...) exactly ``max_len`` long.
  keep = None if cfg.max_len is None else cfg.max_len - cfg.num_prompt
  return Data(*(x for split in (task.train, task.val, task.test)
                for x in (jnp.asarray(split.tokens)[:, :keep], split.labels)))


def num_steps(num_train: int, cfg: TuneConfig) -> int:
  """Loss count: ``epochs`` x whole batches (Adam), or ``lbfgs_max_steps``."""
  if cfg.optimizer == "lbfgs":
    return cfg.lbfgs_max_steps
  return cfg.epochs * max(num_train // cfg.batch_size, 1)


def backbone_head_inputs(backbone: Backbone, params, cfg: TuneConfig,
                         tokens_T: jax.Array, prompt_raw_PxD=None):
  """What ``cfg.head`` reads of ``(prompt, MASK, x_1, ...)``: ``(G [P+T, V], emb
  [P+T, D])`` if all positions, else ``(G [V], None)`` at the ``MASK``."""
  if heads.HEADS[cfg.head].reads_all_positions:
    return backbone.outputs(params, tokens_T, prompt_raw_PxD)
  return backbone.output_at(params, tokens_T, prompt_raw_PxD,
                            tasks_lib.mask_index(cfg.num_prompt)), None


def _reading(params_of, prompt: bool = False) -> Callable[..., tuple]:
  """A :attr:`Method.head_inputs`: :func:`backbone_head_inputs` at params
  ``params_of(bparams, tunable, cfg)``, ``tunable["prompt"]`` if ``prompt``."""
  return lambda backbone, bparams, tunable, cfg, tokens_T: backbone_head_inputs(
      backbone, params_of(bparams, tunable, cfg), cfg, tokens_T,
      tunable["prompt"] if prompt else None)


def prompt_tokens(key, train_tokens_NxT: jax.Array, num: int) -> jax.Array:
  """``[num]`` tokens drawn uniformly from the training text's positions
  (the ``MASK`` before each example left out): ``"tokens"`` init's."""
  flat = train_tokens_NxT[..., 1:].reshape(-1)
  return flat[jax.random.randint(key, (num,), 0, flat.shape[0])]


def _init_prompt(key, backbone, bparams, cfg, train_tokens_NxT):
  if cfg.prompt_init_mode == "tokens":  # the raw entries of real tokens
    return {"prompt": backbone.prompt_raw(backbone.embed(
        bparams, prompt_tokens(key, train_tokens_NxT, cfg.prompt_len)))}
  return {"prompt": jax.random.uniform(
      key, (cfg.prompt_len, backbone.embed_dim), minval=-cfg.prompt_init,
      maxval=cfg.prompt_init)}


_frozen = lambda p, t, c: p  # nothing tunable before the head: cacheable


METHODS: dict[str, Method] = {
    "head": Method("head", init_extra=lambda *_: {},
                   head_inputs=_reading(_frozen), caches_features=True),
    "prompt": Method("prompt", init_extra=_init_prompt, uses_prompt=True,
                     head_inputs=_reading(_frozen, prompt=True)),
    "prefix": Method("prefix", init_extra=lambda key, _, bparams, cfg, __: {
        "prefix": transformer.prefix_init(key, bparams, cfg.prompt_len)},
                     head_inputs=_reading(lambda p, t, c: {**p, **t["prefix"]}),
                     needs_finetunable=True),
    "lora": Method("lora", init_extra=lambda key, _, bparams, cfg, __: {
        "lora": transformer.lora_init(key, bparams, cfg.lora_r,
                                      cfg.lora_targets.split(","))},
                   head_inputs=_reading(lambda p, t, c: transformer.with_lora(
                       p, t["lora"], (c.lora_alpha or c.lora_r) / c.lora_r)),
                   needs_finetunable=True),
    "finetune": Method(
        "finetune", init_extra=lambda key, _, bparams, *__: {"backbone": bparams},
        head_inputs=_reading(lambda p, t, c: t["backbone"]),
        slow_keys=frozenset({"backbone"}), needs_finetunable=True),
}
