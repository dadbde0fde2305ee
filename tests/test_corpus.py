"""hmmprompt.corpus: pretraining text and BERT masking."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import pretrain
from hmmprompt.backbones import transformer
from hmmprompt.pretrain import train as pretrain_train

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
  # Jitted, as the loop runs it (a traced int32 step), an epoch is still
  # one permutation far out: the last epoch below 2^25 (float32 would
  # round its last step's epoch up, 2^25 - 1 being odd).
  jitted = jax.jit(corpus_lib.batch_at, static_argnums=(4, 5, 6))
  last = [tuple(r) for step in range(2**25 - 4, 2**25) for r in np.asarray(
      jitted(jax.random.PRNGKey(2), jnp.int32(step), model, chunks, cfg, 2,
             10)[1])]
  assert sorted(last) == sorted(tuple(r) for r in np.asarray(chunks))





def _corruption_lik(inputs, selected, xs, v, bert):
  """``P(x~ | x, S)`` of one true sequence ``xs``, position by position."""
  lik = 1.0
  for i, x in enumerate(xs):
    if not selected[i]:
      lik *= float(inputs[i] == x)
    elif inputs[i] == hmm_lib.MASK:
      lik *= 0.8 if bert else 1.0
    else:  # BERT's random (10%, any symbol) or kept (10%) token
      lik *= 0.1 / v + 0.1 * (inputs[i] == x)
  return lik


def _sequence_posterior(model, inputs, selected, bert):
  """Every true sequence ``[N, T]`` and ``P(x | x~, S)``, by enumerating
  state paths (float64)."""
  init, trans, emit = (np.asarray(a, np.float64) for a in model)
  h, v = emit.shape
  t = len(inputs)
  seqs = np.array(list(itertools.product(range(v), repeat=t)))
  paths = np.array(list(itertools.product(range(h), repeat=t)))
  weights = []
  for xs in seqs:
    p_paths = init[paths[:, 0]] * emit[paths[:, 0], xs[0]]
    for i in range(1, t):
      p_paths = p_paths * trans[paths[:, i - 1], paths[:, i]] * emit[
          paths[:, i], xs[i]]
    weights.append(p_paths.sum() * _corruption_lik(inputs, selected, xs, v,
                                                   bert))
  weights = np.array(weights)
  return seqs, weights / weights.sum()


def _brute_force_targets(model, inputs, selected, bert):
  """``[T, V]``: ``P[X_t | x~, S]`` from :func:`_sequence_posterior`."""
  seqs, weights = _sequence_posterior(model, inputs, selected, bert)
  v = model.emission.shape[1]
  return np.einsum("n,ntv->tv", weights, np.eye(v)[seqs])


@pytest.fixture(scope="module")
def tiny_hmm():
  # Not near-deterministic, so every corruption changes the targets.
  return hmm_lib.random_hmm(jax.random.PRNGKey(7), 3, 4, transition_temp=1.0,
                            emission_temp=1.0)


# Positions: unselected, MASK, a replaced/kept symbol, unselected, MASK.
_INPUTS = np.array([2, hmm_lib.MASK, 1, 3, hmm_lib.MASK])
_SELECTED = np.array([0, 1, 1, 0, 1], np.float32)


# Every kernel (hmm.METHODS): the associative and blocked scans agree with
# the scan to ~H log2(T) and ~H sqrt(T) eps (tests/test_hmm.py), far
# inside the 2e-6 used here at T = 5.
# Jitted as the pretraining step calls them: eagerly, op by op, each
# primitive is a program (the associative scan's: ~120 a call).
_exact_targets = jax.jit(corpus_lib.exact_targets, static_argnums=3)
_exact_states = jax.jit(corpus_lib.exact_state_posterior, static_argnums=3)
_KERNELS = pytest.mark.parametrize("method",
                                   ["sequential", "parallel", "blocked"])


def test_exact_targets_run_the_method_they_are_given(tiny_hmm, kernels_run):
  """The kernel named (the scan by default), and under x64 the HMM's dtype:
  a float32 HMM's targets stay float32, a float64 HMM's are float64."""
  args = (tiny_hmm, jnp.asarray(_INPUTS), jnp.asarray(_SELECTED))
  for fn in (corpus_lib.exact_targets, corpus_lib.exact_state_posterior):
    for method in ("parallel", "blocked", None):
      kernels_run.clear()
      jax.eval_shape(lambda: fn(*args) if method is None else fn(*args,
                                                                  method))
      assert kernels_run == [method or "sequential"], (fn.__name__, method)
    with jax.enable_x64(True):
      for dtype in (jnp.float32, jnp.float64):
        hmm = jax.tree.map(lambda a: jnp.asarray(a, dtype), tiny_hmm)
        assert jax.eval_shape(lambda: fn(hmm, *args[1:])).dtype == dtype
  # ... and computed in float64 throughout: enumeration's values to ~T H
  # eps of float64 (a float32 step anywhere would leave ~1e-8).
  with jax.enable_x64(True):
    hmm64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tiny_hmm)
    got = jax.jit(corpus_lib.exact_targets)(hmm64, *args[1:])
  np.testing.assert_allclose(got, _brute_force_targets(
      tiny_hmm, _INPUTS, _SELECTED, bert=True), rtol=0, atol=1e-12)


@_KERNELS
def test_exact_targets_equal_brute_force(tiny_hmm, method):
  got = _exact_targets(tiny_hmm, jnp.asarray(_INPUTS), jnp.asarray(_SELECTED),
                       method)
  want = _brute_force_targets(tiny_hmm, _INPUTS, _SELECTED, bert=True)
  np.testing.assert_allclose(got, want, atol=2e-6)
  # The symbol at position 2 is informative but not certain.
  assert 0.3 < float(got[2, 1]) < 0.99
  masked = _INPUTS.copy()
  masked[2] = hmm_lib.MASK
  got_masked = _exact_targets(tiny_hmm, jnp.asarray(masked),
                              jnp.asarray(_SELECTED), method)
  np.testing.assert_allclose(
      got_masked, _brute_force_targets(tiny_hmm, masked, _SELECTED, False),
      atol=2e-6)
  assert np.abs(np.asarray(got_masked[2]) - np.asarray(got[2])).max() > 0.05
  # MASK-only corruption: the exact MLM conditionals of the masked input.
  sel = _SELECTED > 0
  np.testing.assert_allclose(got_masked[sel],
                             hmm_lib.conditionals(tiny_hmm, masked)[sel],
                             atol=1e-6)


def _brute_force_states(model, inputs, selected, bert):
  """``[T, H]``: ``P[H_t | x~, S]``, enumerating every state path and true
  sequence jointly (float64)."""
  init, trans, emit = (np.asarray(a, np.float64) for a in model)
  h, v = emit.shape
  t = len(inputs)
  post = np.zeros((t, h))
  for xs in itertools.product(range(v), repeat=t):
    lik = _corruption_lik(inputs, selected, xs, v, bert)
    if lik == 0:
      continue
    for path in itertools.product(range(h), repeat=t):
      p = init[path[0]] * emit[path[0], xs[0]]
      for i in range(1, t):
        p *= trans[path[i - 1], path[i]] * emit[path[i], xs[i]]
      for i in range(t):
        post[i, path[i]] += p * lik
  return post / post.sum(-1, keepdims=True)


@_KERNELS
def test_exact_state_posterior_equals_brute_force(tiny_hmm, method):
  """The state loss's target, with a kept-or-replaced symbol, MASKs and
  unselected tokens; MASK-only corruption is the smoothing posterior of
  the masked input."""
  got = _exact_states(tiny_hmm, jnp.asarray(_INPUTS), jnp.asarray(_SELECTED),
                      method)
  want = _brute_force_states(tiny_hmm, _INPUTS, _SELECTED, bert=True)
  np.testing.assert_allclose(got, want, atol=2e-6)
  masked = _INPUTS.copy()
  masked[2] = hmm_lib.MASK
  got_masked = _exact_states(tiny_hmm, jnp.asarray(masked),
                             jnp.asarray(_SELECTED), method)
  np.testing.assert_allclose(
      got_masked, _brute_force_states(tiny_hmm, masked, _SELECTED, False),
      atol=2e-6)
  assert np.abs(np.asarray(got_masked[2]) - np.asarray(got[2])).max() > 0.01
  np.testing.assert_allclose(got_masked, hmm_lib.posterior(
      tiny_hmm, jnp.asarray(masked)), atol=1e-6)


@pytest.mark.slow
def test_exact_target_gradient_is_mean_of_sampled_gradients(tiny_hmm):
  """Cross-entropy to the exact targets has the expected gradient of the
  sampled-target loss over draws of the true tokens given the corrupted
  input (Monte Carlo), while a target that ignores BERT's corruption noise
  (the MASK-only conditionals) does not."""
  v = 4
  model_cfg = dataclasses.replace(TINY.model, vocab_size=v, max_len=8)
  params = transformer.init_params(jax.random.PRNGKey(0), model_cfg)
  seqs, weights = _sequence_posterior(tiny_hmm, _INPUTS, _SELECTED, True)
  draws = seqs[np.random.default_rng(0).choice(len(seqs), 4000, p=weights)]
  inputs_1xT = jnp.asarray(_INPUTS)[None]
  weights_1xT = jnp.asarray(_SELECTED)[None]
  grad = jax.jit(lambda t: jax.grad(pretrain_train.mlm_loss)(
      params, model_cfg, inputs_1xT, t, weights_1xT))
  flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
  # One gradient per sampled sequence (integer targets), averaged.
  per_draw = jax.jit(jax.vmap(lambda d: grad(d[None])))(
      jnp.asarray(draws, jnp.int32))
  mc = flat(jax.tree.map(lambda g: g.mean(0), per_draw))
  exact = flat(grad(_exact_targets(tiny_hmm, inputs_1xT[0],
                                    weights_1xT[0])[None]))
  naive_t = hmm_lib.conditionals(
      tiny_hmm, np.where(_SELECTED > 0, hmm_lib.MASK, _INPUTS))
  naive = flat(grad(naive_t[None]))
  scale = np.linalg.norm(mc)
  err_exact = np.linalg.norm(exact - mc) / scale
  err_naive = np.linalg.norm(naive - mc) / scale
  print(f"relative error: exact {err_exact:.4f}, naive {err_naive:.4f}")
  assert err_exact < 0.05, err_exact
  assert err_naive > 3 * err_exact, (err_naive, err_exact)


@_KERNELS
def test_exact_targets_of_an_impossible_input_are_zero_rows(method):
  """Symbol 2 is never emitted: an input that shows it has probability 0,
  and its targets are zero rows (no NaN from 0 / 0), while the same input
  with a possible symbol there gets distributions."""
  hmm = hmm_lib.HMM(initial=jnp.array([0.5, 0.5]),
                    transition=jnp.array([[0.9, 0.1], [0.2, 0.8]]),
                    emission=jnp.array([[0.6, 0.4, 0.0], [0.3, 0.7, 0.0]]))
  selected = jnp.array([0.0, 1.0, 0.0, 0.0])
  got = _exact_targets(hmm, jnp.array([0, hmm_lib.MASK, 2, 1]), selected,
                       method)
  np.testing.assert_array_equal(np.asarray(got), 0.0)
  possible = _exact_targets(hmm, jnp.array([0, hmm_lib.MASK, 1, 1]),
                            selected, method)
  np.testing.assert_allclose(np.asarray(possible).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("field,value,match", [
    ("corruption", "drop", r"^CorpusConfig.corruption must be one of "
     r"\('bert', 'mask'\), got 'drop'$"),
    ("num_seqs", 0, r"^CorpusConfig.num_seqs must be >= 1, got 0$"),
    ("seq_len", 0, r"^CorpusConfig.seq_len must be >= 1, got 0$"),
    ("chunk_len", 0, r"^CorpusConfig.chunk_len must be >= 1, got 0$"),
    ("val_seqs", 0, r"^CorpusConfig.val_seqs must be >= 1, got 0$"),
    ("mask_rate", 0.0, r"^CorpusConfig.mask_rate must be in \(0, 1\), "
     r"got 0.0$"),
    ("mask_rate", 1.0, r"^CorpusConfig.mask_rate must be in \(0, 1\), "
     r"got 1.0$"),
    ("train_mask_rate", -0.1, r"^CorpusConfig.train_mask_rate must be in "
     r"\[0, 1\), got -0.1$"),
    ("train_mask_rate", 1.0, r"^CorpusConfig.train_mask_rate must be in "
     r"\[0, 1\), got 1.0$"),
    ("seq_len", 16, r"^CorpusConfig.seq_len = 16 is shorter than "
     r"chunk_len = 32$"),
])
def test_malformed_corpus_config_is_named(field, value, match):
  base = corpus_lib.CorpusConfig(num_seqs=4, seq_len=64, chunk_len=32)
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(base, **{field: value})


def test_corpus_config_edges_are_accepted():
  base = corpus_lib.CorpusConfig(num_seqs=3, seq_len=100, chunk_len=32)
  assert base.num_chunks == 3 * 3  # whole chunks only: 100 // 32
  # The rates' open and half-open ends, and one chunk per sequence.
  for kw in ({"mask_rate": 1e-6}, {"mask_rate": 1 - 1e-6},
             {"train_mask_rate": 0.0}, {"train_mask_rate": 1 - 1e-6},
             {"seq_len": 32}, {"corruption": "mask"},
             {"num_seqs": 1, "val_seqs": 1},
             # Fresh text has no fixed sequences to chunk.
             {"fresh": True, "seq_len": 1}):
    assert dataclasses.replace(base, **kw)
  assert corpus_lib.CorpusConfig().num_chunks == 5000 * 20  # the paper's


def test_bert_replacements_are_uniform_over_every_symbol():
  # 20 000 selections, 10% of them a uniform symbol: ~200 per symbol.
  toks = jnp.full((400, 500), 3, jnp.int32)
  inputs, weights = jax.jit(corpus_lib.mask_tokens, static_argnums=(2, 3))(
      jax.random.PRNGKey(5), toks, 0.1, 10)
  sel = np.asarray(inputs)[np.asarray(weights) > 0]
  counts = np.bincount(sel[sel != hmm_lib.MASK], minlength=10)
  assert len(counts) == 10  # nothing outside [0, V) but MASK
  n = counts[np.arange(10) != 3].sum() * 10 / 9  # the random ones, all V
  # Each symbol ~ Binomial(n, 1/10): within 5 SDs (symbol 3 also gets the
  # kept tenth, ~n).
  sd = np.sqrt(n * 0.1 * 0.9)
  others = np.delete(counts, 3)
  assert np.all(np.abs(others - n / 10) < 5 * sd), counts
  assert abs(counts[3] - n / 10 - n) < 5 * np.sqrt(2 * n), counts


@pytest.mark.parametrize("corruption", ["bert", "mask"])
def test_training_batches_use_the_configured_corruption(corruption):
  model = hmm_lib.random_hmm(jax.random.PRNGKey(3), 4, 10)
  cfg = dataclasses.replace(TINY.corpus, corruption=corruption, fresh=True)
  inputs, targets, weights = jax.jit(
      corpus_lib.batch_at, static_argnums=(4, 5, 6))(
          jax.random.PRNGKey(2), jnp.int32(0), model, None, cfg, 64, 10)
  sel = np.asarray(weights) > 0
  shown = np.asarray(inputs)[sel] != hmm_lib.MASK
  assert sel.sum() > 200
  if corruption == "mask":
    assert not shown.any()
  else:  # 20% of the selected show a symbol: far from 0 at this count
    assert 0.1 < shown.mean() < 0.3
  np.testing.assert_array_equal(np.asarray(inputs)[~sel],
                                np.asarray(targets)[~sel])
