"""The exact backbone: perfect pretraining (paper Section 3.1, Appendix B).

Embeddings are ``e(x) = P[X = x | H]`` (all ones for ``MASK``); ``apply`` is
Appendix B's message passing, ``W τ_t / ||τ_t||_1``. A memory HMM runs as
its product-state HMM (``D = |M||H|``). Soft prompts go through a sigmoid
into ``[0, 1]^H`` ("fake tokens", Section 3.1)."""

import jax

from hmmprompt import hmm as hmm_lib
from hmmprompt import generative
from hmmprompt.backbones import Backbone

# Module-level functions (not closures): every exact backbone of one size is
# the same static jit argument, so tuning compiles once.
BACKBONE_NAME = "exact"


def make(model: generative.Model) -> tuple[Backbone, hmm_lib.HMM]:
  """``(backbone, params)`` for an ``HMM`` or a single-cell ``MemoryHMM``:
  :func:`hmm.token_evidence` and :func:`hmm.evidence_conditionals` on the
  (product-state) HMM, ``params``."""
  hmm = generative.as_hmm(model)
  return _backbone(hmm), hmm


def make_stacked(models_K: generative.Model) -> tuple[Backbone, hmm_lib.HMM]:
  """``(backbone, params_K)``: :func:`make` per trial, stacked ``[K, ...]``."""
  hmms_K = jax.vmap(generative.as_hmm)(models_K)
  return _backbone(hmms_K), hmms_K


def evidence_raw(evidence_PxH: jax.Array) -> jax.Array:
  """The sigmoid's inverse: raw prompt entries of evidence vectors, clipped
  to ``[1e-3, 1 - 1e-3]``: a 0 or 1 has no finite preimage, and at 1e-6 the
  gradient of a memory HMM's messages overflowed (NaN)."""
  return jax.scipy.special.logit(jax.numpy.clip(evidence_PxH, 1e-3, 1 - 1e-3))


def _backbone(hmm: hmm_lib.HMM) -> Backbone:
  return Backbone(name=BACKBONE_NAME, embed=hmm_lib.token_evidence,
                  apply=hmm_lib.evidence_conditionals,
                  prompt_embedding=jax.nn.sigmoid, embed_dim=hmm.num_states,
                  vocab_size=hmm.vocab_size, prompt_raw=evidence_raw)
