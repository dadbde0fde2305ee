"""The forward-backward kernels on evidence vectors ``e_t [T, H]``, traceable
and unbatched, that :mod:`~hmmprompt.hmm` picks by ``method`` and wraps.
Messages are rescaled at every step (float32 holds on 10^4 tokens); an
impossible sequence gives ``-inf`` and zeros, never NaN, in values and
gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # the kernels read its fields; it imports them
  from hmmprompt.hmm import HMM


class Smoothed(NamedTuple):
  """Everything one forward-backward pass gives (shapes for one sequence)."""

  log_likelihood: jax.Array  # [] log P(evidence); -inf if impossible
  posterior: jax.Array  # [T, H] P[H_t | all evidence]
  masked_posterior: jax.Array  # [T, H] P[H_t | evidence at positions != t]


@jax.custom_jvp
def _unit_sum(x: jax.Array) -> jax.Array:
  s = jnp.sum(x, axis=-1, keepdims=True)
  return x / jnp.where(s > 0, s, 1.0)


@_unit_sum.defjvp
def _unit_sum_jvp(primals, tangents):
  # d(x / s) = (dx - y sum(dx)) / s with y = x / s. Autodiff's x ds / s**2
  # underflows: s**2 is 0 in float32 for the tiny sums of near-deterministic
  # HMMs (s < 1e-19), and inf * 0 = NaN gradients.
  (x,), (dx,) = primals, tangents
  s = jnp.sum(x, axis=-1, keepdims=True)
  safe = jnp.where(s > 0, s, 1.0)
  y = x / safe
  return y, (dx - y * jnp.sum(dx, axis=-1, keepdims=True)) / safe


def _normalize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x >= 0`` rescaled to sum 1 (zeros stay zero), and the sum."""
  return _unit_sum(x), jnp.sum(x, axis=-1)


def safe_log(x: jax.Array) -> jax.Array:
  """Elementwise ``log x``, ``-inf`` where ``x <= 0``, with no NaN in the value
  or gradient there (``jnp.log``'s gradient at 0 is NaN through a ``where``)."""
  pos = x > 0
  return jnp.where(pos, jnp.log(jnp.where(pos, x, 1.0)), -jnp.inf)


def forward_backward(hmm: HMM, evidence_TxH: jax.Array) -> Smoothed:
  """Forward scan, then a backward scan emitting the posteriors (on XLA:CPU
  faster than afterwards, as is not unrolling): ``pred_t ∝ P[H_t, e_{<t}]``,
  ``back_t ∝ P[e_{>t} | H_t]``, ``pred_t ⊙ back_t ∝ P[H_t, e_{-t}]``, ``⊙ e_t``
  the posterior; the scales ``c_t = P(e_t | e_{<t})`` give log P(e)."""
  init_H, trans_HxH, ev_TxH = _promoted(hmm, evidence_TxH)
  _, (pred_TxH, c_T) = jax.lax.scan(_forward_step(trans_HxH), init_H, ev_TxH)
  _, (post_TxH, masked_TxH) = jax.lax.scan(
      _backward_step(trans_HxH), jnp.ones_like(pred_TxH[0]),
      (pred_TxH, ev_TxH), reverse=True)
  return Smoothed(jnp.sum(safe_log(c_T)), post_TxH, masked_TxH)


def predicted(hmm: HMM, evidence_TxH: jax.Array) -> jax.Array:
  """``[T, H]``: ``pred_t ∝ P[H_t, e_{<t}]``, the forward scan alone."""
  init_H, trans_HxH, ev_TxH = _promoted(hmm, evidence_TxH)
  _, (pred_TxH, _) = jax.lax.scan(_forward_step(trans_HxH), init_H, ev_TxH)
  return pred_TxH


def filtered(hmm: HMM, evidence_TxH: jax.Array) -> jax.Array:
  """``[T, H]``: ``P[H_t | e_{<=t}]``, what a causal model may know at
  ``t`` (all zeros after an impossible prefix)."""
  filt_TxH, _ = _normalize(predicted(hmm, evidence_TxH) * evidence_TxH)
  return filt_TxH


def _promoted(hmm: HMM, evidence_TxH: jax.Array):
  """``(initial, transition, evidence)`` in their common dtype."""
  dtype = jnp.result_type(hmm.transition.dtype, evidence_TxH.dtype)
  return (hmm.initial.astype(dtype), hmm.transition.astype(dtype),
          evidence_TxH.astype(dtype))


def _forward_step(trans_HxH):
  """``pred_t -> pred_{t+1}``, emitting ``(pred_t, c_t)``."""
  def forward(pred_H, ev_H):
    filt_H, c = _normalize(pred_H * ev_H)
    return filt_H @ trans_HxH, (pred_H, c)
  return forward


def _backward_step(trans_HxH):
  """``back_t -> back_{t-1}``, emitting ``(posterior, masked)`` at ``t``."""
  def backward(back_H, pred_ev):
    pred_H, ev_H = pred_ev
    masked_H, _ = _normalize(pred_H * back_H)
    post_H, _ = _normalize(masked_H * ev_H)
    back_prev_H, _ = _normalize(trans_HxH @ (ev_H * back_H))
    return back_prev_H, (post_H, masked_H)
  return backward


def forward_backward_blocked(hmm: HMM, evidence_TxH: jax.Array) -> Smoothed:
  """:func:`forward_backward` in ``C`` blocks of ``L = ceil(sqrt(T))``
  positions: all blocks' transfer matrices at once (``L`` steps), the
  messages entering each (``C``), then all blocks' own steps at once (``2 L``):
  ~``5 sqrt(T)`` dependent steps, not ``2 T``, for accelerators. Equal to the
  sequential kernel to float rounding."""
  init_H, trans_HxH, ev_TxH = _promoted(hmm, evidence_TxH)
  dtype, (num, h) = ev_TxH.dtype, ev_TxH.shape
  size = max(1, int(np.ceil(np.sqrt(num))))
  blocks = -(-num // size)
  pad_PxH = jnp.ones((blocks * size - num, h), dtype)
  ev_CxLxH = jnp.concatenate([ev_TxH, pad_PxH]).reshape(blocks, size, h)
  def transfer(carry, ev_CxH):
    fwd_CxHxH, bwd_CxHxH = carry
    return (_rescaled(fwd_CxHxH @ (ev_CxH[:, :, None] * trans_HxH))[0],
            _rescaled(bwd_CxHxH @ (trans_HxH * ev_CxH[:, None, :]))[0]), None
  eye_CxHxH = jnp.broadcast_to(jnp.eye(h, dtype=dtype), (blocks, h, h))
  (fwd_CxHxH, bwd_CxHxH), _ = jax.lax.scan(
      transfer, (eye_CxHxH, eye_CxHxH), jnp.swapaxes(ev_CxLxH, 0, 1))
  # The messages entering each block: the forward one before its first
  # position, the backward one at its last.
  step_in = lambda m_H, t_HxH: (_normalize(m_H @ t_HxH)[0], m_H)
  _, pred_in_CxH = jax.lax.scan(step_in, init_H, fwd_CxHxH)
  step_back = lambda b_H, t_HxH: (_normalize(t_HxH @ b_H)[0], b_H)
  _, back_in_CxH = jax.lax.scan(step_back, jnp.ones((h,), dtype), bwd_CxHxH,
                                reverse=True)
  forward = lambda p_H, ev_LxH: jax.lax.scan(_forward_step(trans_HxH), p_H,
                                             ev_LxH)
  out_CxH, (pred_CxLxH, c_CxL) = jax.vmap(forward)(pred_in_CxH, ev_CxLxH)
  backward = lambda b_H, pred_LxH, ev_LxH: jax.lax.scan(
      _backward_step(trans_HxH), b_H, (pred_LxH, ev_LxH), reverse=True)[1]
  post_CxLxH, masked_CxLxH = jax.vmap(backward)(back_in_CxH, pred_CxLxH,
                                                ev_CxLxH)
  flat = lambda x: x.reshape((blocks * size,) + x.shape[2:])[:num]
  # log P(e) as the scan gives it for any transition matrix (its gradient is
  # the scan's, off the simplex too): the blocks' scales and each outgoing
  # message's mass before the next block rescaled it (padding left out).
  log_lik = (jnp.sum(safe_log(flat(c_CxL)))
             + jnp.sum(safe_log(jnp.sum(out_CxH[:-1], axis=-1))))
  return Smoothed(log_lik, flat(post_CxLxH), flat(masked_CxLxH))


def _combine(left, right):
  """Associative product of ``(M [..., H, H], log scale [...])``: ``M_l @
  M_r`` rescaled to sum 1 (all-zero stays zero, scale ``-inf``)."""
  (m_l, c_l), (m_r, c_r) = left, right
  m, c = _rescaled(jnp.einsum("...ij,...jk->...ik", m_l, m_r))
  return m, c_l + c_r + c


def _rescaled(m):
  """Each matrix of ``m [..., H, H]`` rescaled to sum 1, and its log sum."""
  shape = m.shape
  flat, total = _normalize(m.reshape(shape[:-2] + (shape[-2] * shape[-1],)))
  return flat.reshape(shape), safe_log(total)


def forward_backward_parallel(hmm: HMM, evidence_TxH: jax.Array) -> Smoothed:
  """:func:`forward_backward` by associative scans (Särkkä & García-Fernández):
  ``O(log T)`` rescaled ``H x H`` matrix products, log scales carried; no
  ``log`` of a transition (exact zeros give no NaN, unlike dynamax's); work
  ``O(T H^3)``. Equal to the sequential kernel to float rounding (tested)."""
  init_H, trans_HxH, ev_TxH = _promoted(hmm, evidence_TxH)
  dtype, last = ev_TxH.dtype, ev_TxH.shape[0] - 1
  # Forward: pred_t ∝ pi^T diag(e_0) A ... diag(e_{t-1}) A.
  fwd = jax.lax.associative_scan(
      _combine, _rescaled(ev_TxH[:, :, None] * trans_HxH[None]))
  # Backward: back_t ∝ A diag(e_{t+1}) ... A diag(e_{T-1}) 1 (a reverse scan
  # hands fn the later element first).
  bwd = jax.lax.associative_scan(
      lambda later, earlier: _combine(earlier, later),
      _rescaled(trans_HxH[None] * ev_TxH[:, None, :]), reverse=True)
  pred_TxH = jnp.concatenate(
      [init_H[None], jnp.einsum("h,thk->tk", init_H, fwd[0][:-1])])
  pred_scale_T = jnp.concatenate([jnp.zeros((1,), dtype), fwd[1][:-1]])
  back_TxH = jnp.concatenate([jnp.sum(bwd[0][1:], axis=-1),
                              jnp.ones((1, trans_HxH.shape[0]), dtype)])
  pred_TxH, pred_sum_T = _normalize(pred_TxH)
  masked_TxH, _ = _normalize(pred_TxH * back_TxH)
  post_TxH, _ = _normalize(masked_TxH * ev_TxH)
  log_lik = (safe_log(jnp.sum(pred_TxH[last] * ev_TxH[last]))
             + safe_log(pred_sum_T[last]) + pred_scale_T[last])
  return Smoothed(log_lik, post_TxH, masked_TxH)
