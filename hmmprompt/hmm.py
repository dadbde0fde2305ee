"""Hidden Markov models: parameters, sampling and exact inference.

:class:`HMM`'s ``transition`` and ``emission`` are the paper's ``A`` and
``W`` transposed (Section 3; Appendix B, D). Inference runs on non-negative
*evidence vectors* ``e_t [T, H]``: a token's ``e(x)[h] = P(X = x | H = h)``
(:func:`embed`) or a soft prompt's vector in ``[0, 1]^H`` (Appendix B).
Traceable **kernels** (:func:`forward_backward`, :func:`token_smooth`, ...)
and jitted **entry points** over them (:func:`sample`, :func:`posterior`,
...), one sequence each (numerics: :mod:`~hmmprompt.smoothing`). The entry
points' rules, here and in :mod:`~hmmprompt.memory` (``method``:
:data:`METHODS`; batches right-padded with ``MASK``; ``ValueError`` at the
call, under your ``jit`` only on dtypes, shapes and ``method``:
:func:`check_tokens`): docs/hmm.md."""

from typing import NamedTuple

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from hmmprompt import smoothing
from hmmprompt import validation
from hmmprompt.smoothing import (  # re-exported: hmm.forward_backward, ...
    Smoothed, forward_backward, forward_backward_blocked,
    forward_backward_parallel)

MASK = -1
"""Token id of an unobserved (``[MASK]``) position."""


class Emitting:
  """The mixin of every model whose ``emission`` ends in the vocabulary."""

  __slots__ = ()
  emission: jax.Array

  @property
  def vocab_size(self) -> int:
    return self.emission.shape[-1]


class _HMMFields(NamedTuple):
  initial: jax.Array
  transition: jax.Array
  emission: jax.Array


def _validate_hmm(initial, transition, emission,
                  chk=validation.check_distribution) -> None:
  """Raises ``ValueError`` naming the field (``chk``: the value checks)."""
  fields = (("HMM.initial", initial, 1), ("HMM.transition", transition, 2),
            ("HMM.emission", emission, 2))
  # Shapes before values: a transposed emission's rows sum to anything.
  for name, p, ndim in fields:
    validation.check_event_shape(name, p, ndim)
  batch, h = initial.shape[:-1], initial.shape[-1]
  if transition.shape != batch + (h, h):
    raise ValueError(f"HMM.transition must have shape [H, H] = "
                     f"{batch + (h, h)} to match HMM.initial of shape "
                     f"{initial.shape}, got {transition.shape}")
  if emission.shape[:-1] != batch + (h,):
    transposed = emission.shape[:-2] == batch and emission.shape[-1] == h
    raise ValueError(f"HMM.emission must have shape [H, V] with H = {h} (and "
                     f"the batch shape {batch} of HMM.initial), got "
                     f"{emission.shape}" + (" (a transposed [V, H] "
                                            "emission?)" if transposed else ""))
  for name, p, ndim in fields:
    chk(name, p, ndim)


class HMM(validation.ValidatedParams, Emitting, _HMMFields,
          validate=_validate_hmm):
  """HMM parameters (a pytree; validated when built from concrete arrays).

  Attributes:
    initial: ``[H]`` distribution of the first state.
    transition: ``[H, H]`` row-stochastic, ``transition[i, j] = P(j | i)``.
    emission: ``[H, V]`` row-stochastic, ``emission[h, x] = P(x | h)``.
  """

  __slots__ = ()

  @property
  def num_states(self) -> int:
    return self.transition.shape[-1]


def check_model(hmm: HMM) -> HMM:
  """Runs :class:`HMM`'s constructor checks on an existing model (from
  ``tree.map`` or ``jit``) and returns it; values only when concrete (under
  ``jit``: :func:`checkify_model`). ``ValueError`` names the bad field."""
  return validation.check_fields(hmm, _validate_hmm)


def checkify_model(hmm: HMM) -> None:
  """:func:`check_model` under ``checkify.checkify`` only (values checked)."""
  _validate_hmm(*hmm, chk=validation.checkify_distribution)


def checkify_tokens(tokens, vocab_size: int) -> None:
  """:func:`check_tokens` as a ``checkify`` check (:func:`checkify_model`)."""
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
  bad = (tokens != MASK) & ((tokens < 0) | (tokens >= vocab_size))
  checkify.check(~jnp.any(bad), f"a token is out of range: tokens must lie in "
                 f"[0, {vocab_size}) or equal MASK ({MASK}); the first bad one "
                 f"is {{tok}}", tok=tokens.ravel()[jnp.argmax(bad.ravel())])


def check_tokens(tokens, vocab_size: int) -> jax.Array:
  """Checks a token array (any shape; ``MASK`` allowed) and returns it;
  ``ValueError`` on a non-integer dtype or (if concrete) a bad token."""
  traced = isinstance(tokens, jax.core.Tracer)
  arr = tokens if traced else np.asarray(tokens)
  if not jnp.issubdtype(arr.dtype, jnp.integer):
    raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
  if traced:
    return tokens
  bad = (arr != MASK) & ((arr < 0) | (arr >= vocab_size))
  if np.any(bad):
    idx = np.argwhere(bad)[0]
    raise ValueError(
        f"token {int(arr[tuple(idx)])} at index {idx.tolist()} is out of "
        f"range: tokens must lie in [0, {vocab_size}) or equal MASK ({MASK})")
  return jnp.asarray(arr, dtype=jnp.int32)


def check_sequence(tokens, hmm: Emitting) -> jax.Array:
  """:func:`check_tokens` for one non-empty sequence ``[T]``; returns it."""
  tokens = check_tokens(tokens, hmm.vocab_size)
  if tokens.ndim != 1 or tokens.shape[0] == 0:
    raise ValueError(f"tokens must be a non-empty 1-D sequence [T], got shape "
                     f"{tokens.shape}; use jax.vmap for batches")
  return tokens


def check_evidence(evidence, hmm: HMM) -> jax.Array:
  """Checks evidence ``[T, H]`` (finite, non-negative when concrete)."""
  concrete = not isinstance(evidence, jax.core.Tracer)
  if concrete:
    evidence = jnp.asarray(evidence)
  if evidence.shape[1:] != (hmm.num_states,) or not evidence.shape[0]:
    raise ValueError(f"evidence must have shape [T, H] with H = "
                     f"{hmm.num_states} and T >= 1, got {evidence.shape}")
  if not jnp.issubdtype(evidence.dtype, jnp.floating):
    raise ValueError(f"evidence must be floating point, got {evidence.dtype}")
  if concrete:
    ev = np.asarray(evidence)
    if not np.all(np.isfinite(ev) & (ev >= 0)):
      idx = np.argwhere(~(np.isfinite(ev) & (ev >= 0)))[0].tolist()
      raise ValueError(f"evidence must be finite and non-negative; entry "
                       f"{idx} is {ev[tuple(idx)]}")
  return evidence


# Random parameters (Appendix D, with the authors' parametrisation).
def random_simplex(key, shape, temp: float) -> jax.Array:
  """``softmax((U - 0.5) / temp)`` over the last axis, ``U ~ Uniform[0, 1)``."""
  return jax.nn.softmax((jax.random.uniform(key, shape) - 0.5) / temp, axis=-1)


# Appendix D's temperatures (near-permutation, near-deterministic, uniform).
TRANSITION_TEMP, EMISSION_TEMP, INITIAL_TEMP = 0.01, 0.01, 10.0


def random_transition(key, num_states: int,
                      temp: float = TRANSITION_TEMP) -> jax.Array:
  """``[H, H]`` convex combination of ``H`` random permutation matrices."""
  k_w, k_p = jax.random.split(key)
  weights_R = random_simplex(k_w, (num_states,), temp)
  perms_RxH = jax.vmap(lambda k: jax.random.permutation(k, num_states))(
      jax.random.split(k_p, num_states))
  onehot_RxHxH = jax.nn.one_hot(perms_RxH, num_states)
  return jnp.einsum("r,rij->ij", weights_R, onehot_RxHxH)


def draw_random_hmm(key, num_states: int, vocab_size: int,
                    transition_temp, emission_temp, initial_temp) -> HMM:
  """Kernel of :func:`random_hmm` (sizes static, temperatures traceable)."""
  k_i, k_t, k_e = jax.random.split(key, 3)
  return HMM(random_simplex(k_i, (num_states,), initial_temp),
             random_transition(k_t, num_states, transition_temp),
             random_simplex(k_e, (num_states, vocab_size), emission_temp))


@validation.entry_point(draw_random_hmm, static_argnums=(1, 2))
def random_hmm(key, num_states: int, vocab_size: int, *,
               transition_temp: float = TRANSITION_TEMP,
               emission_temp: float = EMISSION_TEMP,
               initial_temp: float = INITIAL_TEMP) -> HMM:
  """Appendix D's random HMM: each probability vector a :func:`random_simplex`,
  the transition a :func:`random_transition`. Vmappable over ``key``."""
  if num_states < 1 or vocab_size < 1:
    raise ValueError(f"num_states and vocab_size must be >= 1, got "
                     f"{num_states}, {vocab_size}")
  for name, t in zip(("transition_temp", "emission_temp", "initial_temp"),
                     (transition_temp, emission_temp, initial_temp)):
    if not t > 0:
      raise ValueError(f"{name} must be > 0, got {t}")
  return validation.kernel_args(key, num_states, vocab_size, transition_temp,
                                emission_temp, initial_temp)


def _cdf(p: jax.Array) -> jax.Array:
  """Normalised cumulative sum: 1 exactly past the last non-zero entry."""
  return (c := jnp.cumsum(p, axis=-1)) / c[..., -1:]


def _draw(cdf: jax.Array, u: jax.Array) -> jax.Array:
  """Inverse-CDF draw: ``cdf [..., H or V]``, ``u [...]`` -> int32 ``[...]``."""
  k = jnp.sum(cdf <= u[..., None], axis=-1, dtype=jnp.int32)
  return jnp.minimum(k, cdf.shape[-1] - 1)


def draw_sequence(key, hmm: HMM, length: int):
  """Kernel of :func:`sample`: ``(tokens int32[T], states int32[T])``."""
  u_2xT = jax.random.uniform(key, (2, length))
  cdf_trans_HxH = _cdf(hmm.transition)
  s0 = _draw(_cdf(hmm.initial), u_2xT[0, 0])
  def step(s, u):
    s_next = _draw(cdf_trans_HxH[s], u)
    return s_next, s_next
  _, rest = jax.lax.scan(step, s0, u_2xT[0, 1:])
  states_T = jnp.concatenate([s0[None], rest])
  # Given the states, the emissions are independent: draw them all at once.
  tokens_T = _draw(_cdf(hmm.emission)[states_T], u_2xT[1])
  return tokens_T, states_T


def token_evidence(hmm: HMM, tokens_T: jax.Array) -> jax.Array:
  """Proper embeddings ``[T, H]``: ``e(x)[h] = P(x | h)``; ones for ``MASK``."""
  # mode="fill": an out-of-range token under a caller's jit has zero
  # likelihood (an impossible sequence) instead of a silently clamped one.
  cols_TxH = jnp.take(hmm.emission.T, jnp.where(tokens_T == MASK, 0, tokens_T),
                      axis=0, mode="fill", fill_value=0)
  return jnp.where((tokens_T == MASK)[:, None], 1.0, cols_TxH).astype(
      hmm.emission.dtype)


METHODS = ("sequential", "parallel", "blocked", "auto")
"""The entry points' ``method`` (docs/hmm.md)."""
_AUTO_PARALLEL_FROM = 2048  # auto's threshold, provisional (docs/hmm.md)


def resolve_method(method: str, length: int) -> str:
  """The kernel for ``method`` on ``length`` positions; ``ValueError``."""
  if validation.one_of("method", method, METHODS) == "auto":
    return ("parallel" if jax.default_backend() != "cpu"
            and length >= _AUTO_PARALLEL_FROM else "sequential")
  return method


def smooth_by(hmm: HMM, evidence_TxH: jax.Array,
              method: str = "sequential") -> Smoothed:
  """The kernel of a resolved ``method`` (:data:`METHODS`, not ``auto``)."""
  kernels = {"sequential": forward_backward,
             "parallel": forward_backward_parallel,
             "blocked": forward_backward_blocked}
  if method not in kernels:  # "auto" is the entry points' to resolve
    raise ValueError(f"smooth_by's method must be one of {tuple(kernels)}, "
                     f"got {method!r} (hmm.resolve_method resolves 'auto')")
  return kernels[method](hmm, evidence_TxH)


def evidence_conditionals(hmm: HMM, evidence_TxH: jax.Array,
                          method: str = "sequential") -> jax.Array:
  """``[T, V]``: Appendix B's ``G-bar``, ``W τ_t / ||τ_t||_1``."""
  masked_TxH = smooth_by(hmm, evidence_TxH, method).masked_posterior
  return masked_TxH @ hmm.emission.astype(masked_TxH.dtype)


def token_smooth(hmm: HMM, tokens_T: jax.Array,
                 method: str = "sequential") -> Smoothed:
  """:func:`smooth_by` on the tokens' proper embeddings."""
  return smooth_by(hmm, token_evidence(hmm, tokens_T), method)


def token_conditionals(hmm: HMM, tokens_T: jax.Array,
                       method: str = "sequential") -> jax.Array:
  """``[T, V]``: ``P[X_t | x_{-t}]`` (:func:`evidence_conditionals`)."""
  return evidence_conditionals(hmm, token_evidence(hmm, tokens_T), method)


def token_next_conditionals(hmm: HMM, tokens_T: jax.Array) -> jax.Array:
  """``[T, V]``: ``P[X_t | x_{<t}]``, a causal LM's exact targets: the
  forward scan's predicted states (zeros after an impossible prefix)."""
  pred_TxH = smoothing.predicted(hmm, token_evidence(hmm, tokens_T))
  return pred_TxH @ hmm.emission.astype(pred_TxH.dtype)


# Entry points: each checks its input and runs its kernel, jitted.
def method_args(model, inputs, method: str, check, check_model=check_model):
  """An entry point's kernel arguments: the checked model (``check_model``)
  and inputs ``[T, ...]`` (``check``), and ``method`` resolved for ``T``."""
  model = check_model(model)
  inputs = check(inputs, model)
  return validation.kernel_args(model, inputs,
                                resolve_method(method, inputs.shape[0]))


CALLING_RULES = """
  ``method``: ``"sequential"``, ``"parallel"``, ``"blocked"`` or ``"auto"``;
  batches: ``jax.vmap`` on rows right-padded with ``MASK`` (never left-pad).

  Raises:
    ValueError: at the call, on a bad ``method``, model or ``tokens``;
      under your ``jit`` only on dtypes and shapes (:func:`hmm.check_tokens`).
"""


def calling_rules(entry):
  """``entry`` with :data:`CALLING_RULES` after its docstring, for ``help()``
  (the module docstring states them for the API reference)."""
  entry.__doc__ = (entry.__doc__ or "").rstrip() + "\n" + CALLING_RULES
  return entry


@validation.entry_point(draw_sequence, static_argnums=2)
def sample(key, hmm: HMM, length: int) -> tuple[jax.Array, jax.Array]:
  """Samples ``(tokens int32[T], states int32[T])``; vmappable over ``key``."""
  return validation.kernel_args(key, check_model(hmm),
                                validation.positive_int("length", length))


@validation.entry_point(token_evidence)
def embed(hmm: HMM, tokens) -> jax.Array:
  """Proper embeddings ``[T, H]``: ``e(x)[h] = P(x | h)``; ones for ``MASK``."""
  hmm = check_model(hmm)
  return validation.kernel_args(hmm, check_sequence(tokens, hmm))


@validation.entry_point(smooth_by, static_argnums=2)
def smooth(hmm: HMM, evidence, method: str = "auto") -> Smoothed:
  """Forward-backward on evidence vectors ``[T, H]`` (Appendix B)."""
  return method_args(hmm, evidence, method, check_evidence)


@calling_rules
@validation.entry_point(token_smooth, static_argnums=2, field="log_likelihood")
def log_likelihood(hmm: HMM, tokens, method: str = "auto") -> jax.Array:
  """``log P(x)`` of the observed tokens, ``-inf`` if impossible."""
  return method_args(hmm, tokens, method, check_sequence)


@calling_rules
@validation.entry_point(token_smooth, static_argnums=2, field="posterior")
def posterior(hmm: HMM, tokens, method: str = "auto") -> jax.Array:
  """``[T, H]``: ``P[H_t | observed tokens]``, all zeros if impossible."""
  return method_args(hmm, tokens, method, check_sequence)


@validation.entry_point(token_smooth, static_argnums=2, field="masked_posterior")
def masked_posterior(hmm: HMM, tokens, method: str = "auto") -> jax.Array:
  """``[T, H]``: ``P[H_t | x_{-t}]`` (position ``t`` itself left out)."""
  return method_args(hmm, tokens, method, check_sequence)


@calling_rules
@validation.entry_point(token_conditionals, static_argnums=2)
def conditionals(hmm: HMM, tokens, method: str = "auto") -> jax.Array:
  """``[T, V]``: ``P[X_t | x_{-t}]``, the exact masked LM ``G``; row ``t``
  does not read ``tokens[t]``, all-zero where ``x_{-t}`` is impossible."""
  return method_args(hmm, tokens, method, check_sequence)


@validation.entry_point(evidence_conditionals, static_argnums=2)
def conditionals_from_evidence(hmm: HMM, evidence, method: str = "auto"
                               ) -> jax.Array:
  """``[T, V]``: Appendix B's ``G-bar``: ``W τ_t / ||τ_t||_1`` on evidence
  vectors, ``τ_t ∝ P[H_t, e_{-t}]``; 0 where ``τ_t = 0``."""
  return method_args(hmm, evidence, method, check_evidence)
