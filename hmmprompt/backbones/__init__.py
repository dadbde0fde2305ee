"""Frozen backbones: the black box ``G`` / ``G-bar`` of paper Section 2.

A static :class:`Backbone` (pure functions and sizes, a hashable ``jit`` static
argument) plus a params pytree that tuning never differentiates: ``embed(params,
tokens [T]) -> [T, D]`` (``hmm.MASK`` a valid token); ``apply(params, embeddings
[T', D]) -> [T', V]``, a distribution over the ``V`` real symbols per position
(a soft prompt: ``P`` rows prepended); optionally ``apply_at(params, embeddings,
i) -> [V]``, row ``i`` (static) of ``apply``, the others skipped where it can;
``prompt_embedding(raw [P, D]) -> [P, D]``, raw prompt parameters to valid
embeddings, and ``prompt_raw``, its inverse (a token's embedding as a prompt
vector); ``finetunable``: every params leaf is free (a transformer's, not the
exact backbone's stochastic matrices)."""

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
  apply_at: Callable[[Params, jax.Array, int], jax.Array] | None = None
  prompt_raw: Callable[[jax.Array], jax.Array] = lambda raw: raw

  def inputs(self, params: Params, tokens_T: jax.Array,
             prompt_raw_PxD: jax.Array | None = None) -> jax.Array:
    """``embeddings [P+T, D]``: the prompt's, then the tokens'."""
    emb_TxD = self.embed(params, tokens_T)
    if prompt_raw_PxD is None:
      return emb_TxD
    prompt_PxD = self.prompt_embedding(prompt_raw_PxD).astype(emb_TxD.dtype)
    return jax.numpy.concatenate([prompt_PxD, emb_TxD], axis=0)

  def outputs(self, params: Params, tokens_T: jax.Array,
              prompt_raw_PxD: jax.Array | None = None):
    """``(G [P+T, V], embeddings [P+T, D])`` with the prompt prepended."""
    emb_TxD = self.inputs(params, tokens_T, prompt_raw_PxD)
    return self.apply(params, emb_TxD), emb_TxD

  def output_at(self, params: Params, tokens_T: jax.Array,
                prompt_raw_PxD: jax.Array | None, index: int) -> jax.Array:
    """``G [V]`` at input position ``index`` (static) of :meth:`outputs`."""
    emb_TxD = self.inputs(params, tokens_T, prompt_raw_PxD)
    if self.apply_at is None:
      return self.apply(params, emb_TxD)[index]
    return self.apply_at(params, emb_TxD, index)
