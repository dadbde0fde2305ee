"""Pretraining text from an HMM, and BERT masking (Appendix D).

Two sources, both deterministic given a key and the step:

* a fixed corpus (the paper: 5000 sequences of 10 240 tokens, chunked to the
  context length), visited in epochs with a new permutation per epoch;
* ``fresh`` sampling (small CPU presets): every step draws new sequences of
  the context length from the HMM. No epoch structure and no overfitting; it
  is the limit of an unbounded corpus.

Masking: each position is selected with probability ``mask_rate``; selected
positions become ``MASK`` (80%), a uniformly random symbol (10%) or stay
(10%), as BERT. Evaluation masks with ``MASK`` only, so the Bayes-optimal
prediction is exactly :func:`hmm.conditionals` of the masked input.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hmmprompt import hmm as hmm_lib
from hmmprompt import models
from hmmprompt import validation


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
  num_seqs: int = 5000
  seq_len: int = 10240
  chunk_len: int = 512
  mask_rate: float = 0.05
  fresh: bool = False
  val_seqs: int = 64

  def __post_init__(self):
    validation.require_positive(self, "num_seqs", "seq_len", "chunk_len",
                                "val_seqs")
    if not 0 < self.mask_rate < 1:
      raise ValueError(f"CorpusConfig.mask_rate must be in (0, 1), got "
                       f"{self.mask_rate}")
    if not self.fresh and self.seq_len < self.chunk_len:
      raise ValueError(f"CorpusConfig.seq_len = {self.seq_len} is shorter "
                       f"than chunk_len = {self.chunk_len}")

  @property
  def num_chunks(self) -> int:
    return self.num_seqs * (self.seq_len // self.chunk_len)


@functools.partial(jax.jit, static_argnums=(2, 3))
def sample_sequences(key, model, num: int, length: int) -> jax.Array:
  """``[num, length]`` int32 sequences, each from the initial distribution."""
  return jax.vmap(lambda k: models.sample_tokens(k, model, length))(
      jax.random.split(key, num))


def build_chunks(key, model, cfg: CorpusConfig) -> jax.Array:
  """The fixed corpus as ``[num_chunks, chunk_len]`` chunks."""
  per = cfg.seq_len // cfg.chunk_len
  tokens = sample_sequences(key, model, cfg.num_seqs, per * cfg.chunk_len)
  return tokens.reshape(cfg.num_chunks, cfg.chunk_len)


def mask_tokens(key, tokens_BxT, mask_rate: float, vocab_size: int,
                bert: bool = True):
  """``(inputs [B, T], weights [B, T])``; weights mark predicted positions."""
  k_sel, k_kind, k_rand = jax.random.split(key, 3)
  selected = jax.random.bernoulli(k_sel, mask_rate, tokens_BxT.shape)
  if bert:
    u = jax.random.uniform(k_kind, tokens_BxT.shape)
    random_tok = jax.random.randint(k_rand, tokens_BxT.shape, 0, vocab_size)
    replaced = jnp.where(u < 0.8, hmm_lib.MASK,
                         jnp.where(u < 0.9, random_tok, tokens_BxT))
  else:
    replaced = jnp.full_like(tokens_BxT, hmm_lib.MASK)
  inputs = jnp.where(selected, replaced, tokens_BxT)
  return inputs.astype(jnp.int32), selected.astype(jnp.float32)


def batch_at(key, step, model, chunks, cfg: CorpusConfig, batch_size: int,
             vocab_size: int):
  """The training batch of ``step``: ``(inputs, targets, weights)``.

  A pure function of ``(key, step)``, so a resumed run sees the same data.
  ``chunks`` is ``None`` in fresh mode.
  """
  k_steps, k_epochs = jax.random.split(key)
  k_data, k_mask = jax.random.split(jax.random.fold_in(k_steps, step))
  if cfg.fresh:
    targets = sample_sequences(k_data, model, batch_size, cfg.chunk_len)
  else:
    n = chunks.shape[0]
    steps_per_epoch = n // batch_size
    epoch = step // steps_per_epoch
    perm = jax.random.permutation(jax.random.fold_in(k_epochs, epoch), n)
    start = (step % steps_per_epoch) * batch_size
    targets = chunks[jax.lax.dynamic_slice(perm, (start,), (batch_size,))]
  inputs, weights = mask_tokens(k_mask, targets, cfg.mask_rate, vocab_size)
  return inputs, targets, weights
