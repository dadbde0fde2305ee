"""hmmprompt.generative: one home for the two model kinds."""

import jax
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import generative


@pytest.fixture(scope="module")
def pair():
  vanilla = hmm_lib.random_hmm(jax.random.PRNGKey(0), 5, 6)
  memory = memory_lib.random_memory_hmm(jax.random.PRNGKey(1), 3, 2, 6)
  return vanilla, memory


def test_kind_sizes_and_as_hmm(pair):
  vanilla, memory = pair
  assert (generative.kind(vanilla), generative.kind(memory)) == ("vanilla", "memory")
  assert (generative.latent_size(vanilla), generative.latent_size(memory)) == (5, 3)
  assert generative.as_hmm(vanilla) is vanilla
  product = generative.as_hmm(memory)
  assert product.num_states == 6
  # hidden_size reads the shapes: as_hmm's states, stacked or not.
  for model in (vanilla, memory):
    want = generative.as_hmm(model).num_states
    assert generative.hidden_size(model) == want
    assert generative.hidden_size(generative.stack([model, model])) == want
  with pytest.raises(TypeError, match="expected an HMM or a MemoryHMM"):
    generative.kind(np.zeros(3))


def test_sample_tokens_matches_each_kinds_sampler(pair):
  vanilla, memory = pair
  key = jax.random.PRNGKey(5)
  np.testing.assert_array_equal(generative.sample_tokens(key, vanilla, 40),
                                hmm_lib.sample(key, vanilla, 40)[0])
  np.testing.assert_array_equal(generative.sample_tokens(key, memory, 40),
                                memory_lib.sample(key, memory, 40)[0])
  # Traceable: under jit + vmap it gives the same draws.
  keys = jax.random.split(key, 3)
  batch = jax.jit(jax.vmap(lambda k: generative.sample_tokens(k, memory, 40)))(
      keys)
  for i in range(3):
    np.testing.assert_array_equal(batch[i], generative.sample_tokens(
        keys[i], memory, 40))


def test_latent_posterior_is_that_of_the_first_position(pair):
  vanilla, memory = pair
  toks = generative.sample_tokens(jax.random.PRNGKey(2), vanilla, 12).at[0].set(
      hmm_lib.MASK)
  np.testing.assert_allclose(generative.latent_posterior(vanilla, toks),
                             hmm_lib.posterior(vanilla, toks)[0], atol=1e-6)
  toks = generative.sample_tokens(jax.random.PRNGKey(3), memory, 12).at[0].set(
      hmm_lib.MASK)
  # The memory's posterior is the product HMM's state posterior summed over
  # syntax states (an independent computation).
  post_K = hmm_lib.posterior(generative.as_hmm(memory), toks)[0]
  np.testing.assert_allclose(generative.latent_posterior(memory, toks),
                             post_K.reshape(3, 2).sum(-1), atol=1e-5)


def test_save_load_round_trip_fingerprint_and_errors(pair, tmp_path):
  for i, model in enumerate(pair):
    path = str(tmp_path / f"m{i}.npz")
    generative.save(path, model)
    back = generative.load(path)
    assert generative.same(back, model) and type(back) is type(model)
    assert generative.model_fingerprint(back) == generative.model_fingerprint(model)
  assert generative.model_fingerprint(pair[0]) != generative.model_fingerprint(pair[1])
  assert not generative.same(*pair)
  with pytest.raises(FileNotFoundError, match="no model file"):
    generative.load(str(tmp_path / "missing.npz"))
  np.savez(tmp_path / "odd.npz", kind=np.array("quantum"))
  with pytest.raises(ValueError, match="unknown kind 'quantum'"):
    generative.load(str(tmp_path / "odd.npz"))
  with pytest.raises(ValueError, match="model kind must be one of"):
    generative.random_model(jax.random.PRNGKey(0), "quantum", 3, 4)


@pytest.mark.parametrize("model_kind", [
    k if k == "vanilla" else pytest.param(k, marks=pytest.mark.slow)
    for k in generative.KINDS])
def test_stacked_trials_equal_separate_draws(model_kind):
  """K models drawn in one vmapped call are the K separate draws; sampling
  and latent posteriors vmapped over the trial axis equal the per-trial
  results (same keys)."""
  key = jax.random.PRNGKey(5)
  stacked = generative.random_models(key, 3, model_kind, 4, 6, memory_size=3)
  assert generative.num_trials(stacked) == 3 and generative.kind(stacked) == model_kind
  singles = [generative.random_model(jax.random.fold_in(key, k), model_kind, 4,
                                 6, 3) for k in range(3)]
  for k, single in enumerate(singles):
    assert generative.num_trials(single) is None
    assert generative.same(generative.trial(stacked, k), single)
  assert generative.same(generative.stack(singles), stacked)
  assert generative.fingerprints(stacked) == [generative.model_fingerprint(m)
                                          for m in singles]
  assert len(set(generative.fingerprints(stacked))) == 3
  # A stack of one is a trial count like any other (one trial per size).
  one = generative.random_models(key, 1, model_kind, 4, 6, memory_size=3)
  assert generative.num_trials(one) == 1
  assert generative.same(generative.trial(one, 0), singles[0])

  keys = jax.random.split(jax.random.PRNGKey(6), 3)
  tokens_KxT = jax.jit(jax.vmap(generative.sample_tokens, in_axes=(0, 0, None)),
                       static_argnums=2)(keys, stacked, 12)
  post_KxM = jax.jit(jax.vmap(generative.latent_posterior))(stacked, tokens_KxT)
  for k, single in enumerate(singles):
    np.testing.assert_array_equal(tokens_KxT[k],
                                  generative.sample_tokens(keys[k], single, 12))
    np.testing.assert_allclose(post_KxM[k],
                               generative.latent_posterior(single, tokens_KxT[k]),
                               atol=1e-6)


def test_stacking_errors_name_the_problem(pair):
  vanilla, memory = pair
  with pytest.raises(ValueError, match="trial count must be an int >= 1"):
    generative.random_models(jax.random.PRNGKey(0), 0, "vanilla", 4, 6)
  with pytest.raises(ValueError, match="model kind must be one of"):
    generative.random_models(jax.random.PRNGKey(0), 2, "vanila", 4, 6)
  # A memory model needs its memory size: neither call defaults one.
  with pytest.raises(ValueError, match="memory_size, num_states and vocab"):
    generative.random_models(jax.random.PRNGKey(0), 2, "memory", 4, 6)
  with pytest.raises(ValueError, match="memory_size, num_states and vocab"):
    generative.random_model(jax.random.PRNGKey(0), "memory", 4, 6)
  with pytest.raises(ValueError, match="at least one model"):
    generative.stack([])
  with pytest.raises(ValueError, match="different kinds"):
    generative.stack([vanilla, memory])
  other = hmm_lib.random_hmm(jax.random.PRNGKey(1),
                             vanilla.num_states + 1, vanilla.vocab_size)
  with pytest.raises(ValueError, match="different sizes: trial 0 .* trial 1"):
    generative.stack([vanilla, other])
  with pytest.raises(ValueError, match=r"fingerprints needs \[K\] stacked "
                     r"models; use fingerprint for one model"):
    generative.fingerprints(vanilla)
  with pytest.raises(ValueError, match="trial 2 out of range for 2 trials"):
    generative.trial(generative.stack([vanilla, vanilla]), 2)
  # A stack is validated per trial: one bad trial is named by its index.
  bad = generative.stack([vanilla, vanilla])
  bad_transition = np.array(bad.transition)
  bad_transition[1, 0, 0] += 0.5
  with pytest.raises(ValueError,
                     match=r"HMM.transition must sum to 1.*\[1, 0\]"):
    hmm_lib.HMM(bad.initial, bad_transition, bad.emission)
