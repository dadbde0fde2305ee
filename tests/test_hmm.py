import ast
import inspect
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import smoothing
from hmmprompt import memory as memory_lib
from hmmprompt.hmm import MASK
import reference as ref
from conftest import random_dense_hmm

TOKEN_CASES = [
    [0, 1, 2, 3, 1],
    [MASK, 1, 2, 3, 1],
    [2, MASK, 0, MASK, 3],
    [MASK, MASK, MASK, MASK, MASK],
]


@pytest.mark.parametrize("tokens", TOKEN_CASES)
def test_token_inference_matches_brute_force(tiny_hmm, tokens):
  ev = ref.evidence_from_tokens(tiny_hmm.emission, tokens)
  lik, post, tau = ref.brute_force(tiny_hmm.initial, tiny_hmm.transition, ev)
  np.testing.assert_allclose(hmm_lib.log_likelihood(tiny_hmm, tokens),
                             np.log(lik), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(hmm_lib.posterior(tiny_hmm, tokens), post,
                             atol=2e-6)
  masked = ref.normalize_rows(tau)
  np.testing.assert_allclose(hmm_lib.masked_posterior(tiny_hmm, tokens),
                             masked, atol=2e-6)
  np.testing.assert_allclose(hmm_lib.conditionals(tiny_hmm, tokens),
                             _brute_conditionals(tiny_hmm, tokens), atol=2e-6)


def _brute_conditionals(hmm, tokens):
  """P[X_t = v | x_{-t}] by enumerating v too: an independent route to G."""
  cond = np.zeros((len(tokens), hmm.vocab_size))
  for t in range(len(tokens)):
    for v in range(hmm.vocab_size):
      x = list(tokens)
      x[t] = v
      cond[t, v] = ref.brute_force(
          hmm.initial, hmm.transition,
          ref.evidence_from_tokens(hmm.emission, x))[0]
  return cond / cond.sum(-1, keepdims=True)


def test_conditionals_ignore_own_token(tiny_hmm):
  a = hmm_lib.conditionals(tiny_hmm, [0, 1, 2, 3])
  b = hmm_lib.conditionals(tiny_hmm, [0, 3, 2, 3])
  np.testing.assert_allclose(a[1], b[1], atol=1e-7)
  assert not np.allclose(a[0], b[0])


def test_evidence_vectors_match_brute_force(tiny_hmm):
  rng = np.random.default_rng(1)
  ev = rng.random((5, tiny_hmm.num_states)).astype(np.float32)
  lik, post, tau = ref.brute_force(tiny_hmm.initial, tiny_hmm.transition, ev)
  sm = hmm_lib.smooth(tiny_hmm, ev)
  np.testing.assert_allclose(sm.log_likelihood, np.log(lik), rtol=1e-5)
  np.testing.assert_allclose(sm.posterior, post, atol=2e-6)
  np.testing.assert_allclose(sm.masked_posterior, ref.normalize_rows(tau),
                             atol=2e-6)
  g_bar = ref.normalize_rows(tau) @ np.asarray(tiny_hmm.emission, np.float64)
  np.testing.assert_allclose(
      hmm_lib.conditionals_from_evidence(tiny_hmm, ev), g_bar, atol=2e-6)
  # Proper embeddings through the evidence API equal the token API.
  toks = [1, MASK, 3]
  np.testing.assert_allclose(
      hmm_lib.conditionals_from_evidence(tiny_hmm,
                                         hmm_lib.embed(tiny_hmm, toks)),
      hmm_lib.conditionals(tiny_hmm, toks), atol=1e-7)


def test_impossible_sequences_give_zeros_not_nan():
  # State 0 only emits 0 and always moves to state 1, which never emits 0.
  hmm = hmm_lib.HMM(jnp.array([1.0, 0.0]),
                    jnp.array([[0.0, 1.0], [0.0, 1.0]]),
                    jnp.array([[1.0, 0.0], [0.0, 1.0]]))
  tokens = [0, 0, 1]  # position 1 is impossible given position 0
  assert hmm_lib.log_likelihood(hmm, tokens) == -np.inf
  post = np.asarray(hmm_lib.posterior(hmm, tokens))
  assert not np.isnan(post).any()
  np.testing.assert_array_equal(post, 0.0)
  cond = np.asarray(hmm_lib.conditionals(hmm, tokens))
  assert not np.isnan(cond).any()
  # x_{-1} = (0, _, 1) is possible: G_1 is the exact conditional (token 1).
  np.testing.assert_allclose(cond[1], [0.0, 1.0])
  # x_{-0} and x_{-2} contain the impossible pair (0, 0): Appendix B's 0.
  np.testing.assert_array_equal(cond[[0, 2]], 0.0)
  # Gradients through an impossible sequence stay finite.
  g = jax.grad(lambda e: hmm_lib.smooth(hmm, e).posterior.sum())(
      hmm_lib.embed(hmm, tokens))
  assert np.isfinite(np.asarray(g)).all()


def test_zero_evidence_vector_gives_zero_output(tiny_hmm):
  ev = np.ones((4, tiny_hmm.num_states), np.float32)
  ev[2] = 0.0
  cond = np.asarray(hmm_lib.conditionals_from_evidence(tiny_hmm, ev))
  np.testing.assert_array_equal(cond[[0, 1, 3]], 0.0)
  np.testing.assert_allclose(cond[2].sum(), 1.0, rtol=1e-6)


# The fast tier runs the scan; the other kernels (5-6 CPU-s each, mostly
# compiles) run in the full suite.
_SLOW_KERNELS = ["sequential"] + [pytest.param(k, marks=pytest.mark.slow)
                                  for k in ("parallel", "blocked")]


@pytest.mark.parametrize("method", _SLOW_KERNELS)
def test_float32_matches_float64_on_long_paper_sequence(paper_hmm, method):
  """Both kernels hold float32 at T = 10 240 against float64 in the log
  domain: every message (scan) or product (associative scan) is rescaled
  with its scale carried in logs."""
  tokens, _ = hmm_lib.sample(jax.random.PRNGKey(3), paper_hmm, 10240)
  tokens = np.array(tokens)
  tokens[::97] = MASK
  ev = ref.evidence_from_tokens(paper_hmm.emission, tokens)
  ll64, post64, masked64 = ref.log_forward_backward(
      paper_hmm.initial, paper_hmm.transition, ev)
  assert np.isfinite(ll64)
  ll32 = float(hmm_lib.log_likelihood(paper_hmm, tokens, method=method))
  np.testing.assert_allclose(ll32, ll64, rtol=1e-4)
  np.testing.assert_allclose(hmm_lib.posterior(paper_hmm, tokens, method=method), post64,
                             atol=1e-4)
  np.testing.assert_allclose(hmm_lib.masked_posterior(paper_hmm, tokens, method=method),
                             masked64, atol=1e-4)
  cond64 = masked64 @ np.asarray(paper_hmm.emission, np.float64)
  np.testing.assert_allclose(hmm_lib.conditionals(paper_hmm, tokens, method=method), cond64,
                             atol=1e-4)


@pytest.mark.parametrize("method", _SLOW_KERNELS)
def test_float64_mode_runs_and_agrees(tiny_hmm, method):
  """Under x64 a float64 HMM computes in float64 (enumeration's values to
  1e-12), and a float32 one stays float32: no kernel makes an array of
  x64's default dtype (a float32 run would silently become float64)."""
  tokens = [0, MASK, 2, 3, 1]
  with jax.enable_x64(True):
    h64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tiny_hmm)
    post = hmm_lib.posterior(h64, tokens, method=method)
    assert post.dtype == jnp.float64
    smoothed = hmm_lib.smooth(tiny_hmm, hmm_lib.embed(tiny_hmm, tokens),
                              method=method)
    assert {x.dtype for x in smoothed} == {jnp.dtype(jnp.float32)}
  ev = ref.evidence_from_tokens(tiny_hmm.emission, tokens)
  np.testing.assert_allclose(post, ref.brute_force(tiny_hmm.initial, tiny_hmm.transition, ev)[1],
                             atol=1e-12)


def test_sampler_matches_exact_marginals_and_transitions():
  hmm = random_dense_hmm(2, 3, 4, zero_frac=0.3)
  n, t_len = 20000, 6
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  tokens, states = jax.jit(jax.vmap(lambda k: hmm_lib.sample(k, hmm, t_len)))(
      keys)
  tokens, states = np.asarray(tokens), np.asarray(states)
  init = np.asarray(hmm.initial, np.float64)
  trans = np.asarray(hmm.transition, np.float64)
  emis = np.asarray(hmm.emission, np.float64)
  marg = init
  for t in range(t_len):
    state_freq = np.bincount(states[:, t], minlength=3) / n
    token_freq = np.bincount(tokens[:, t], minlength=4) / n
    np.testing.assert_allclose(state_freq, marg, atol=0.015)
    np.testing.assert_allclose(token_freq, marg @ emis, atol=0.015)
    marg = marg @ trans
  counts = np.zeros((3, 3))
  np.add.at(counts, (states[:, :-1].ravel(), states[:, 1:].ravel()), 1)
  np.testing.assert_allclose(counts / counts.sum(1, keepdims=True), trans,
                             atol=0.015)
  # Zero-probability transitions and emissions never happen.
  assert np.all(counts[trans == 0] == 0)
  assert np.all(emis[states.ravel(), tokens.ravel()] > 0)


def test_sampled_paper_sequences_are_possible(paper_hmm):
  keys = jax.random.split(jax.random.PRNGKey(1), 64)
  tokens, states = jax.vmap(lambda k: hmm_lib.sample(k, paper_hmm, 512))(keys)
  ll = jax.vmap(hmm_lib.log_likelihood, in_axes=(None, 0))(paper_hmm, tokens)
  assert np.isfinite(np.asarray(ll)).all()
  assert tokens.dtype == jnp.int32 and states.dtype == jnp.int32


def test_random_hmm_structure(paper_hmm):
  for f in paper_hmm:
    np.testing.assert_allclose(np.asarray(f).sum(-1), 1.0, rtol=1e-5)
  # A mixture of permutation matrices is doubly stochastic.
  np.testing.assert_allclose(np.asarray(paper_hmm.transition).sum(0), 1.0,
                             rtol=1e-5)
  init = np.asarray(paper_hmm.initial)
  assert init.max() / init.min() <= np.exp(1 / 10.0) * (1 + 1e-5)
  # Temperature 0.01: emission rows are near one-hot.
  assert np.median(np.asarray(paper_hmm.emission).max(-1)) > 0.5
  same = hmm_lib.random_hmm(jax.random.PRNGKey(7), 30, 10)
  for a, b in zip(paper_hmm, same):
    np.testing.assert_array_equal(a, b)


def test_jit_vmap_match_single_calls(tiny_hmm):
  batch = np.array(TOKEN_CASES, np.int32)
  fn = jax.jit(jax.vmap(hmm_lib.posterior, in_axes=(None, 0)))
  out = fn(tiny_hmm, batch)
  for i, toks in enumerate(TOKEN_CASES):
    np.testing.assert_allclose(out[i], hmm_lib.posterior(tiny_hmm, toks),
                               atol=1e-7)
  # vmap over HMMs built inside the transformation.
  hmms = jax.vmap(lambda k: hmm_lib.random_hmm(k, 3, 4))(
      jax.random.split(jax.random.PRNGKey(0), 2))
  ll = jax.vmap(hmm_lib.log_likelihood, in_axes=(0, None))(hmms, batch[0])
  single = hmm_lib.random_hmm(jax.random.split(jax.random.PRNGKey(0), 2)[1],
                              3, 4)
  np.testing.assert_allclose(ll[1], hmm_lib.log_likelihood(single, batch[0]),
                             rtol=1e-6)


class EntryPointsUnderJitTest(chex.TestCase):
  """The public entry points give the brute-force answers both called
  directly and under a caller's ``jit``, where their checks see tracers
  (``chex.variants``: one test per variant)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_hmm_entry_points_match_brute_force(self):
    hmm = random_dense_hmm(0, 3, 4)
    tokens = [2, MASK, 0, MASK, 3]
    ev = ref.evidence_from_tokens(hmm.emission, tokens)
    lik, post, tau = ref.brute_force(hmm.initial, hmm.transition, ev)
    want = {"log_likelihood": np.log(lik), "posterior": post,
            "masked_posterior": ref.normalize_rows(tau),
            "conditionals": _brute_conditionals(hmm, tokens), "embed": ev}
    got = {name: self.variant(getattr(hmm_lib, name))(
        hmm, jnp.array(tokens, jnp.int32)) for name in want}
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=2e-6)


def test_entry_points_run_their_kernels(tiny_hmm):
  """Each entry point is its kernel, jitted, behind a check: traced package
  code calling the kernel gets the same numbers."""
  tokens = jnp.array([0, MASK, 2, 3, 1], jnp.int32)
  sm = jax.jit(hmm_lib.token_smooth)(tiny_hmm, tokens)
  for field in sm._fields:
    np.testing.assert_allclose(getattr(hmm_lib, field)(tiny_hmm, tokens),
                               getattr(sm, field), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
      hmm_lib.conditionals(tiny_hmm, tokens),
      jax.jit(hmm_lib.token_conditionals)(tiny_hmm, tokens), atol=1e-7)
  np.testing.assert_array_equal(hmm_lib.embed(tiny_hmm, tokens),
                                hmm_lib.token_evidence(tiny_hmm, tokens))
  key = jax.random.PRNGKey(4)
  for a, b in zip(hmm_lib.sample(key, tiny_hmm, 7),
                  hmm_lib.draw_sequence(key, tiny_hmm, 7)):
    np.testing.assert_array_equal(a, b)
  draw_hmm = jax.jit(hmm_lib.draw_random_hmm, static_argnums=(1, 2))
  for a, b in zip(hmm_lib.random_hmm(key, 3, 4),
                  draw_hmm(key, 3, 4, 0.01, 0.01, 10.0)):
    np.testing.assert_array_equal(a, b)
  # The entry point keeps its check's name, docstring and signature.
  assert hmm_lib.posterior.__name__ == "posterior"
  assert "P[H_t | observed tokens]" in hmm_lib.posterior.__doc__
  assert list(inspect.signature(hmm_lib.sample).parameters) == [
      "key", "hmm", "length"]


def test_validation_sits_at_the_bottom():
  """hmmprompt.validation imports nothing from the package (every module
  may import it), the kernels nothing at run time (their type-checking
  import of HMM aside), and the HMM math only those two."""
  def package_imports(module):
    names = set()
    for node in ast.parse(inspect.getsource(module)).body:  # not under `if`
      if isinstance(node, ast.ImportFrom) and node.module:
        names.update(f"{node.module}.{a.name}" if node.module == "hmmprompt"
                     else node.module for a in node.names)
      elif isinstance(node, ast.Import):
        names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("hmmprompt")}

  from hmmprompt import validation  # pylint: disable=g-import-not-at-top
  assert package_imports(validation) == set()
  assert package_imports(smoothing) == set()
  assert package_imports(hmm_lib) == {"hmmprompt.validation",
                                      "hmmprompt.smoothing"}


def _brute_log_lik_jax(hmm, tokens):
  """Differentiable brute force in JAX: logsumexp over all paths."""
  h = hmm.num_states
  paths = jnp.array(list(itertools.product(range(h), repeat=len(tokens))))
  ev = jnp.stack([jnp.ones(h) if x == MASK else hmm.emission[:, x]
                  for x in tokens])
  logp = (jnp.log(hmm.initial[paths[:, 0]])
          + jnp.log(hmm.transition[paths[:, :-1], paths[:, 1:]]).sum(-1)
          + jnp.log(ev[jnp.arange(len(tokens)), paths]).sum(-1))
  return jax.scipy.special.logsumexp(logp)


def test_grad_matches_brute_force_grad(tiny_hmm):
  tokens = [0, MASK, 2, 3]
  g = jax.grad(hmm_lib.log_likelihood)(tiny_hmm, tokens)
  g_ref = jax.jit(jax.grad(lambda m: _brute_log_lik_jax(m, tokens)))(tiny_hmm)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  # Through the posterior too (a non-linear functional).
  w = jnp.arange(12.0).reshape(4, 3)
  f = lambda hm: jnp.sum(w * hmm_lib.posterior(hm, tokens))
  g_post = jax.jit(jax.grad(f))(tiny_hmm)
  eps = 1e-3
  d = np.zeros((3, 3), np.float32)
  d[0, 1], d[0, 2] = eps, -eps  # stays on the simplex
  plus = tiny_hmm._replace(transition=tiny_hmm.transition + d)
  minus = tiny_hmm._replace(transition=tiny_hmm.transition - d)
  fd = (f(plus) - f(minus)) / (2 * eps)
  np.testing.assert_allclose(np.sum(np.asarray(g_post.transition) * d / eps),
                             fd, rtol=2e-2)


def test_grad_finite_on_near_impossible_evidence():
  """A message whose sum is ~1e-24 (a near-deterministic HMM reading an
  unlikely token, as Appendix D's draws under a soft prompt do): the float32
  gradient is finite and equals float64's (autodiff's x ds / s**2 would
  underflow s**2 to 0 and give NaN)."""
  eps = 1e-25
  near = lambda n: (np.eye(n) * (1 - (n - 1) * eps) + eps).astype(np.float32)
  hmm = hmm_lib.HMM(np.array([1 - 2 * eps, eps, eps], np.float32), near(3),
                    near(3))
  ev = hmm_lib.embed(hmm, [0, 0, 1, MASK, 1]) * np.float32(0.5)
  w = jnp.arange(15.0).reshape(5, 3)
  f = lambda e, hm: jnp.sum(w * hmm_lib.evidence_conditionals(hm, e))
  g32 = np.asarray(jax.jit(jax.grad(f))(ev, hmm))
  assert np.all(np.isfinite(g32))
  with jax.enable_x64(True):
    h64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), hmm)
    g64 = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(ev, jnp.float64), h64))
  np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-3 * np.abs(g64).max())


# ---------------------------------------------------------------------------
# Bad input.

GOOD = dict(initial=[0.5, 0.5], transition=[[0.9, 0.1], [0.2, 0.8]],
            emission=[[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]])


@pytest.mark.parametrize("field,value,match", [
    ("initial", [0.5, 0.6], "HMM.initial must sum to 1"),
    ("initial", [1.5, -0.5], "HMM.initial has a negative entry"),
    ("initial", [np.nan, 1.0], "HMM.initial has a non-finite"),
    ("initial", [[0.5, 0.5]], r"HMM.transition must have shape \[H, H\] = "
     r"\(1, 2, 2\) to match HMM.initial of shape \(1, 2\)"),
    ("initial", 0.5, "HMM.initial must have 1 dimension"),
    ("initial", [1, 0], "HMM.initial must be a floating-point"),
    ("transition", [[0.9, 0.1], [0.2, 0.7]], r"HMM.transition .* row \[1\]"),
    ("transition", [[1.0]], r"HMM.transition must have shape \[H, H\]"),
    ("emission", [[0.5, 0.5], [0.1, 0.9], [0.5, 0.5]],
     r"HMM.emission must have shape \[H, V\]"),
    ("emission", [[0.5, 0.6, 0.0], [0.1, 0.1, 0.8]], "HMM.emission must sum"),
    ("emission", [[np.inf, 0.0, 0.0], [0.1, 0.1, 0.8]],
     "HMM.emission has a non-finite"),
])
def test_malformed_hmm_raises(field, value, match):
  kwargs = {k: np.asarray(v, np.float32) for k, v in GOOD.items()}
  kwargs[field] = np.asarray(value)
  if np.asarray(value).dtype.kind == "f":
    kwargs[field] = kwargs[field].astype(np.float32)
  with pytest.raises(ValueError, match=match):
    hmm_lib.HMM(**kwargs)


def test_a_transposed_emission_is_named_by_its_shape():
  """Issue 66: shapes are checked before values, so ``B.T`` ([V, H] for
  [H, V]) is a shape error naming the expected shape, not a row sum."""
  rng = np.random.default_rng(0)
  h, v = 5, 8
  initial = np.full(h, 1 / h, np.float32)
  transition = rng.dirichlet(np.ones(h), h).astype(np.float32)
  emission = rng.dirichlet(np.ones(v), h).astype(np.float32)
  with pytest.raises(ValueError, match="^" + re.escape(
      "HMM.emission must have shape [H, V] with H = 5 (and the batch shape "
      "() of HMM.initial), got (8, 5) (a transposed [V, H] emission?)")
      + "$"):
    hmm_lib.HMM(initial, transition, emission.T)


def test_hmm_accepts_lists_and_tracers():
  hmm = hmm_lib.HMM(**GOOD)
  assert hmm.num_states == 2 and hmm.vocab_size == 3
  # Traced values skip value checks instead of failing inside jit.
  out = jax.jit(lambda a: hmm_lib.HMM(a, hmm.transition, hmm.emission)
                .initial * 2)(jnp.array([0.3, 0.3]))
  np.testing.assert_allclose(out, [0.6, 0.6])


@pytest.mark.parametrize("tokens,match", [
    ([0, 3, 1], r"token 3 at index \[1\] is out of range"),
    ([0, -2], r"token -2 at index \[1\] is out of range"),
    (np.array([0.0, 1.0]), "tokens must be integers"),
    (np.zeros((2, 3), np.int32), "1-D sequence"),
    (np.zeros((0,), np.int32), "non-empty"),
])
def test_bad_tokens_raise(tokens, match):
  hmm = hmm_lib.HMM(**GOOD)
  for fn in (hmm_lib.posterior, hmm_lib.masked_posterior,
             hmm_lib.log_likelihood, hmm_lib.conditionals, hmm_lib.embed):
    with pytest.raises(ValueError, match=match):
      fn(hmm, tokens)


def test_bad_tokens_under_jit_are_impossible_not_clamped():
  hmm = hmm_lib.HMM(**GOOD)
  ll = jax.jit(hmm_lib.log_likelihood)(hmm, jnp.array([0, 7], jnp.int32))
  assert ll == -np.inf
  with pytest.raises(ValueError, match="tokens must be integers"):
    jax.jit(hmm_lib.posterior)(hmm, jnp.array([0.0, 1.0]))


@pytest.mark.parametrize("evidence,match", [
    (np.ones((3, 3), np.float32), r"shape \[T, H\] with H = 2"),
    (-np.ones((3, 2), np.float32), "finite and non-negative"),
    (np.full((3, 2), np.nan, np.float32), "finite and non-negative"),
    (np.ones((3, 2), np.int32), "floating point"),
])
def test_bad_evidence_raises(evidence, match):
  hmm = hmm_lib.HMM(**GOOD)
  with pytest.raises(ValueError, match=match):
    hmm_lib.smooth(hmm, evidence)


@pytest.mark.parametrize("kwargs,match", [
    (dict(length=0), "length must be a positive int"),
    (dict(length=2.5), "length must be a positive int"),
])
def test_bad_sample_args_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    hmm_lib.sample(jax.random.PRNGKey(0), hmm_lib.HMM(**GOOD), **kwargs)


def test_bad_generator_args_raise():
  with pytest.raises(ValueError, match="emission_temp must be > 0"):
    hmm_lib.random_hmm(jax.random.PRNGKey(0), 3, 4, emission_temp=0.0)
  with pytest.raises(ValueError, match="num_states and vocab_size"):
    hmm_lib.random_hmm(jax.random.PRNGKey(0), 0, 4)


def test_evidence_is_checked_as_an_array_of_at_least_one_position():
  hmm = hmm_lib.HMM(**GOOD)
  ev = [[0.5, 0.1], [0.5, 0.8], [1.0, 1.0]]
  # A nested list is evidence as much as an array.
  np.testing.assert_array_equal(hmm_lib.smooth(hmm, ev).posterior,
                                hmm_lib.smooth(hmm, np.float32(ev)).posterior)
  with pytest.raises(ValueError, match=r"T >= 1, got \(0, 2\)"):
    hmm_lib.smooth(hmm, np.zeros((0, 2), np.float32))
  # One position is a sequence: its posterior is the normalised prior x ev.
  one = hmm_lib.smooth(hmm, np.float32([[0.5, 0.1]])).posterior
  prior = np.float32([0.5, 0.5]) * np.float32([0.5, 0.1])
  np.testing.assert_allclose(one[0], prior / prior.sum(), rtol=1e-6)


def test_bad_evidence_is_named_by_its_first_bad_entry():
  """Zeros are evidence (a state that cannot emit the token); the error
  names the first negative or non-finite entry, past any zeros."""
  hmm = hmm_lib.HMM(**GOOD)
  ev = np.float32([[0.0, 0.5], [0.3, 0.0], [0.5, -0.25], [np.nan, 1.0]])
  ok = ev[:2]
  assert np.isfinite(np.asarray(hmm_lib.smooth(hmm, ok).posterior)).all()
  with pytest.raises(ValueError, match=r"entry \[2, 1\] is -0\.25"):
    hmm_lib.smooth(hmm, ev)


def test_the_transition_temperature_moves_the_permutation_mixture():
  """The transition mixes H permutation matrices with softmax weights at
  ``transition_temp``: cold, one permutation; hot, all H equally, so every
  entry is a count of permutations over H; Appendix D's default, each row
  within 1e-2 of one-hot."""
  key, h = jax.random.PRNGKey(3), 6
  draw = lambda **kw: np.asarray(hmm_lib.random_hmm(key, h, 4, **kw).transition)
  cold, hot = draw(transition_temp=1e-3), draw(transition_temp=1e3)
  np.testing.assert_array_equal(np.sort(cold, axis=1)[:, -1], 1.0)
  np.testing.assert_array_equal(cold.sum(0), 1.0)  # a permutation matrix
  np.testing.assert_allclose(hot * h, np.round(hot * h), atol=1e-2)
  assert hot.max() <= 0.5 + 1e-3  # no state's row is one permutation's
  assert (draw().max(axis=1) > 0.99).all()
  # random_transition's own default is the same (jit and eager round apart).
  np.testing.assert_allclose(
      draw(), hmm_lib.random_transition(jax.random.split(key, 3)[1], h),
      rtol=1e-5)


def test_the_cdf_ends_at_exactly_one_and_no_zero_outcome_is_drawn():
  """``_cdf`` divides by the total, so the entries from the last non-zero
  weight on are exactly 1.0 (even for weights that do not sum to 1), and
  the inverse-CDF draw never picks a zero-probability outcome, not even
  for ``u = 0`` or the largest float32 below 1."""
  cdf = np.asarray(hmm_lib._cdf(jnp.float32([0.0, 3.0, 3.0, 3.0, 0.0])))
  np.testing.assert_allclose(cdf, [0.0, 1 / 3, 2 / 3, 1.0, 1.0], rtol=1e-6)
  assert cdf[-2] == 1.0 and cdf[-1] == 1.0
  u = jnp.float32([0.0, 0.2, 0.5, np.nextafter(np.float32(1), 0)])
  np.testing.assert_array_equal(hmm_lib._draw(cdf, u), [1, 1, 2, 3])


def test_sampling_draws_the_committed_streams():
  """Committed results (docs/results/) were drawn from these streams: a
  change in how the uniforms are drawn or used changes every draw while
  keeping the distribution, which the statistical tests cannot see."""
  tokens, states = hmm_lib.sample(jax.random.PRNGKey(7), hmm_lib.HMM(**GOOD),
                                  16)
  assert tokens.tolist() == [2, 2, 2, 2, 2, 2, 2, 2, 1, 0, 1, 0, 1, 0, 2, 0]
  assert states.tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]


def test_an_out_of_range_token_under_jit_makes_its_context_impossible():
  """Under a caller's jit the token is not checked: its likelihood is 0
  (``mode="fill"`` with 0), so every other position's conditionals are
  the documented zero rows, not NaN, and its own row is unaffected."""
  hmm = hmm_lib.HMM(**GOOD)
  got = np.asarray(jax.jit(hmm_lib.conditionals)(
      hmm, jnp.array([0, 7, 1], jnp.int32)))
  np.testing.assert_array_equal(got[[0, 2]], 0.0)
  np.testing.assert_allclose(
      got[1], hmm_lib.conditionals(hmm, jnp.array([0, MASK, 1]))[1],
      rtol=1e-6)


def test_a_stack_of_hmms_validates_with_its_batch_shape():
  """``[K]`` stacked parameters are an HMM of batch shape ``(K,)``; an
  emission whose state axis disagrees within the batch is named."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  stacked = jax.vmap(lambda k: hmm_lib.random_hmm(k, 4, 6))(keys)
  arrays = [np.asarray(x) for x in stacked]
  again = hmm_lib.HMM(*arrays)  # concrete: validated
  assert again.initial.shape == (3, 4) and again.emission.shape == (3, 4, 6)
  with pytest.raises(ValueError, match="^" + re.escape(
      "HMM.emission must have shape [H, V] with H = 4 (and the batch shape "
      "(3,) of HMM.initial), got (3, 5, 6)") + "$"):
    hmm_lib.HMM(arrays[0], arrays[1], np.full((3, 5, 6), 1 / 6, np.float32))


def test_safe_log_is_minus_infinity_with_a_zero_gradient_at_zero():
  """The log-likelihood of an impossible sequence is ``-inf``; its
  gradient is zero there, not ``inf`` or NaN (nothing downstream of a
  ``where`` can then turn NaN)."""
  x = jnp.array([0.0, 2.0, -1.0])
  # XLA's float32 log is within a few ulp of the rounded value.
  np.testing.assert_allclose(smoothing.safe_log(x),
                             [-np.inf, np.log(2.0), -np.inf],
                             rtol=4 * np.finfo(np.float32).eps)
  for i, want in enumerate(([0.0, 0.0, 0.0], [0.0, 0.5, 0.0],
                            [0.0, 0.0, 0.0])):
    np.testing.assert_array_equal(
        jax.grad(lambda v, i=i: smoothing.safe_log(v)[i])(x), want)


@pytest.mark.parametrize("field,value,match", [
    ("transition", lambda m: m.transition * 3,
     "HMM.transition must sum to 1 along its last axis, but row [0] sums "
     "to 3"),
    ("emission", lambda m: m.emission.at[0, 0].set(-0.1),
     "HMM.emission has a negative entry -0.1 at index [0, 0]"),
    ("initial", lambda m: m.initial.at[1].set(jnp.nan),
     "HMM.initial has a non-finite entry at index [1]"),
    ("transition", lambda m: m.transition[:2],
     "HMM.transition must have shape [H, H] = (3, 3) to match HMM.initial "
     "of shape (3,), got (2, 3)")])
def test_replace_validates_as_the_constructor_does(tiny_hmm, field, value,
                                                   match):
  """``_replace`` (and ``_make``) build through the checks: a model with
  rows summing to 3 never reaches an entry point."""
  with pytest.raises(ValueError, match="^" + re.escape(match)):
    tiny_hmm._replace(**{field: value(tiny_hmm)})
  with pytest.raises(ValueError, match="^" + re.escape(match)):
    hmm_lib.HMM._make((tiny_hmm._asdict() | {
        field: value(tiny_hmm)}).values())
  # A valid change passes, and JAX's own rebuilding (grads) stays free.
  ok = tiny_hmm._replace(initial=jnp.ones(3) / 3)
  assert isinstance(ok, hmm_lib.HMM)
  grads = jax.grad(lambda m: hmm_lib.log_likelihood(m, jnp.array([0, 1])))(
      tiny_hmm)
  assert isinstance(grads, hmm_lib.HMM)  # not a distribution, not checked


def test_a_memory_hmms_replace_validates():
  rng = np.random.default_rng(3)
  dense = lambda shape: (lambda x: x / x.sum(-1, keepdims=True))(
      rng.random(shape).astype(np.float32) + 0.1)
  m = memory_lib.MemoryHMM(dense((3,)), dense((2,)), dense((2, 2)),
                           dense((3, 2, 4)))
  with pytest.raises(ValueError, match="^" + re.escape(
      "MemoryHMM.transition must sum to 1")):
    m._replace(transition=m.transition * 3)
# ---------------------------------------------------------------------------
def _bypass(model, **changes):
  """``model`` with ``changes``, past the constructor's checks, as JAX's
  own rebuilds (``tree.map``, a jitted function's output) make one:
  ``_replace`` checks since it goes through the constructor."""
  return tuple.__new__(type(model),
                       tuple({**model._asdict(), **changes}.values()))


# The model's arrays at every entry point: a model made past the constructor (``_bypass``) (or
# tree.map, or a jitted function) skipped its constructor's checks.

_TOKENS = [0, MASK, 2, 1]
_EVIDENCE = np.full((4, 2), 0.5, np.float32)

# Every entry point that takes a model (GOOD's H = 2, V = 3).
HMM_ENTRY_POINTS = {
    "sample": lambda m: hmm_lib.sample(jax.random.PRNGKey(0), m, 4),
    "embed": lambda m: hmm_lib.embed(m, _TOKENS),
    "smooth": lambda m: hmm_lib.smooth(m, _EVIDENCE),
    "log_likelihood": lambda m: hmm_lib.log_likelihood(m, _TOKENS),
    "posterior": lambda m: hmm_lib.posterior(m, _TOKENS),
    "masked_posterior": lambda m: hmm_lib.masked_posterior(m, _TOKENS),
    "conditionals": lambda m: hmm_lib.conditionals(m, _TOKENS),
    "conditionals_from_evidence":
        lambda m: hmm_lib.conditionals_from_evidence(m, _EVIDENCE),
}

# (field, value, the whole refusal) on GOOD: rows summing to 3, a negative
# entry, a NaN, a wrong shape.
BAD_HMM_FIELDS = [
    ("transition", np.float32(3) * np.asarray(GOOD["transition"], np.float32),
     "HMM.transition must sum to 1 along its last axis, but row [0] sums "
     "to 3"),
    ("emission", [[0.6, 0.5, -0.1], [0.1, 0.1, 0.8]],
     "HMM.emission has a negative entry -0.1 at index [0, 2]"),
    ("initial", [np.nan, 1.0], "HMM.initial has a non-finite entry at index "
     "[0]"),
    ("emission", np.full((3, 3), 1 / 3),
     "HMM.emission must have shape [H, V] with H = 2 (and the batch shape () "
     "of HMM.initial), got (3, 3)"),
]


def _good():
  return hmm_lib.HMM(**{k: np.asarray(v, np.float32) for k, v in GOOD.items()})


def test_the_entry_point_table_is_every_entry_point():
  """Every function made by validation.entry_point that takes a model is
  in the table the next test walks (random_hmm makes one)."""
  made = {n for n, f in vars(hmm_lib).items()
          if not n.startswith("_") and hasattr(f, "kernel")}
  assert made - {"random_hmm"} == set(HMM_ENTRY_POINTS)


@pytest.mark.parametrize("entry", sorted(HMM_ENTRY_POINTS))
@pytest.mark.parametrize("field,value,message", BAD_HMM_FIELDS)
def test_entry_points_refuse_a_replaced_bad_model(entry, field, value,
                                                  message):
  """``_replace`` skips the constructor; each entry point checks the model
  it is given as the constructor would, naming the field, and accepts the
  valid model."""
  good = _good()
  HMM_ENTRY_POINTS[entry](good)
  bad = _bypass(good, **{field: jnp.asarray(np.asarray(value, np.float32))})
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    HMM_ENTRY_POINTS[entry](bad)
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    hmm_lib.check_model(bad)
  assert hmm_lib.check_model(good) is good


def test_the_model_check_runs_on_concrete_models_only(monkeypatch):
  """On a concrete model the check runs once per call; under a caller's
  jit/vmap/grad the fields are tracers and it never runs (a bad model is
  then not refused: the boundary check is for concrete inputs), and
  nothing of it is compiled into the caller's program."""
  calls = []
  real = hmm_lib._validate_hmm  # pylint: disable=protected-access

  def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(hmm_lib, "_validate_hmm", counting)
  good = _good()
  tokens = jnp.array(_TOKENS, jnp.int32)
  want = hmm_lib.posterior(good, tokens)
  assert len(calls) == 1
  bad = _bypass(good, transition=good.transition * 3)
  jitted = jax.jit(hmm_lib.posterior)
  np.testing.assert_array_equal(jitted(good, tokens), want)
  jitted(bad, tokens)  # traced: not refused
  jax.jit(jax.vmap(hmm_lib.posterior, in_axes=(None, 0)))(
      bad, tokens[None])
  jax.grad(hmm_lib.log_likelihood)(bad, tokens)
  assert len(calls) == 1
  jaxpr = str(jax.make_jaxpr(hmm_lib.posterior)(good, tokens))
  assert "callback" not in jaxpr and "check" not in jaxpr


@pytest.mark.slow
def test_checkify_checks_the_model_and_tokens_inside_jit():
  """checkify_model and checkify_tokens check traced values under
  ``checkify.checkify``: a valid call gives the entry point's numbers and
  no error; each bad model or token comes back as an error naming it;
  a bad shape is refused while tracing."""
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top

  def f(model, tokens):
    hmm_lib.checkify_model(model)
    hmm_lib.checkify_tokens(tokens, model.vocab_size)
    return hmm_lib.posterior(model, tokens)

  checked = jax.jit(checkify.checkify(f))
  good = _good()
  tokens = jnp.array(_TOKENS, jnp.int32)
  err, out = checked(good, tokens)
  err.throw()
  np.testing.assert_allclose(out, hmm_lib.posterior(good, tokens), atol=1e-7)
  cases = [
      (_bypass(good, transition=good.transition * 3), tokens,
       "HMM.transition must sum to 1 along its last axis, but a row is off "
       "by 2"),
      (_bypass(good, emission=jnp.array([[0.6, 0.5, -0.1], [0.1, 0.1, 0.8]])),
       tokens, "HMM.emission has a negative entry -0.1"),
      (_bypass(good, initial=jnp.array([np.nan, 1.0])), tokens,
       "HMM.initial has a non-finite entry"),
      (good, jnp.array([0, 7, MASK], jnp.int32),
       "a token is out of range: tokens must lie in [0, 3) or equal MASK "
       "(-1); the first bad one is 7"),
  ]
  for model, toks, message in cases:
    err, _ = checked(model, toks)
    with pytest.raises(checkify.JaxRuntimeError,
                       match="^" + re.escape(message + " (`check` failed)") + "$"):
      err.throw()
  # Raised while tracing: jax adds a note (a line of its own) to it.
  with pytest.raises(ValueError, match="^" + re.escape(
      "HMM.emission must have shape [H, V] with H = 2 (and the batch shape "
      "() of HMM.initial), got (3, 3)") + "(\n|$)"):
    checked(_bypass(good, emission=jnp.full((3, 3), 1 / 3)), tokens)


# The associative-scan kernel (issue 51's first part): the same Smoothed as
# the sequential kernel and as enumeration. Tolerance: every combine is one
# H x H product rescaled to sum 1 (a relative rounding of ~H eps per
# entry), log2(T) combines deep, so ~H log2(T) eps ~ 30 * 14 * 6e-8 < 3e-5
# of a probability at T = 10 240, |H| = 30.
# The blocked kernel: each message crosses at most L = ceil(sqrt(T))
# rescaled steps of a block's product and C entry steps, ~H sqrt(T) eps
# (< 3e-5 up to T ~ 250 at |H| = 30; measured 6e-8 at T = 777).
_seq = jax.jit(hmm_lib.forward_backward)
_KERNELS = {"parallel": jax.jit(hmm_lib.forward_backward_parallel),
            "blocked": jax.jit(hmm_lib.forward_backward_blocked)}


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
@pytest.mark.parametrize("tokens", TOKEN_CASES)
def test_parallel_kernel_matches_brute_force(tiny_hmm, tokens, kernel):
  ev = ref.evidence_from_tokens(tiny_hmm.emission, tokens)
  lik, post, tau = ref.brute_force(tiny_hmm.initial, tiny_hmm.transition, ev)
  got = _KERNELS[kernel](tiny_hmm, jnp.asarray(ev, jnp.float32))
  np.testing.assert_allclose(got.log_likelihood, np.log(lik), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(got.posterior, post, atol=2e-6)
  np.testing.assert_allclose(got.masked_posterior, ref.normalize_rows(tau),
                             atol=2e-6)


@pytest.mark.parametrize("kernel", sorted(_KERNELS))
# The fast tier runs T = 7, the rest the full suite. The gradients are
# jitted: eagerly, op by op, the associative scan's was ~250 programs at
# T = 7 and 13 CPU-s of compiles at T = 64 (cold, the whole
# parametrisation: 22.7 -> 5.5 s).
@pytest.mark.parametrize("length", [
    pytest.param(1, marks=pytest.mark.slow),
    pytest.param(2, marks=pytest.mark.slow), 7,
    pytest.param(64, marks=pytest.mark.slow)])
def test_parallel_kernel_equals_sequential_on_sparse_paper_hmms(paper_hmm,
                                                                length,
                                                                kernel):
  """Exact zeros (Appendix D's transitions) stay exact: no NaN, the same
  posteriors, log-likelihood and its gradient; MASKs and an impossible
  sequence (log-likelihood -inf, all-zero posteriors there) included."""
  tokens, _ = hmm_lib.sample(jax.random.PRNGKey(length), paper_hmm, length)
  tokens = np.array(tokens)
  tokens[::3] = MASK
  ev = hmm_lib.embed(paper_hmm, tokens)
  # Impossible evidence: a position no state explains.
  cases = [ev, ev.at[length // 2].set(0.0)]
  for ev in cases:
    a, b = _seq(paper_hmm, ev), _KERNELS[kernel](paper_hmm, ev)
    assert np.isfinite(a.log_likelihood) == np.isfinite(b.log_likelihood)
    np.testing.assert_allclose(b.log_likelihood, a.log_likelihood, rtol=1e-5)
    for x, y in ((a.posterior, b.posterior),
                 (a.masked_posterior, b.masked_posterior)):
      assert not np.isnan(np.asarray(y)).any()
      np.testing.assert_allclose(y, x, atol=3e-5)
  assert np.isneginf(float(_KERNELS[kernel](paper_hmm,
                                            cases[1]).log_likelihood))
  ll = lambda kernel: lambda m: kernel(m, hmm_lib.token_evidence(
      m, jnp.asarray(tokens))).log_likelihood
  g_seq = jax.jit(jax.grad(ll(hmm_lib.forward_backward)))(paper_hmm)
  g_par = jax.jit(jax.grad(ll({
      "parallel": hmm_lib.forward_backward_parallel,
      "blocked": hmm_lib.forward_backward_blocked}[kernel])))(paper_hmm)
  for x, y in zip(g_seq, g_par):
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # 4 CPU-s of compiles: 18 entry-point programs, 3 grads
def test_entry_points_take_a_method_and_agree(paper_hmm):
  """``method="parallel"`` gives every entry point's value to float
  rounding (the tolerance above); it composes with vmap over a batch, jit
  and grad; ``auto`` is the scan on a CPU."""
  tokens, _ = hmm_lib.sample(jax.random.PRNGKey(4), paper_hmm, 96)
  tokens = tokens.at[::5].set(MASK)
  ev = hmm_lib.embed(paper_hmm, tokens)
  for fn, arg in ((hmm_lib.posterior, tokens),
                  (hmm_lib.masked_posterior, tokens),
                  (hmm_lib.conditionals, tokens),
                  (hmm_lib.log_likelihood, tokens),
                  (hmm_lib.conditionals_from_evidence, ev),
                  (lambda m, e, method: hmm_lib.smooth(m, e, method).posterior,
                   ev)):
    seq = fn(paper_hmm, arg, method="sequential")
    for method in ("parallel", "blocked"):
      np.testing.assert_allclose(fn(paper_hmm, arg, method=method), seq,
                                 atol=3e-5, rtol=1e-5)
    np.testing.assert_array_equal(fn(paper_hmm, arg, method="auto"), seq)
  batch = jnp.stack([tokens, jnp.roll(tokens, 7)])
  per = lambda method: jax.jit(jax.vmap(
      lambda t: hmm_lib.posterior(paper_hmm, t, method=method)))(batch)
  np.testing.assert_allclose(per("parallel"), per("sequential"), atol=3e-5)
  np.testing.assert_allclose(per("blocked"), per("sequential"), atol=3e-5)
  grad = lambda method: jax.grad(
      lambda m: hmm_lib.log_likelihood(m, tokens, method=method))(paper_hmm)
  for method in ("parallel", "blocked"):
    for x, y in zip(grad("sequential"), grad(method)):
      np.testing.assert_allclose(y, x, rtol=1e-3, atol=1e-3)
  assert hmm_lib.resolve_method("auto", 10240) == (
      "sequential" if jax.default_backend() == "cpu" else "parallel")


def test_a_bad_method_is_refused_and_smooth_by_defaults_to_the_scan(
    paper_hmm):
  tokens = jnp.asarray([0, MASK, 2, 3, 1])
  ev = hmm_lib.embed(paper_hmm, tokens)
  with pytest.raises(ValueError, match="^" + re.escape(
      "method must be one of ('sequential', 'parallel', 'blocked', 'auto'), "
      "got "
      "'fast'") + "$"):
    hmm_lib.posterior(paper_hmm, tokens, method="fast")
  # The kernel dispatch takes resolved kernels only: "auto" is refused by
  # name, not run as a silent default.
  with pytest.raises(ValueError, match="^" + re.escape(
      "smooth_by's method must be one of ('sequential', 'parallel', "
      "'blocked'), got 'auto' (hmm.resolve_method resolves 'auto')") + "$"):
    hmm_lib.smooth_by(paper_hmm, ev, "auto")
  # Its default is the scan.
  np.testing.assert_array_equal(
      jax.jit(hmm_lib.smooth_by)(paper_hmm, ev).posterior,
      _seq(paper_hmm, ev).posterior)


def test_auto_is_the_associative_scan_on_accelerators_from_its_threshold(
    monkeypatch, tiny_hmm):
  """Off the CPU, ``auto`` runs the parallel kernel from
  ``_AUTO_PARALLEL_FROM`` positions on and the scan below it, at the
  entry points (each resolves on its own input's length)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(hmm_lib, "_AUTO_PARALLEL_FROM", 6)
  assert [hmm_lib.resolve_method("auto", t) for t in (5, 6, 7)] == [
      "sequential", "parallel", "parallel"]
  tokens = [0, MASK, 2, 3, 1, 1]
  for length, kernel in ((5, "sequential"), (6, "parallel")):
    np.testing.assert_array_equal(
        hmm_lib.posterior(tiny_hmm, tokens[:length], method="auto"),
        hmm_lib.posterior(tiny_hmm, tokens[:length], method=kernel))


@pytest.mark.parametrize("method", _SLOW_KERNELS)
def test_right_padding_with_mask_gives_each_sequence_its_own_posterior(
    paper_hmm, method):
  """A batch of sequences of several lengths, right-padded with MASK to one
  length: at its real positions each row's posterior, masked posterior and
  conditionals are the unpadded sequence's, and so is its log-likelihood
  (a MASK's evidence is all ones: the padding marginalises out). Left
  padding is not the same: it starts the chain earlier (the first real
  state's prior becomes pi A^k, not pi)."""
  lengths, width = [5, 17, 32], 32
  rows = [np.asarray(hmm_lib.sample(jax.random.PRNGKey(n), paper_hmm, n)[0])
          for n in lengths]
  padded = np.full((len(rows), width), MASK, np.int32)
  for i, r in enumerate(rows):
    padded[i, :len(r)] = r
  fns = (hmm_lib.posterior, hmm_lib.masked_posterior, hmm_lib.conditionals)
  batched = [jax.vmap(lambda t, f=f: f(paper_hmm, t, method=method))(padded)
             for f in fns]
  lls = jax.vmap(lambda t: hmm_lib.log_likelihood(paper_hmm, t,
                                                  method=method))(padded)
  for i, r in enumerate(rows):
    n = len(r)
    for f, got in zip(fns, batched):
      np.testing.assert_allclose(got[i, :n], f(paper_hmm, r, method=method),
                                 atol=3e-5)
    np.testing.assert_allclose(lls[i], hmm_lib.log_likelihood(
        paper_hmm, r, method=method), rtol=1e-5)
  left = np.concatenate([np.full(width - lengths[0], MASK, np.int32),
                         rows[0]])
  assert abs(float(hmm_lib.log_likelihood(paper_hmm, left))
             - float(hmm_lib.log_likelihood(paper_hmm, rows[0]))) > 1e-3


@pytest.mark.parametrize("entry", [
    hmm_lib.posterior, hmm_lib.log_likelihood, hmm_lib.conditionals,
    memory_lib.memory_posterior, memory_lib.memory_masked_posterior,
    memory_lib.conditionals, memory_lib.cell_posteriors])
def test_an_entry_points_docstring_says_how_to_call_it(entry):
  """What a user reads in the API reference: the ``method`` values (where
  it takes one), what raises and when (at the call; under jit nothing is
  checked, hmm.check_tokens up front) and the right-padding rule."""
  doc = inspect.getdoc(entry)
  wants = ["Raises:", "ValueError", "jit", "check_tokens", "right-pad",
           "MASK", "left-pad"]
  if "method" in inspect.signature(entry).parameters:
    wants += ['"sequential"', '"parallel"', '"blocked"', '"auto"']
  assert [w for w in wants if w not in doc] == [], entry.__name__


def test_the_helpers_a_user_calls_have_docstrings():
  from hmmprompt import tasks, tuning  # pylint: disable=g-import-not-at-top
  for fn in (smoothing.safe_log, tasks.majority_share, tuning.stack_data):
    assert inspect.getdoc(fn), fn.__name__
  # safe_log's docstring: -inf at and below 0, and a gradient there that
  # a where() does not turn into NaN.
  np.testing.assert_array_equal(
      smoothing.safe_log(jnp.asarray([0.0, -1.0, 1.0])), [-np.inf, -np.inf, 0])
  assert float(jax.grad(lambda x: jnp.where(
      x > 0, smoothing.safe_log(x), 0.0))(0.0)) == 0.0


def test_the_filtered_posterior_is_bayes_on_the_prefix_by_brute_force():
  """``smoothing.filtered``: row t is the smoothed posterior of the prefix
  x_{<=t} alone (its last position), brute force over paths in float64."""
  hmm = random_dense_hmm(3, 3, 4)
  tokens = [2, MASK, 0, 3, 1]
  ev = np.asarray(hmm_lib.token_evidence(hmm, jnp.array(tokens, jnp.int32)))
  got = np.asarray(smoothing.filtered(hmm, jnp.asarray(ev)))
  for t in range(len(tokens)):
    _, post, _ = ref.brute_force(hmm.initial, hmm.transition, ev[:t + 1])
    np.testing.assert_allclose(got[t], post[t], rtol=1e-5, atol=1e-6)
