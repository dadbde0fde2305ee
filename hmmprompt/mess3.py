"""Mess3 (Marzen & Crutchfield 2017; Shai et al. 2024's anchor): a 3-state
edge-emitting process whose belief states form a fractal in the simplex.

Mess3 emits on its edges: ``T[s, i, j] = P(emit s, go to j | in i)``. This
project's :class:`~hmmprompt.hmm.HMM` emits from states, so it is written
exactly as an HMM over the 9 pairs ``(i, s)``, "in ``i``, about to emit
``s``": pair ``(i, s)`` emits ``s`` with probability 1, starts with ``pi_i
P(s | i)`` and moves to ``(j, y)`` with ``P(j | i, s) P(y | j)``, so every
sequence has the same probability under both. Pair ``i * 3 + s``."""

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import smoothing

SHAI = (0.05, 0.85)  # (x, alpha) of Shai et al.'s Figure 1


def edge_tensor(x: float = SHAI[0], alpha: float = SHAI[1]) -> np.ndarray:
  """``[S, I, J]`` = ``[3, 3, 3]``: ``T[s, i, j] = (alpha if j = s else (1 -
  alpha) / 2) * (1 - 2 x if i = j else x)``: symbol ``s`` is most likely on
  an edge into state ``s``, and from a state to itself."""
  if not (0 < x < 0.5 and 0 < alpha < 1):
    raise ValueError(f"Mess3 needs 0 < x < 0.5 and 0 < alpha < 1, got x = "
                     f"{x}, alpha = {alpha}")
  eye = np.eye(3, dtype=bool)
  return (np.where(eye[:, None, :], alpha, (1 - alpha) / 2)
          * np.where(eye, 1 - 2 * x, x)[None])


def as_hmm(edges_SxIxJ) -> hmm_lib.HMM:
  """The 9-pair state-emitting HMM of an edge-emitting process (module doc),
  started from its states' stationary distribution."""
  t = np.asarray(edges_SxIxJ, np.float64)
  states, symbols = t.shape[1], t.shape[0]
  emit_IxS = t.sum(-1).T  # P(s | i)
  w, v = np.linalg.eig(t.sum(0).T)  # of P(j | i)
  pi = np.real(v[:, np.argmin(np.abs(w - 1))])
  pi /= pi.sum()
  move_ISxJ = (np.transpose(t, (1, 0, 2)) / emit_IxS[..., None]).reshape(
      states * symbols, states)
  transition = (move_ISxJ[:, :, None] * emit_IxS[None]).reshape(
      states * symbols, states * symbols)
  emission = np.tile(np.eye(symbols), (states, 1))
  return hmm_lib.HMM(jnp.float32((pi[:, None] * emit_IxS).ravel()),
                     jnp.float32(transition), jnp.float32(emission))


def beliefs(model: hmm_lib.HMM, tokens_T: jax.Array, states: int = 3
            ) -> jax.Array:
  """``[T, I]``: ``P(S_{t+1} = j | x_{<=t})``, the machine's state after
  each token (Shai et al.'s belief), from the forward scan; traceable."""
  filt_TxZ = smoothing.filtered(model, hmm_lib.token_evidence(model, tokens_T))
  nxt_TxZ = filt_TxZ @ model.transition
  return nxt_TxZ.reshape(len(tokens_T), states, -1).sum(-1)
