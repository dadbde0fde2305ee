"""hmmprompt.mess3: Mess3 as a 9-pair state-emitting HMM, checked against
the edge-emitting process itself in float64 numpy."""

import jax
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import mess3

EDGES = mess3.edge_tensor()  # Shai et al.'s x = 0.05, alpha = 0.85
MODEL = mess3.as_hmm(EDGES)


def _tokens(seed: int, length: int) -> np.ndarray:
  return np.asarray(hmm_lib.sample(jax.random.PRNGKey(seed), MODEL, length)[0])


def test_its_stationary_distribution_is_uniform():
  step = EDGES.sum(0)  # P(j | i), symbols summed out
  np.testing.assert_allclose(step.sum(1), 1.0, atol=1e-15)
  np.testing.assert_allclose(np.full(3, 1 / 3) @ step, 1 / 3, atol=1e-15)
  start = np.asarray(MODEL.initial, np.float64)
  np.testing.assert_allclose(start.reshape(3, 3).sum(1), 1 / 3, atol=1e-7)
  # The pairs start stationary too: a sequence may begin anywhere.
  np.testing.assert_allclose(start @ np.asarray(MODEL.transition), start,
                             atol=1e-7)


def test_a_sequence_has_the_edge_processs_probability():
  for seed in range(3):
    x = _tokens(seed, 8)
    p = np.full(3, 1 / 3)
    for s in x:
      p = p @ EDGES[s]
    assert float(hmm_lib.log_likelihood(MODEL, x)) == pytest.approx(
        np.log(p.sum()), rel=1e-5)


def test_its_beliefs_equal_a_float64_filter():
  """``eta_t = eta_{t-1} T[x_t] / norm`` from the uniform start, in float64;
  the float32 scan's rounding grows at most ~H eps a step over T steps."""
  x = _tokens(4, 60)
  eta, want = np.full(3, 1 / 3), []
  for s in x:
    eta = eta @ EDGES[s]
    eta /= eta.sum()
    want.append(eta)
  got = np.asarray(jax.jit(mess3.beliefs)(MODEL, x))
  np.testing.assert_allclose(got, want, atol=len(x) * 9 * 2.0**-23)
  # Not the uniform start: the beliefs move (the fractal needs them to).
  assert np.ptp(got[:, 0]) > 0.3


@pytest.mark.parametrize("x, alpha", [(0.0, 0.85), (0.5, 0.85), (0.05, 1.0)])
def test_bad_parameters_are_refused(x, alpha):
  with pytest.raises(ValueError, match="Mess3 needs"):
    mess3.edge_tensor(x, alpha)
