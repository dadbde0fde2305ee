"""hmmprompt.corpus: pretraining text and BERT masking."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import pretrain

TINY = pretrain.preset_config("tiny")


def test_masking_statistics_and_determinism():
  model = hmm_lib.random_hmm(jax.random.PRNGKey(3), 6, 10)
  toks = jnp.zeros((400, 100), jnp.int32) + 3
  inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(0), toks, 0.15,
                                           10)
  w = np.asarray(weights).astype(bool)
  assert abs(w.mean() - 0.15) < 0.01
  sel = np.asarray(inputs)[w]
  assert abs(np.mean(sel == hmm_lib.MASK) - 0.8) < 0.02
  # 10% random (of which 1/10 equal 3 by chance) + 10% kept.
  assert abs(np.mean(sel == 3) - 0.11) < 0.02
  np.testing.assert_array_equal(np.asarray(inputs)[~w], 3)
  cfg = dataclasses.replace(TINY.corpus, fresh=False, num_seqs=4,
                            seq_len=64)
  chunks = corpus_lib.build_chunks(jax.random.PRNGKey(1), model, cfg)
  assert chunks.shape == (8, 32)
  seen = []
  for step in range(4):  # one epoch of 4 steps x 2 chunks
    a = corpus_lib.batch_at(jax.random.PRNGKey(2), step, model, chunks, cfg,
                            2, 10)
    b = corpus_lib.batch_at(jax.random.PRNGKey(2), step, model, chunks, cfg,
                            2, 10)
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)
    seen += [tuple(r) for r in np.asarray(a[1])]
  assert sorted(seen) == sorted(tuple(r) for r in np.asarray(chunks))


