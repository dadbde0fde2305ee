import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import tasks
from hmmprompt import theory
from hmmprompt.backbones import exact

CFG = tasks.TaskConfig(num_train=10, num_val=10, num_test=400, seq_len=24)


def _rows(rng, shape):
  x = rng.gamma(1.0, size=shape)
  return x / x.sum(-1, keepdims=True)


def _mask_outputs(model, tokens_NxT, prompt=None):
  bb, bp = exact.make(model)
  idx = 0 if prompt is None else prompt.shape[0]

  def one(t):
    emb = bb.embed(bp, t)
    if prompt is not None:
      emb = jnp.concatenate([prompt, emb])
    return bb.apply(bp, emb)[idx]

  return np.asarray(jax.vmap(one)(tokens_NxT), np.float64)


def test_assumption_3_1():
  rng = np.random.default_rng(0)
  ok = hmm_lib.HMM(_rows(rng, 4).astype(np.float32),
                   _rows(rng, (4, 4)).astype(np.float32),
                   _rows(rng, (4, 6)).astype(np.float32))
  assert theory.assumption_3_1(ok).holds
  wide = hmm_lib.random_hmm(jax.random.PRNGKey(0), 12, 10)
  v = theory.assumption_3_1(wide)
  assert not v.holds and "|H| = 12 > |X| = 10" in v.reason
  dup = np.asarray(ok.emission).copy()
  dup[1] = dup[0]
  v = theory.assumption_3_1(ok._replace(emission=jnp.asarray(dup)))
  assert not v.holds and "rank 3 < |H| = 4" in v.reason


def test_assumption_3_2():
  e = np.full((3, 2), 0.5, np.float32)
  ergodic = hmm_lib.HMM(np.full(3, 1 / 3, np.float32),
                        np.array([[0, 1, 0], [0, 0.5, 0.5], [1, 0, 0]],
                                 np.float32), e)
  assert theory.assumption_3_2(ergodic).holds
  periodic = ergodic._replace(transition=jnp.array(
      [[0, 1, 0], [0, 0, 1], [1, 0, 0]], jnp.float32))
  assert "periodic" in theory.assumption_3_2(periodic).reason
  reducible = ergodic._replace(transition=jnp.array(
      [[1, 0, 0], [0, 0.5, 0.5], [0, 0.5, 0.5]], jnp.float32))
  assert "reducible" in theory.assumption_3_2(reducible).reason
  no_support = ergodic._replace(initial=jnp.array([0.5, 0.5, 0.0]))
  assert "full support" in theory.assumption_3_2(no_support).reason


def test_theorem_3_3_head_recovers_labels():
  rng = np.random.default_rng(1)
  model = hmm_lib.HMM(_rows(rng, 4).astype(np.float32),
                      _rows(rng, (4, 4)).astype(np.float32),
                      _rows(rng, (4, 6)).astype(np.float32))
  task = tasks.make_task(jax.random.PRNGKey(0), model, CFG)
  head = theory.theorem_3_3_head(model, task.mu)
  g = _mask_outputs(model, task.test.tokens)
  pred = np.argmax(g @ head["w"] + head["bias"], -1)
  np.testing.assert_array_equal(pred, task.test.labels)


def _designed_hmm(duplicate_columns: bool):
  """|H| = 6 > |X| = 4 (Assumption 3.1 fails); state 5 moves only to
  {0, 1}, so B = {5} gives H* = {0, 1} (Assumption 3.5 if W[:, {0,1}] is
  independent)."""
  rng = np.random.default_rng(2)
  trans = _rows(rng, (6, 6))
  trans[5] = [0.5, 0.5, 0, 0, 0, 0]
  trans[:5, 5] += 0.2  # every other state can reach 5
  trans /= trans.sum(-1, keepdims=True)
  emis = _rows(rng, (6, 4))
  if duplicate_columns:
    emis[1] = emis[0]
  return hmm_lib.HMM(np.full(6, 1 / 6, np.float32), trans.astype(np.float32),
                     emis.astype(np.float32))


MU = np.zeros((2, 6), np.float32)
MU[0, 0], MU[1, 1], MU[1, 0] = 1.0, 1.5, -0.4


def test_theorem_3_6_prompt_recovers_labels_where_heads_cannot():
  model = _designed_hmm(duplicate_columns=False)
  assert not theory.assumption_3_1(model).holds
  v = theory.assumption_3_5(model, MU)
  assert v.holds and v.details["H_star"] == [0, 1] and 5 in v.details["B"]
  with pytest.raises(ValueError, match="Theorem 3.3 needs Assumption 3.1"):
    theory.theorem_3_3_head(model, MU)
  tokens = tasks.sample_examples(jax.random.PRNGKey(3), model, 400, 24,
                                  "paper")
  latent = jax.vmap(lambda t: tasks.label_posterior(model, t))(tokens)
  labels = np.asarray(tasks.labels_from_latent(jnp.asarray(MU), latent))
  assert 0.1 < labels.mean() < 0.9
  u, head = theory.theorem_3_6_prompt_head(model, MU)
  g = _mask_outputs(model, tokens, prompt=jnp.asarray(u))
  np.testing.assert_array_equal(np.argmax(g @ head["w"], -1), labels)
  # Without the prompt, the same readout is wrong on many examples.
  g0 = _mask_outputs(model, tokens)
  assert np.mean(np.argmax(g0 @ head["w"], -1) == labels) < 0.95


def test_assumption_3_5_fails_with_dependent_columns():
  model = _designed_hmm(duplicate_columns=True)
  v = theory.assumption_3_5(model, MU)
  assert not v.holds and "independent" in v.reason
  with pytest.raises(ValueError, match="Theorem 3.6 needs Assumption 3.5"):
    theory.theorem_3_6_prompt_head(model, MU)


def test_memory_assumptions():
  rng = np.random.default_rng(4)
  make = lambda v: memory_lib.MemoryHMM(
      _rows(rng, 2).astype(np.float32), _rows(rng, 2).astype(np.float32),
      _rows(rng, (2, 2)).astype(np.float32),
      _rows(rng, (2, 2, v)).astype(np.float32))
  roomy = make(6)  # 4 columns in R^6
  v = theory.assumption_4_2(roomy)
  assert v.holds and v.details["H_star"] == [0, 1]
  cramped = make(3)  # 4 columns in R^3: 2 + 2 dims cannot be disjoint
  assert not theory.assumption_4_2(cramped).holds
  # Only memory values in supp(mu) count for 4.5: one value fits in R^3.
  mu = np.array([[1.0, 0.0], [-1.0, 0.0]])
  v45 = theory.assumption_4_5(cramped, mu)
  assert v45.holds and v45.details["memory_values"] == [0]
  stat = theory.assumption_4_4(roomy)
  assert "stationary" in stat.reason or "reducible" in stat.reason
