"""Frozen backbones: the black box ``G`` / ``G-bar`` of paper Section 2.

A backbone is a static :class:`Backbone` (pure functions and sizes, hashable,
safe as a ``jit`` static argument) plus a params pytree that tuning passes
around but never differentiates:

* ``embed(params, tokens [T]) -> [T, D]``: input embeddings; ``MASK``
  (= ``hmm.MASK``) is a valid token everywhere.
* ``apply(params, embeddings [T', D]) -> [T', V]``: per-position distribution
  over the ``V`` real symbols. A soft prompt is ``P`` extra rows prepended.
* ``prompt_embedding(raw [P, D]) -> [P, D]``: maps unconstrained prompt
  parameters to valid input embeddings (a sigmoid for the exact backbone,
  whose inputs must lie in ``[0, 1]^H``; the identity for a transformer).
* ``finetunable``: whether every params leaf is a free real parameter, so
  full fine-tuning may update them (not the exact backbone's stochastic
  matrices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

Params = Any


@dataclasses.dataclass(frozen=True)
class Backbone:
  name: str
  embed: Callable[[Params, jax.Array], jax.Array]
  apply: Callable[[Params, jax.Array], jax.Array]
  prompt_embedding: Callable[[jax.Array], jax.Array]
  embed_dim: int
  vocab_size: int
  finetunable: bool = False

  # Optional: ``apply_at(params, embeddings [T', D], i) -> [V]``, row ``i``
  # of ``apply`` (``i`` static) computed without the other rows where the
  # backbone can skip them (a transformer's last block: its keys and values
  # still read every position).
  apply_at: Callable[[Params, jax.Array, int], jax.Array] | None = None

  def inputs(self, params: Params, tokens_T: jax.Array,
             prompt_raw_PxD: jax.Array | None = None) -> jax.Array:
    """``embeddings [P+T, D]``: the prompt's, then the tokens'."""
    emb_TxD = self.embed(params, tokens_T)
    if prompt_raw_PxD is None:
      return emb_TxD
    return jax.numpy.concatenate(
        [self.prompt_embedding(prompt_raw_PxD).astype(emb_TxD.dtype),
         emb_TxD], axis=0)

  def outputs(self, params: Params, tokens_T: jax.Array,
              prompt_raw_PxD: jax.Array | None = None):
    """``(G [P+T, V], embeddings [P+T, D])`` with the prompt prepended."""
    emb_TxD = self.inputs(params, tokens_T, prompt_raw_PxD)
    return self.apply(params, emb_TxD), emb_TxD

  def output_at(self, params: Params, tokens_T: jax.Array,
                prompt_raw_PxD: jax.Array | None, index: int) -> jax.Array:
    """``G [V]`` at input position ``index`` (static) of
    :meth:`outputs`."""
    emb_TxD = self.inputs(params, tokens_T, prompt_raw_PxD)
    if self.apply_at is None:
      return self.apply(params, emb_TxD)[index]
    return self.apply_at(params, emb_TxD, index)
