"""The batches of a stacked pretraining run: keys, draws, groups of trials."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import corpus as corpus_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.pretrain import train
from hmmprompt.pretrain.config import PretrainConfig


class Keys(NamedTuple):
  """Random streams ``[K, 2]``: run ``k``'s ``split(PRNGKey(seed + k), 4)``."""

  init: jax.Array  # model parameters
  data: jax.Array  # training batches and their masks (folded with the step)
  corpus: jax.Array  # the fixed corpus (non-fresh presets)
  val: jax.Array  # held-out evaluation sequences

  @classmethod
  def of(cls, seed: int, num: int = 1) -> "Keys":
    return cls(*jnp.stack([jax.random.split(jax.random.PRNGKey(seed + k), 4)
                           for k in range(num)], axis=1))


def draw_K(corpus_cfg, batch_size: int, vocab_size: int, fresh: bool,
            causal: bool):
  """:func:`corpus.batch_at` vmapped over K trials (unjitted)."""
  return jax.vmap(functools.partial(corpus_lib.batch_at, cfg=corpus_cfg,
                                    batch_size=batch_size,
                                    vocab_size=vocab_size, causal=causal),
                  in_axes=(0, None, 0, None if fresh else 0))


@functools.lru_cache(maxsize=16)
def batch_fn(corpus_cfg, batch_size: int, vocab_size: int, fresh: bool,
              causal: bool, mesh):
  """The jitted ``[K]`` batch draw, kept across runs as the train step."""
  return jax.jit(draw_K(corpus_cfg, batch_size, vocab_size, fresh, causal),
                 out_shardings=sharding_lib.trial_batch_sharded(mesh))


@functools.lru_cache(maxsize=16)
def window_fn(cfg: PretrainConfig, window: int, fresh: bool, mesh):
  """The jitted draw of ``window`` steps' ``[K]`` batches ``[N, K, ...]``,
  bit for bit :func:`batch_fn`'s, exact targets (one scan) for tokens."""
  draw = draw_K(cfg.corpus, cfg.batch_size, cfg.model.vocab_size, fresh,
                 cfg.model.causal)
  targets = jax.vmap(jax.vmap(functools.partial(train.loss_targets, cfg)),
                     in_axes=(None, 0, 0, 0))
  def window_at(keys_K, first, models_K, chunks_K, hmms_K):
    steps_N = first + jnp.arange(window)
    inputs, tokens, weights = jax.vmap(draw, in_axes=(None, 0, None, None))(
        keys_K, steps_N, models_K, chunks_K)
    return inputs, targets(hmms_K, inputs, tokens, weights), weights
  return jax.jit(window_at,
                 out_shardings=sharding_lib.step_trial_batch_sharded(mesh))


@jax.jit
def step_of(window_N, i):
  """Step ``i``'s ``(inputs, targets, weights)`` of a window's draw."""
  return jax.tree.map(lambda x: x[i], window_N)


def groups(running: list[int], trials_per_vmap: int
            ) -> list[tuple[np.ndarray, int]]:
  """``(rows, n)`` per train-step call: groups of ``trials_per_vmap``, the
  last padded to a power of two (``n`` rows real), so few shapes compile."""
  if trials_per_vmap <= 1:
    return [(np.asarray(running), len(running))]
  out = []
  for i in range(0, len(running), trials_per_vmap):
    rows = running[i:i + trials_per_vmap]
    size = min(1 << (len(rows) - 1).bit_length(), trials_per_vmap)
    out.append((np.asarray(rows + [rows[0]] * (size - len(rows))), len(rows)))
  return out
