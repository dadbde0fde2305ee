"""hmmprompt.probes: the residual stream read without changing the model,
and affine probes checked on targets whose answer is known: exactly affine
(recovered), a stream built to hold the posterior (R² 1), shuffled (R²
near 0, within a derived bound), a stack of trials (each its own)."""

import jax
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import pretrain
from hmmprompt import probes
from hmmprompt.backbones import transformer


def _affine(seed, k=2, n=300, d=6, h=3):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(k, n, d))
  a, c = rng.normal(size=(k, d, h)), rng.normal(size=(k, 1, h))
  return x, x @ a + c, a, c


def test_an_exactly_affine_target_is_recovered():
  x, y, a, c = _affine(0)
  probe = probes.fit(x[:, :200], y[:, :200], x[:, 200:], y[:, 200:])
  np.testing.assert_allclose(probe.weight, a, atol=1e-9)
  np.testing.assert_allclose(probe.bias, c[:, 0], atol=1e-9)
  np.testing.assert_allclose(probes.r2(probe, x[:, 200:], y[:, 200:]), 1.0,
                             atol=1e-12)


def test_a_stream_holding_the_posterior_probes_to_r2_one():
  """The stream is an injective affine image of the exact posterior (3
  states in 8 dimensions): the probe finds the posterior itself, so R² is 1
  and the projected prediction is the posterior (TV 0, KL 0 up to the
  floor)."""
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(0), 3, 4)
  keys = jax.random.split(jax.random.PRNGKey(1), 240)
  tokens = jax.vmap(lambda k: hmm_lib.sample(k, hmm, 6)[0])(keys)
  post = np.asarray(jax.vmap(lambda t: hmm_lib.posterior(hmm, t))(tokens)[:, 3],
                    np.float64)[None]  # [1, N, H]: position 3's
  mix = np.random.default_rng(2).normal(size=(3, 8))
  stream = post @ mix + 0.5
  probe = probes.fit(stream[:, :160], post[:, :160], stream[:, 160:200],
                     post[:, 160:200])
  got = probes.scores(probe, stream[:, 200:], post[:, 200:])
  assert got["r2"][0] == pytest.approx(1.0, abs=1e-9)
  # The KL's floor moves a prediction equal to p by at most its mass:
  # KL(p || max(p, f) / Z) <= log Z <= H f.
  assert got["tv"][0] < 1e-8 and got["kl"][0] <= 3 * probes.KL_FLOOR


def test_shuffled_targets_give_r2_near_zero_within_the_bound():
  """Targets shuffled across rows are independent of the stream. For an
  affine fit on n rows in d dimensions the held-out R² is about -(d/(n - d
  - 1) + 1/n) in expectation (the estimate's own variance; a larger ridge
  only shrinks it), and SSE/SST fluctuates by about sqrt(2/(m h)) over m
  held-out rows of h targets: 5 of those either side bound it. Unshuffled,
  the same probe's R² is 1."""
  x, y, _, _ = _affine(3, k=1, n=1000, d=8, h=3)
  n, m, d, h = 400, 400, 8, 3
  shuffled = y[:, np.random.default_rng(4).permutation(y.shape[1])]
  probe = probes.fit(x[:, :n], shuffled[:, :n], x[:, n:600], shuffled[:, n:600])
  got = probes.r2(probe, x[:, 600:], shuffled[:, 600:])[0]
  spread = 5 * np.sqrt(2 / (m * h))
  assert -(d / (n - d - 1) + 1 / n) - spread < got < spread, got
  probe = probes.fit(x[:, :n], y[:, :n], x[:, n:600], y[:, n:600])
  assert probes.r2(probe, x[:, 600:], y[:, 600:])[0] == pytest.approx(1.0)


def test_probing_a_stack_equals_probing_each_trial_alone():
  """Trial 0 exactly affine (ridge 0 wins), trial 1 noisy with few rows (a
  larger ridge wins): each trial's ridge and probe are its own."""
  x, y, _, _ = _affine(5, k=2, n=60, d=10, h=3)
  y[1] += np.random.default_rng(6).normal(scale=3.0, size=y[1].shape)
  split = lambda a: (a[:, :30], a[:, 30:45], a[:, 45:])
  (xt, xv, xh), (yt, yv, yh) = split(x), split(y)
  stacked = probes.fit(xt, yt, xv, yv)
  assert stacked.ridge[0] != stacked.ridge[1]
  for k in range(2):
    alone = probes.fit(xt[k:k + 1], yt[k:k + 1], xv[k:k + 1], yv[k:k + 1])
    for got, want in zip(stacked, alone):
      np.testing.assert_allclose(got[k], want[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(
        probes.scores(stacked, xh, yh)["tv"][k],
        probes.scores(alone, xh[k:k + 1], yh[k:k + 1])["tv"][0], rtol=1e-10)


def test_the_simplex_projection_is_the_nearest_distribution():
  """Each row's projection is ``max(y - theta, 0)`` with theta solving sum =
  1 (found here by bisection), so it is the nearest point of the simplex."""
  y = np.random.default_rng(7).normal(size=(50, 5))
  got = probes.to_simplex(y)
  lo, hi = y.min(-1) - 1, y.max(-1)
  for _ in range(200):
    mid = (lo + hi) / 2
    big = np.maximum(y - mid[:, None], 0).sum(-1) > 1
    lo, hi = np.where(big, mid, lo), np.where(big, hi, mid)
  np.testing.assert_allclose(got, np.maximum(y - lo[:, None], 0), atol=1e-9)
  dist = np.array([[0.2, 0.3, 0.5]])
  np.testing.assert_allclose(probes.to_simplex(dist), dist, atol=1e-15)


@pytest.mark.parametrize("causal", [False, True])
def test_capturing_the_stream_leaves_the_outputs_bit_for_bit(causal):
  """The capturing run's logits equal the plain run's, jitted both; its
  last stream through the final layer norm and head gives them again (the
  capture is the stream the head reads), its first is embeddings plus
  positions."""
  cfg = pretrain.configure("tiny").model
  cfg = transformer.MLMConfig(**{**vars(cfg), "causal": causal,
                                 "num_layers": 2})
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0,
                              cfg.vocab_size)
  model = transformer.MLM(cfg)
  plain = jax.jit(model.apply)(params, tokens)
  captured, streams = jax.jit(probes.residual_streams, static_argnums=0)(
      cfg, params, tokens)
  np.testing.assert_array_equal(captured, plain)
  assert streams.shape == (3, 3, 12, cfg.d_model)
  head = lambda x: model.apply(params, x, method=lambda m, x: m.head(
      m.ln_final(x)))
  np.testing.assert_allclose(head(streams[-1]), plain, rtol=1e-5, atol=1e-6)
  emb = model.apply(params, tokens, method=lambda m, t: m.embed(t))
  np.testing.assert_allclose(
      streams[0], emb + params["params"]["pos_embed"][:12], atol=1e-7)


@pytest.mark.slow
def test_layer_scores_of_a_stack_are_each_transformers_own():
  """Two transformers of different initialisations in one call (the
  stream captured under vmap, the probes solved in one batch) score as
  each alone; every layer has its scores, the held-out sequences apart."""
  cfg = pretrain.configure("tiny").model
  cfg = transformer.MLMConfig(**{**vars(cfg), "num_layers": 2})
  params_K = jax.vmap(lambda k: transformer.init_params(k, cfg))(
      jax.random.split(jax.random.PRNGKey(3), 2))
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(4), 3, cfg.vocab_size)
  keys = jax.random.split(jax.random.PRNGKey(5), 2 * 60).reshape(2, 60, 2)
  tokens = jax.vmap(jax.vmap(lambda k: hmm_lib.sample(k, hmm, 8)[0]))(keys)
  post = jax.vmap(jax.vmap(lambda t: hmm_lib.posterior(hmm, t)))(tokens)
  both = probes.layer_scores(cfg, params_K, tokens, post[:, :, 4:5],
                              positions=[4])
  assert both["r2"].shape == (4, 2)
  for k in range(2):
    alone = probes.layer_scores(
        cfg, jax.tree.map(lambda x, k=k: x[k:k + 1], params_K),
        tokens[k:k + 1], post[k:k + 1, :, 4:5], positions=[4])
    # A batch of 2 against 1 may round the float32 streams differently
    # (a few eps = 1.2e-7 each); a probe of the other trial's stream would
    # miss by orders more.
    for name in ("r2", "tv", "kl", "peak"):
      np.testing.assert_allclose(both[name][:, k], alone[name][:, 0],
                                 rtol=1e-6, atol=1e-9)
  with pytest.raises(ValueError, match="leaves a part empty"):
    probes.layer_scores(cfg, params_K, tokens[:, :2], post[:, :2])
