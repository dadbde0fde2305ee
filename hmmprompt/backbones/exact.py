"""The exact backbone: perfect pretraining (paper Section 3.1, Appendix B).

Embeddings are the proper embeddings ``e(x) = P[X = x | H]`` (a column of the
emission matrix; all ones for ``MASK``); ``apply`` is Appendix B's message
passing on embedding vectors, returning ``W τ_t / ||τ_t||_1``. A memory HMM
runs through its product-state HMM (``D = |M||H|``).

Soft prompts must lie in ``[0, 1]^H`` to be "fake tokens" (Section 3.1); the
raw prompt parameters are mapped through a sigmoid, so a Uniform[-0.5, 0.5]
initialisation gives vectors in ``[0.38, 0.62]^H``.
"""

from __future__ import annotations

import jax

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt.backbones import Backbone


def _embed(params: hmm_lib.HMM, tokens_T):
  return hmm_lib._embed_impl(params, tokens_T)


def _apply(params: hmm_lib.HMM, emb_TxH):
  return hmm_lib._conditionals_impl(params, emb_TxH)


def make(model) -> tuple[Backbone, hmm_lib.HMM]:
  """``(backbone, params)`` for an ``HMM`` or a single-cell ``MemoryHMM``."""
  if isinstance(model, memory_lib.MemoryHMM):
    model = memory_lib.to_hmm(model)
  if not isinstance(model, hmm_lib.HMM):
    raise TypeError(f"exact backbone needs an HMM or MemoryHMM, got "
                    f"{type(model).__name__}")
  backbone = Backbone(name="exact", embed=_embed, apply=_apply,
                      prompt_embedding=jax.nn.sigmoid,
                      embed_dim=model.num_states, vocab_size=model.vocab_size)
  return backbone, model
