import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt.hmm import MASK
import reference as ref


def _dense(rng, shape):
  x = rng.gamma(1.0, size=shape)
  return (x / x.sum(-1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_memory():
  rng = np.random.default_rng(3)
  return memory_lib.MemoryHMM(_dense(rng, (3,)), _dense(rng, (2,)),
                              _dense(rng, (2, 2)), _dense(rng, (3, 2, 4)))


def _brute_memory(mhmm, tokens):
  """P[M = m, x] for each m by enumerating syntax paths per memory value."""
  joint = []
  for m in range(mhmm.memory_size):
    ev = ref.evidence_from_tokens(np.asarray(mhmm.emission)[m], tokens)
    lik = ref.brute_force(mhmm.initial, mhmm.transition, ev)[0]
    joint.append(float(mhmm.memory_prior[m]) * lik)
  return np.array(joint)


@pytest.mark.parametrize("tokens", [[0, 1, 3, 2], [MASK, 1, MASK, 2]])
def test_memory_posterior_matches_brute_force(tiny_memory, tokens):
  joint = _brute_memory(tiny_memory, tokens)
  np.testing.assert_allclose(memory_lib.memory_posterior(tiny_memory, tokens),
                             joint / joint.sum(), atol=2e-6)
  # P[M | x_{-t}] for every t, from the product HMM, against brute force on
  # the sequence with position t masked.
  masked = memory_lib.memory_masked_posterior(tiny_memory, tokens)
  for t in range(len(tokens)):
    x = list(tokens)
    x[t] = MASK
    j = _brute_memory(tiny_memory, x)
    np.testing.assert_allclose(masked[t], j / j.sum(), atol=2e-6)


def test_product_hmm_is_equivalent(tiny_memory):
  product = memory_lib.to_hmm(tiny_memory)
  assert product.num_states == 6
  trans = np.asarray(product.transition)
  # Memory never changes: no mass off the diagonal blocks.
  for a in range(3):
    for b in range(3):
      if a != b:
        assert np.all(trans[2 * a:2 * a + 2, 2 * b:2 * b + 2] == 0)
  tokens = [0, 2, MASK, 1]
  joint = _brute_memory(tiny_memory, tokens)
  np.testing.assert_allclose(hmm_lib.log_likelihood(product, tokens),
                             np.log(joint.sum()), rtol=1e-5)
  # Brute force on the product chain itself (6^4 paths).
  ev = ref.evidence_from_tokens(product.emission, tokens)
  _, post, _ = ref.brute_force(product.initial, product.transition, ev)
  np.testing.assert_allclose(
      post[0].reshape(3, 2).sum(-1),
      memory_lib.memory_posterior(tiny_memory, tokens), atol=2e-6)
  np.testing.assert_allclose(
      memory_lib.conditionals(tiny_memory, tokens),
      hmm_lib.conditionals(product, tokens), atol=1e-7)


def test_memory_sampler_frequencies(tiny_memory):
  n = 20000
  keys = jax.random.split(jax.random.PRNGKey(0), n)
  tokens, syntax, mem = jax.jit(jax.vmap(
      lambda k: memory_lib.sample(k, tiny_memory, 5)))(keys)
  mem = np.asarray(mem)
  np.testing.assert_allclose(np.bincount(mem, minlength=3) / n,
                             tiny_memory.memory_prior, atol=0.015)
  # Token distribution at t = 0 given the memory value.
  for m in range(3):
    sel = mem == m
    freq = np.bincount(np.asarray(tokens)[sel, 0], minlength=4) / sel.sum()
    expected = np.asarray(tiny_memory.initial) @ np.asarray(
        tiny_memory.emission)[m]
    np.testing.assert_allclose(freq, expected, atol=0.03)
  assert np.asarray(syntax).max() < 2


class EntryPointsUnderJitTest(chex.TestCase):
  """The memory posteriors under a caller's ``jit`` (their checks then see
  tracers) equal the direct calls (``chex.variants``: one test per
  variant)."""

  @chex.variants(with_jit=True, without_jit=True)
  def test_memory_posteriors_match_direct_calls(self):
    mhmm = memory_lib.random_memory_hmm(jax.random.PRNGKey(3), 3, 4, 5)
    tokens = memory_lib.sample(jax.random.PRNGKey(4), mhmm, 6)[0]
    tokens = tokens.at[jnp.array([1, 4])].set(MASK)
    for fn in (memory_lib.memory_posterior,
               memory_lib.memory_masked_posterior):
      want = fn(mhmm, tokens)
      assert np.all(np.asarray(want).sum(-1) > 0.99)  # possible: not zeros
      chex.assert_trees_all_close(self.variant(fn)(mhmm, tokens), want,
                                  rtol=1e-6, atol=1e-7)


def test_random_memory_hmm_and_vanilla_twin():
  mhmm = memory_lib.random_memory_hmm(jax.random.PRNGKey(0), 7, 4, 10)
  assert mhmm.emission.shape == (7, 4, 10)
  np.testing.assert_allclose(np.asarray(mhmm.transition).sum(0), 1.0,
                             rtol=1e-5)
  twin = memory_lib.vanilla_twin(jax.random.PRNGKey(0), 7, 4, 10)
  assert twin.num_states == 28 and twin.vocab_size == 10
  # Long sequences identify the memory (what makes the right panel easy).
  tokens, _, mem = memory_lib.sample(jax.random.PRNGKey(1), mhmm, 129)
  post = memory_lib.memory_posterior(mhmm, tokens)
  assert int(jnp.argmax(post)) == int(mem)


def _multi(rng, n, m, s, v):
  """A dense multi-cell memory HMM with N, M, S, V = n, m, s, v."""
  return memory_lib.MultiMemoryHMM(
      _dense(rng, (n, m)), _dense(rng, (n * s,)), _dense(rng, (n * s, n * s)),
      _dense(rng, (n, m, s, v)))


@pytest.fixture(scope="module")
def tiny_multi():
  return _multi(np.random.default_rng(4), 2, 2, 1, 3)


def test_multi_cell_posteriors_match_brute_force(tiny_multi):
  mm = tiny_multi
  tokens = [0, 2, MASK, 1]
  n, m, s = mm.num_cells, mm.memory_size, mm.num_syntax
  prior = np.asarray(mm.memory_prior, np.float64)
  emis = np.asarray(mm.emission, np.float64)
  init = np.asarray(mm.initial, np.float64)
  trans = np.asarray(mm.transition, np.float64)
  marg = np.zeros((n, m))
  for config in itertools.product(range(m), repeat=n):
    p_config = np.prod([prior[j, config[j]] for j in range(n)])
    for path in itertools.product(range(n * s), repeat=len(tokens)):
      w = p_config * init[path[0]]
      for a, b in zip(path[:-1], path[1:]):
        w *= trans[a, b]
      for x, js in zip(tokens, path):
        j, syn = divmod(js, s)
        if x != MASK:
          w *= emis[j, config[j], syn, x]
      for j in range(n):
        marg[j, config[j]] += w
  expected = marg / marg.sum(-1, keepdims=True)
  np.testing.assert_allclose(memory_lib.cell_posteriors(mm, tokens), expected,
                             atol=2e-6)


def test_multi_cell_sampler_and_size_limit(tiny_multi):
  tokens, cells, syntax, mem = memory_lib.multi_sample(
      jax.random.PRNGKey(0), tiny_multi, 20)
  assert tokens.shape == cells.shape == syntax.shape == (20,)
  assert mem.shape == (2,)
  big = _multi(np.random.default_rng(0), 4, 6, 3, 10)
  with pytest.raises(ValueError, match="MAX_PRODUCT_STATES"):
    memory_lib.cell_posteriors(big, [0, 1])


@pytest.mark.parametrize("field,value,match", [
    ("memory_prior", [0.5, 0.6], "MemoryHMM.memory_prior must sum to 1"),
    ("emission", np.full((2, 3, 4), 0.25), r"MemoryHMM.emission must have "
     r"shape \[M, H, V\]"),
    ("transition", [[0.5, 0.5]], "MemoryHMM.transition must have shape"),
    # Each field's own check names that field (not another's, not None).
    ("initial", [0.5, 0.6], r"^MemoryHMM.initial must sum to 1"),
    ("transition", [[0.5, 0.6], [0.5, 0.5]],
     r"^MemoryHMM.transition must sum to 1 along its last axis, but row "
     r"\[0\]"),
    ("emission", np.full((2, 2, 4), 0.3),
     r"^MemoryHMM.emission must sum to 1"),
])
def test_malformed_memory_hmm_raises(field, value, match):
  rng = np.random.default_rng(0)
  kwargs = dict(memory_prior=_dense(rng, (2,)), initial=_dense(rng, (2,)),
                transition=_dense(rng, (2, 2)),
                emission=_dense(rng, (2, 2, 4)))
  kwargs[field] = np.asarray(value, np.float32)
  with pytest.raises(ValueError, match=match):
    memory_lib.MemoryHMM(**kwargs)


def test_a_wrong_shape_is_named_before_row_sums():
  """Issue 66: a memory HMM's field of the wrong shape (rows that do not
  sum to 1, too) is named by its shape, as the HMM's."""
  rng = np.random.default_rng(0)
  emission = _dense(rng, (2, 2, 5)).transpose(0, 2, 1)  # [M, V, H]
  with pytest.raises(ValueError, match=r"^MemoryHMM.emission must have "
                     r"shape \[M, H, V\] = \(2, 2, V\), got \(2, 5, 2\)$"):
    memory_lib.MemoryHMM(_dense(rng, (2,)), _dense(rng, (2,)),
                         _dense(rng, (2, 2)), emission)
  multi = _multi(rng, 2, 2, 2, 3)
  with pytest.raises(ValueError, match=r"^MultiMemoryHMM.initial/transition "
                     r"must have shapes \(4,\)"):
    multi._replace(initial=np.full(3, 0.5, np.float32))


def test_memory_bad_tokens_raise(tiny_memory):
  with pytest.raises(ValueError, match="out of range"):
    memory_lib.memory_posterior(tiny_memory, [0, 4])
  with pytest.raises(ValueError, match="length must be a positive int"):
    memory_lib.sample(jax.random.PRNGKey(0), tiny_memory, 0)
  with pytest.raises(ValueError, match="memory_size, num_states and vocab"):
    memory_lib.random_memory_hmm(jax.random.PRNGKey(0), 0, 2, 3)


def test_memory_entry_points_run_their_kernels(tiny_memory, tiny_multi):
  """What traced package code calls (the kernels) gives the entry points'
  numbers."""
  tokens = jnp.array([0, MASK, 3, 2], jnp.int32)
  np.testing.assert_allclose(
      memory_lib.memory_posterior(tiny_memory, tokens),
      jax.jit(memory_lib.token_memory_posterior)(tiny_memory, tokens),
      atol=1e-7)
  np.testing.assert_allclose(
      memory_lib.memory_masked_posterior(tiny_memory, tokens),
      jax.jit(memory_lib.token_memory_masked_posterior)(tiny_memory, tokens),
      atol=1e-7)
  np.testing.assert_allclose(
      memory_lib.cell_posteriors(tiny_multi, [0, 2, MASK]),
      jax.jit(memory_lib.token_cell_posteriors)(
          tiny_multi, jnp.array([0, 2, MASK], jnp.int32)), atol=1e-7)
  key = jax.random.PRNGKey(2)
  for a, b in zip(memory_lib.sample(key, tiny_memory, 9),
                  memory_lib.draw_memory_sequence(key, tiny_memory, 9)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("field,value,match", [
    ("memory_prior", np.full((2, 2), 0.6),
     r"^MultiMemoryHMM.memory_prior must sum to 1"),
    ("memory_prior", np.full((1, 2, 2), 0.5),
     r"^MultiMemoryHMM.memory_prior must have shape \[N, M\] \(batches "
     r"of multi-cell HMMs are not supported\)$"),
    ("initial", np.full((2,), 0.6), r"^MultiMemoryHMM.initial must sum to 1"),
    ("transition", np.full((2, 2), 0.6),
     r"^MultiMemoryHMM.transition must sum to 1"),
    ("emission", np.full((2, 2, 1, 3), 0.5),
     r"^MultiMemoryHMM.emission must sum to 1"),
    ("emission", np.full((2, 3, 1, 3), 1 / 3),
     r"^MultiMemoryHMM.emission must have shape \[N, M, S, V\] = \(2, 2, "
     r"S, V\), got \(2, 3, 1, 3\)$"),
    # Only the transition off: ``or``, not ``and``, of the two shapes.
    ("transition", np.full((3, 3), 1 / 3),
     r"^MultiMemoryHMM.initial/transition must have shapes \(2,\) and "
     r"\(2, 2\) for N\*S = 2, got \(2,\) and \(3, 3\)$"),
])
def test_malformed_multi_memory_hmm_raises(field, value, match):
  """Every field's check names it, and the shape checks say what was
  expected and got (N = 2 cells, M = 2, S = 1)."""
  rng = np.random.default_rng(0)
  kwargs = dict(memory_prior=_dense(rng, (2, 2)), initial=_dense(rng, (2,)),
                transition=_dense(rng, (2, 2)),
                emission=_dense(rng, (2, 2, 1, 3)))
  memory_lib.MultiMemoryHMM(**kwargs)  # the valid one
  kwargs[field] = np.asarray(value, np.float32)
  with pytest.raises(ValueError, match=match):
    memory_lib.MultiMemoryHMM(**kwargs)


def test_impossible_and_out_of_range_tokens_give_a_zero_posterior():
  """A sequence no memory value can emit has the documented all-zero
  posterior (not a uniform one); under a caller's jit the kernel gives
  an out-of-range token zero likelihood too, not a clamped one."""
  emission = np.full((2, 2, 3), 0.5, np.float32)
  emission[..., 2] = 0.0  # token 2 is never emitted
  mhmm = memory_lib.MemoryHMM(np.array([0.3, 0.7], np.float32),
                              np.array([0.5, 0.5], np.float32),
                              np.full((2, 2), 0.5, np.float32), emission)
  # Every memory value emits 0 and 1 alike: the posterior is the prior.
  np.testing.assert_allclose(memory_lib.memory_posterior(mhmm, [0, 1]),
                             [0.3, 0.7], rtol=1e-6)
  np.testing.assert_array_equal(memory_lib.memory_posterior(mhmm, [0, 2]),
                                np.zeros(2))
  kernel = jax.jit(memory_lib.token_memory_posterior)
  np.testing.assert_array_equal(kernel(mhmm, jnp.array([0, 3], jnp.int32)),
                                np.zeros(2))
  # In range, the kernel gives the entry point's posterior.
  np.testing.assert_allclose(kernel(mhmm, jnp.array([0, 1], jnp.int32)),
                             [0.3, 0.7], rtol=1e-6)


def test_multi_sample_returns_ints():
  """The multi-cell sampler returns integer cells, syntax states and
  memory that index the model."""
  n, m, s, v = 2, 3, 2, 5
  mm = _multi(np.random.default_rng(2), n, m, s, v)
  tokens, cells, syntax, mem = memory_lib.multi_sample(
      jax.random.PRNGKey(3), mm, 30)
  for x in (tokens, cells, syntax, mem):
    assert jnp.issubdtype(x.dtype, jnp.integer), x.dtype
  assert 0 <= int(cells.min()) and int(cells.max()) < n
  assert 0 <= int(syntax.min()) and int(syntax.max()) < s
  assert 0 <= int(mem.min()) and int(mem.max()) < m


def test_product_size_limit_is_inclusive():
  """Exactly MAX_PRODUCT_STATES product states (16^2 * 2 * 4 = 2048) is
  built; one syntax state more (2560) is refused."""
  at = _multi(np.random.default_rng(0), 2, 16, 4, 3)
  assert at.num_product_states == memory_lib.MAX_PRODUCT_STATES
  memory_lib._check_product_size(at)  # pylint: disable=protected-access
  over = _multi(np.random.default_rng(0), 2, 16, 5, 3)
  with pytest.raises(ValueError, match="= 2560 states, above "
                     "MAX_PRODUCT_STATES = 2048"):
    memory_lib._check_product_size(over)  # pylint: disable=protected-access


def test_vanilla_twin_passes_its_temperatures_on():
  """Figure 3's twin is Appendix D's random HMM on |M||H| states, with the
  temperatures it is given."""
  key = jax.random.PRNGKey(4)
  twin = memory_lib.vanilla_twin(key, 2, 3, 5, transition_temp=1.0)
  want = hmm_lib.random_hmm(key, 6, 5, transition_temp=1.0)
  chex.assert_trees_all_equal(twin, want)
  assert not np.array_equal(np.asarray(twin.transition), np.asarray(
      memory_lib.vanilla_twin(key, 2, 3, 5).transition))


# ---------------------------------------------------------------------------
def _bypass(model, **changes):
  """``model`` with ``changes``, past the constructor's checks, as JAX's
  own rebuilds (``tree.map``, a jitted function's output) make one:
  ``_replace`` checks since it goes through the constructor."""
  return tuple.__new__(type(model),
                       tuple({**model._asdict(), **changes}.values()))


# The model's arrays at every entry point: a model made past the constructor (``_bypass``)
# skipped its constructor's checks (as for hmm.HMM, tests/test_hmm.py).

_TOKENS = [0, MASK, 2]
_ROWS = [[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]


def _good(kind):
  """A valid model: M = 2, H = 2, V = 3; multi: N = 2, M = 2, S = 1."""
  f32 = lambda x: np.asarray(x, np.float32)
  transition = [[0.9, 0.1], [0.2, 0.8]]
  if kind == "single":
    return memory_lib.MemoryHMM(f32([0.5, 0.5]), f32([0.5, 0.5]),
                                f32(transition), f32([_ROWS, _ROWS[::-1]]))
  return memory_lib.MultiMemoryHMM(
      f32([[0.5, 0.5], [0.3, 0.7]]), f32([0.5, 0.5]), f32(transition),
      f32([[[_ROWS[0]], [_ROWS[1]]], [[_ROWS[1]], [_ROWS[0]]]]))


ENTRY_POINTS = {
    "single": {
        "sample": lambda m: memory_lib.sample(jax.random.PRNGKey(0), m, 4),
        "memory_posterior": lambda m: memory_lib.memory_posterior(m, _TOKENS),
        "memory_masked_posterior":
            lambda m: memory_lib.memory_masked_posterior(m, _TOKENS),
        "conditionals": lambda m: memory_lib.conditionals(m, _TOKENS),
    },
    "multi": {
        "cell_posteriors": lambda m: memory_lib.cell_posteriors(m, _TOKENS),
        "multi_sample":
            lambda m: memory_lib.multi_sample(jax.random.PRNGKey(0), m, 4),
    },
}


def _bad_fields(kind):
  """(field, value of the bad model, the whole refusal): rows summing to 3,
  a negative entry, a NaN, a wrong shape."""
  good = _good(kind)
  name = type(good).__name__
  negative = np.asarray(good.emission).copy()
  negative.reshape(-1, 3)[0] = [0.6, 0.5, -0.1]
  index = [0] * (negative.ndim - 1) + [2]
  shape = (f"{name}.transition must have shape (2, 2) to match "
           f"{name}.initial, got (3, 3)" if kind == "single" else
           f"{name}.initial/transition must have shapes (2,) and (2, 2) for "
           f"N*S = 2, got (2,) and (3, 3)")
  nan_field = "memory_prior" if kind == "single" else "initial"
  nan = np.asarray(getattr(good, nan_field)).copy()
  nan.reshape(-1)[0] = np.nan
  return [
      ("transition", good.transition * 3,
       f"{name}.transition must sum to 1 along its last axis, but row [0] "
       f"sums to 3"),
      ("emission", negative,
       f"{name}.emission has a negative entry -0.1 at index {index}"),
      (nan_field, nan, f"{name}.{nan_field} has a non-finite entry at index "
       f"{[0] * nan.ndim}"),
      ("transition", np.full((3, 3), 1 / 3, np.float32), shape),
  ]


def test_the_entry_point_table_is_every_entry_point():
  """Every public function made by validation.entry_point that takes a
  model is in the table (the random_* ones make one), besides the two
  public functions over the vanilla entry points."""
  made = {n for n, f in vars(memory_lib).items()
          if not n.startswith("_") and hasattr(f, "kernel")}
  tabled = {n for table in ENTRY_POINTS.values() for n in table}
  assert {n for n in made if not n.startswith("random_")} | {
      "conditionals", "multi_sample"} == tabled


@pytest.mark.parametrize("kind,entry,case", [
    (kind, entry, case) for kind, table in ENTRY_POINTS.items()
    for entry in sorted(table) for case in range(4)])
def test_entry_points_refuse_a_replaced_bad_model(kind, entry, case):
  """Each entry point checks the memory model it is given as the
  constructor would, naming the model's own field, and accepts the valid
  one."""
  good = _good(kind)
  call = ENTRY_POINTS[kind][entry]
  call(good)
  field, value, message = _bad_fields(kind)[case]
  bad = _bypass(good, **{field: jnp.asarray(value, jnp.float32)})
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    call(bad)
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    memory_lib.check_model(bad)
  assert memory_lib.check_model(good) is good


def test_the_memory_model_check_skips_tracers(monkeypatch):
  """Under a caller's jit the check never runs (not refused, not compiled
  in); on a concrete model it runs once per call. checkify_model checks
  the traced values under ``checkify.checkify`` instead."""
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top
  calls = []
  real = memory_lib._validate_memory  # pylint: disable=protected-access
  monkeypatch.setattr(memory_lib, "_validate_memory",
                      lambda *a, **k: (calls.append(1), real(*a, **k))[1])
  good = _good("single")
  tokens = jnp.array(_TOKENS, jnp.int32)
  want = memory_lib.memory_posterior(good, tokens)
  assert len(calls) == 1
  bad = _bypass(good, transition=good.transition * 3)
  jax.jit(memory_lib.memory_posterior)(bad, tokens)  # traced: not refused
  assert len(calls) == 1

  def f(model, toks):
    memory_lib.checkify_model(model)
    return memory_lib.memory_posterior(model, toks)

  checked = jax.jit(checkify.checkify(f))
  err, out = checked(good, tokens)
  err.throw()
  np.testing.assert_allclose(out, want, atol=1e-7)
  err, _ = checked(bad, tokens)
  with pytest.raises(checkify.JaxRuntimeError, match="^" + re.escape(
      "MemoryHMM.transition must sum to 1 along its last axis, but a row is "
      "off by 2 (`check` failed)") + "$"):
    err.throw()


def test_memory_kernels_run_the_method_they_are_given(kernels_run):
  mhmm = memory_lib.random_memory_hmm(jax.random.PRNGKey(2), 4, 3, 10)
  tokens = memory_lib.sample(jax.random.PRNGKey(3), mhmm, 8)[0]
  for fn in (memory_lib.token_memory_posterior,
             memory_lib.token_memory_masked_posterior):
    for method in ("parallel", "blocked"):
      kernels_run.clear()
      jax.eval_shape(lambda: fn(mhmm, tokens, method))
      assert set(kernels_run) == {method}, (fn.__name__, kernels_run)


def test_memory_entry_points_take_a_method_and_agree():
  """The memory HMM's posteriors and conditionals by associative scans equal
  the scan's to float rounding (tests/test_hmm.py's tolerance), with MASKs
  and on the paper's sparse memory HMMs."""
  mhmm = memory_lib.random_memory_hmm(jax.random.PRNGKey(2), 4, 3, 10)
  tokens = memory_lib.sample(jax.random.PRNGKey(3), mhmm, 48)[0]
  tokens = jnp.asarray(tokens).at[::4].set(hmm_lib.MASK)
  for fn in (memory_lib.memory_posterior, memory_lib.memory_masked_posterior,
             memory_lib.conditionals):
    seq = fn(mhmm, tokens, method="sequential")
    for method in ("parallel", "blocked"):
      np.testing.assert_allclose(fn(mhmm, tokens, method=method), seq,
                                 atol=3e-5)
    np.testing.assert_array_equal(fn(mhmm, tokens), seq)  # auto on a CPU


def test_right_padding_with_mask_gives_each_memory_sequence_its_own(
    tiny_multi):
  """The memory entry points' docstrings' padding rule: a batch of several
  lengths right-padded with MASK gives each row its unpadded sequence's
  memory posterior, masked posteriors, conditionals and (multi-cell) cell
  posteriors at its real positions."""
  mhmm = memory_lib.random_memory_hmm(jax.random.PRNGKey(2), 4, 3, 10)
  lengths, width = [3, 9, 16], 16
  rows = [np.asarray(memory_lib.sample(jax.random.PRNGKey(n), mhmm, n)[0])
          for n in lengths]
  padded = np.full((len(rows), width), MASK, np.int32)
  for i, r in enumerate(rows):
    padded[i, :len(r)] = r
  for fn, per_position in ((memory_lib.memory_posterior, False),
                           (memory_lib.memory_masked_posterior, True),
                           (memory_lib.conditionals, True)):
    got = jax.vmap(lambda t, f=fn: f(mhmm, t))(padded)
    for i, r in enumerate(rows):
      np.testing.assert_allclose(got[i, :len(r)] if per_position else got[i],
                                 fn(mhmm, r), atol=3e-5, err_msg=fn.__name__)
  multi = [np.asarray(memory_lib.multi_sample(jax.random.PRNGKey(n),
                                              tiny_multi, n)[0])
           for n in (2, 5)]
  padded = np.full((2, 5), MASK, np.int32)
  padded[0, :2], padded[1] = multi
  got = jax.vmap(lambda t: memory_lib.cell_posteriors(tiny_multi, t))(padded)
  for i, r in enumerate(multi):
    np.testing.assert_allclose(got[i], memory_lib.cell_posteriors(
        tiny_multi, r), atol=3e-5)
