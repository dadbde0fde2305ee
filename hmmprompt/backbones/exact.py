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
from hmmprompt import generative
from hmmprompt.backbones import Backbone

# Module-level functions (not closures), so that every exact backbone of
# one size is the same static jit argument and tuning compiles once.
BACKBONE_NAME = "exact"


def make(model: generative.Model) -> tuple[Backbone, hmm_lib.HMM]:
  """``(backbone, params)`` for an ``HMM`` or a single-cell ``MemoryHMM``.

  ``embed`` is :func:`hmm.token_evidence`, ``apply`` is
  :func:`hmm.evidence_conditionals`; ``params`` is the (product-state) HMM.
  """
  hmm = generative.as_hmm(model)
  backbone = Backbone(name=BACKBONE_NAME, embed=hmm_lib.token_evidence,
                      apply=hmm_lib.evidence_conditionals,
                      prompt_embedding=jax.nn.sigmoid,
                      embed_dim=hmm.num_states, vocab_size=hmm.vocab_size)
  return backbone, hmm
