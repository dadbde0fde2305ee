"""hmmprompt.models: one home for the two model kinds."""

import jax
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import models


@pytest.fixture(scope="module")
def pair():
  vanilla = hmm_lib.random_hmm(jax.random.PRNGKey(0), 5, 6)
  memory = memory_lib.random_memory_hmm(jax.random.PRNGKey(1), 3, 2, 6)
  return vanilla, memory


def test_kind_sizes_and_as_hmm(pair):
  vanilla, memory = pair
  assert (models.kind(vanilla), models.kind(memory)) == ("vanilla", "memory")
  assert (models.latent_size(vanilla), models.latent_size(memory)) == (5, 3)
  assert models.as_hmm(vanilla) is vanilla
  product = models.as_hmm(memory)
  assert product.num_states == 6
  with pytest.raises(TypeError, match="expected an HMM or a MemoryHMM"):
    models.kind(np.zeros(3))


def test_sample_tokens_matches_each_kinds_sampler(pair):
  vanilla, memory = pair
  key = jax.random.PRNGKey(5)
  np.testing.assert_array_equal(models.sample_tokens(key, vanilla, 40),
                                hmm_lib.sample(key, vanilla, 40)[0])
  np.testing.assert_array_equal(models.sample_tokens(key, memory, 40),
                                memory_lib.sample(key, memory, 40)[0])
  # Traceable: under jit + vmap it gives the same draws.
  keys = jax.random.split(key, 3)
  batch = jax.jit(jax.vmap(lambda k: models.sample_tokens(k, memory, 40)))(
      keys)
  for i in range(3):
    np.testing.assert_array_equal(batch[i], models.sample_tokens(
        keys[i], memory, 40))


def test_latent_posterior_is_that_of_the_first_position(pair):
  vanilla, memory = pair
  toks = models.sample_tokens(jax.random.PRNGKey(2), vanilla, 12).at[0].set(
      hmm_lib.MASK)
  np.testing.assert_allclose(models.latent_posterior(vanilla, toks),
                             hmm_lib.posterior(vanilla, toks)[0], atol=1e-6)
  toks = models.sample_tokens(jax.random.PRNGKey(3), memory, 12).at[0].set(
      hmm_lib.MASK)
  # The memory's posterior is the product HMM's state posterior summed over
  # syntax states (an independent computation).
  post_K = hmm_lib.posterior(models.as_hmm(memory), toks)[0]
  np.testing.assert_allclose(models.latent_posterior(memory, toks),
                             post_K.reshape(3, 2).sum(-1), atol=1e-5)


def test_save_load_round_trip_fingerprint_and_errors(pair, tmp_path):
  for i, model in enumerate(pair):
    path = str(tmp_path / f"m{i}.npz")
    models.save(path, model)
    back = models.load(path)
    assert models.same(back, model) and type(back) is type(model)
    assert models.fingerprint(back) == models.fingerprint(model)
  assert models.fingerprint(pair[0]) != models.fingerprint(pair[1])
  assert not models.same(*pair)
  with pytest.raises(FileNotFoundError, match="no model file"):
    models.load(str(tmp_path / "missing.npz"))
  np.savez(tmp_path / "odd.npz", kind=np.array("quantum"))
  with pytest.raises(ValueError, match="unknown kind 'quantum'"):
    models.load(str(tmp_path / "odd.npz"))
  with pytest.raises(ValueError, match="model kind must be one of"):
    models.random_model(jax.random.PRNGKey(0), "quantum", 3, 4)
