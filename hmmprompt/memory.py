"""Memory-augmented HMMs (paper Section 4, Figure 2).

Single cell (:class:`MemoryHMM`, what the experiments use): a memory value
``M`` is drawn once per sequence, a syntax chain ``H`` evolves as a vanilla
HMM, and token ``t`` is emitted from ``emission[M, H_t]``: an HMM on states
``(m, h)`` (:func:`to_hmm`). Multiple cells (:class:`MultiMemoryHMM`, Figure
2 right): exact inference on their product HMM (:func:`multi_to_hmm`).
Entry points and kernels as in :mod:`hmm`."""

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import smoothing
from hmmprompt import validation

MAX_PRODUCT_STATES = 2048
"""Largest product-state space exact multi-cell inference will build: a
``(MH)^2`` transition matrix (16 MiB) and ~4 GFLOP per 1000 tokens."""


class _MemoryFields(NamedTuple):
  """The fields of both memory HMMs (``emission [..., M, H or S, V]``)."""

  memory_prior: jax.Array
  initial: jax.Array
  transition: jax.Array
  emission: jax.Array

  @property
  def memory_size(self) -> int:
    return self.emission.shape[-3]


def _check_fields(cls_name: str, values, ndims, chk) -> None:
  """``chk`` on each of a memory HMM's fields, in order, with its rank."""
  for name, value, ndim in zip(_MemoryFields._fields, values, ndims):
    chk(f"{cls_name}.{name}", value, ndim)


# Single memory cell.
def _validate_memory(memory_prior, initial, transition, emission,
                     chk=validation.check_distribution) -> None:
  fields = (memory_prior, initial, transition, emission)
  # Shapes before values, as the HMM's: a wrong shape is named as such.
  _check_fields("MemoryHMM", fields, (1, 1, 2, 3), validation.check_event_shape)
  batch = memory_prior.shape[:-1]
  m, h = memory_prior.shape[-1], initial.shape[-1]
  if initial.shape[:-1] != batch or transition.shape != batch + (h, h):
    raise ValueError(f"MemoryHMM.transition must have shape ({h}, {h}) to "
                     f"match MemoryHMM.initial, got {transition.shape}")
  if emission.shape[:-1] != batch + (m, h):
    raise ValueError(f"MemoryHMM.emission must have shape [M, H, V] = "
                     f"({m}, {h}, V), got {emission.shape}")
  _check_fields("MemoryHMM", fields, (1, 1, 2, 3), chk)


class MemoryHMM(validation.ValidatedParams, hmm_lib.Emitting,
                _MemoryFields, validate=_validate_memory):
  """Single-cell memory HMM (a pytree).

  Attributes:
    memory_prior: ``[M]`` P(M = m).
    initial: ``[H]`` P(H_0 = h) of the syntax chain.
    transition: ``[H, H]`` syntax transitions (shared by all memory values).
    emission: ``[M, H, V]``, ``emission[m, h, x] = P(X_t = x | M=m, H_t=h)``.
  """

  __slots__ = ()

  @property
  def num_states(self) -> int:
    """Syntax states ``|H|``."""
    return self.emission.shape[-2]


def _product_hmm(prior_C, chain, emission_CxKxV) -> hmm_lib.HMM:
  """The HMM on ``c * K + k``: ``c ~ prior_C`` once, ``k`` by ``chain``."""
  c, k = prior_C.shape[0], chain.initial.shape[0]
  return hmm_lib.HMM(
      (prior_C[:, None] * chain.initial[None, :]).reshape(c * k),
      jnp.kron(jnp.eye(c, dtype=chain.transition.dtype), chain.transition),
      emission_CxKxV.reshape(c * k, emission_CxKxV.shape[-1]))


def to_hmm(mhmm: MemoryHMM) -> hmm_lib.HMM:
  """The equivalent vanilla HMM on ``|M||H|`` product states ``m*|H| + h``."""
  return _product_hmm(mhmm.memory_prior, mhmm, mhmm.emission)


def draw_random_memory_hmm(key, memory_size: int, num_states: int,
                           vocab_size: int, transition_temp, emission_temp,
                           initial_temp, memory_temp) -> MemoryHMM:
  """Kernel of :func:`random_memory_hmm` (sizes static)."""
  k_m, k_h = jax.random.split(key)
  base = hmm_lib.draw_random_hmm(k_h, num_states, vocab_size,
                                 transition_temp, emission_temp, initial_temp)
  k_p, k_e = jax.random.split(k_m)
  return MemoryHMM(
      hmm_lib.random_simplex(k_p, (memory_size,), memory_temp), base.initial,
      base.transition, hmm_lib.random_simplex(
          k_e, (memory_size, num_states, vocab_size), emission_temp))


@validation.entry_point(draw_random_memory_hmm, static_argnums=(1, 2, 3))
def random_memory_hmm(key, memory_size: int, num_states: int,
                      vocab_size: int, *, transition_temp: float = 0.01,
                      emission_temp: float = 0.01, initial_temp: float = 10.0,
                      memory_temp: float = 10.0) -> MemoryHMM:
  """Random single-cell memory HMM (the authors' choices): the syntax chain
  of :func:`hmm.random_hmm`, ``|M||H|`` independent emission rows, and
  ``P(M, H_0) = P(M) P(H_0)`` near uniform (as the paper)."""
  if min(memory_size, num_states, vocab_size) < 1:
    raise ValueError(f"memory_size, num_states and vocab_size must be >= 1, "
                     f"got {memory_size}, {num_states}, {vocab_size}")
  return validation.kernel_args(key, memory_size, num_states, vocab_size,
                                transition_temp, emission_temp, initial_temp,
                                memory_temp)


def vanilla_twin(key, memory_size: int, num_states: int, vocab_size: int,
                 **temps) -> hmm_lib.HMM:
  """The comparison HMM of Figure 3 (right): ``|M||H|`` unstructured states."""
  return hmm_lib.random_hmm(key, memory_size * num_states, vocab_size, **temps)


def _validator(model):
  return (_validate_multi if isinstance(model, MultiMemoryHMM)
          else _validate_memory)


def check_model(model):
  """:func:`hmm.check_model` for either memory HMM (its own fields named)."""
  return validation.check_fields(model, _validator(model))


def checkify_model(model) -> None:
  """:func:`hmm.checkify_model` for either memory HMM (under checkify)."""
  _validator(model)(*model, chk=validation.checkify_distribution)


def draw_memory_sequence(key, mhmm: MemoryHMM, length: int):
  """Kernel of :func:`sample`, through the product HMM."""
  tokens_T, product_T = hmm_lib.draw_sequence(key, to_hmm(mhmm), length)
  h = mhmm.num_states
  return tokens_T, product_T % h, product_T[0] // h


@validation.entry_point(draw_memory_sequence, static_argnums=2)
def sample(key, mhmm: MemoryHMM, length: int
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Samples ``(tokens int32[T], syntax_states int32[T], memory int32[])``."""
  return validation.kernel_args(key, check_model(mhmm),
                                validation.positive_int("length", length))


def _normalize_log(logits: jax.Array) -> jax.Array:
  """Softmax over the last axis; all ``-inf`` gives zeros, not NaN."""
  mx = jnp.max(logits, axis=-1, keepdims=True)
  ok = jnp.isfinite(mx)
  w = jnp.where(ok, jnp.exp(logits - jnp.where(ok, mx, 0.0)), 0.0)
  s = jnp.sum(w, axis=-1, keepdims=True)
  return w / jnp.where(s > 0, s, 1.0)


def token_memory_posterior(mhmm: MemoryHMM, tokens_T,
                           method: str = "sequential") -> jax.Array:
  """Kernel of :func:`memory_posterior`: ``[M]``, one ``|H|``-state
  likelihood per memory value (``method``: :func:`hmm.smooth_by`'s)."""
  # An [M]-batched HMM: the syntax chain with emission m.
  initial, transition = (jnp.broadcast_to(x, (mhmm.memory_size,) + x.shape)
                         for x in (mhmm.initial, mhmm.transition))
  loglik_M = jax.vmap(
      lambda h: hmm_lib.token_smooth(h, tokens_T, method).log_likelihood)(
          hmm_lib.HMM(initial, transition, mhmm.emission))
  return _normalize_log(smoothing.safe_log(mhmm.memory_prior) + loglik_M)


def token_memory_masked_posterior(mhmm: MemoryHMM, tokens_T,
                                  method: str = "sequential") -> jax.Array:
  """Kernel of :func:`memory_masked_posterior`: ``[T, M]`` (product HMM)."""
  masked_TxMH = hmm_lib.token_smooth(to_hmm(mhmm), tokens_T,
                                     method).masked_posterior
  return masked_TxMH.reshape(tokens_T.shape[0], mhmm.memory_size,
                            mhmm.num_states).sum(-1)


@hmm_lib.calling_rules
@validation.entry_point(token_memory_posterior, static_argnums=2)
def memory_posterior(mhmm: MemoryHMM, tokens, method: str = "auto"
                     ) -> jax.Array:
  """``[M]``: ``P[M | observed tokens]``, all zeros if impossible."""
  return hmm_lib.method_args(mhmm, tokens, method, hmm_lib.check_sequence,
                             check_model)


@hmm_lib.calling_rules
@validation.entry_point(token_memory_masked_posterior, static_argnums=2)
def memory_masked_posterior(mhmm: MemoryHMM, tokens, method: str = "auto"
                            ) -> jax.Array:
  """``[T, M]``: ``P[M | x_{-t}]`` at every ``t``, all zeros if impossible."""
  return hmm_lib.method_args(mhmm, tokens, method, hmm_lib.check_sequence,
                             check_model)


@hmm_lib.calling_rules
def conditionals(mhmm: MemoryHMM, tokens, method: str = "auto") -> jax.Array:
  """``[T, V]``: the exact masked LM ``P[X_t | x_{-t}]`` of a memory HMM,
  :func:`hmm.conditionals` on its product HMM (:func:`to_hmm`)."""
  # Checked first: a bad model is named by its own fields, not the product's.
  return hmm_lib.conditionals(to_hmm(check_model(mhmm)), tokens, method=method)


# Multiple memory cells.
def _validate_multi(memory_prior, initial, transition, emission,
                    chk=validation.check_distribution) -> None:
  fields = (memory_prior, initial, transition, emission)
  _check_fields("MultiMemoryHMM", fields, (2, 1, 2, 4),
                validation.check_event_shape)  # shapes first, as above
  if memory_prior.ndim != 2:
    raise ValueError("MultiMemoryHMM.memory_prior must have shape [N, M] "
                     "(batches of multi-cell HMMs are not supported)")
  n, m = memory_prior.shape
  if emission.shape[:2] != (n, m):
    raise ValueError(f"MultiMemoryHMM.emission must have shape [N, M, S, V] "
                     f"= ({n}, {m}, S, V), got {emission.shape}")
  k = n * emission.shape[2]
  if initial.shape != (k,) or transition.shape != (k, k):
    raise ValueError(f"MultiMemoryHMM.initial/transition must have shapes "
                     f"({k},) and ({k}, {k}) for N*S = {k}, got "
                     f"{initial.shape} and {transition.shape}")
  _check_fields("MultiMemoryHMM", fields, (2, 1, 2, 4), chk)


class MultiMemoryHMM(validation.ValidatedParams, hmm_lib.Emitting,
                     _MemoryFields, validate=_validate_multi):
  """Memory HMM with ``N`` cells (a pytree).

  Attributes:
    memory_prior: ``[N, M]`` independent priors of the cells.
    initial: ``[N * S]`` P(H_0 = (j, s)) at index ``j * S + s``.
    transition: ``[N * S, N * S]`` transitions of ``H = (J, S)``.
    emission: ``[N, M, S, V]``, ``emission[j, m, s, x] = P(X_t = x |
      M_j = m, J_t = j, S_t = s)``.
  """

  __slots__ = ()

  @property
  def num_cells(self) -> int:
    return self.emission.shape[-4]

  @property
  def num_syntax(self) -> int:
    return self.emission.shape[-2]

  @property
  def num_product_states(self) -> int:
    return self.memory_size**self.num_cells * self.num_cells * self.num_syntax


def _check_product_size(mm: MultiMemoryHMM) -> None:
  k = mm.num_product_states
  if k > MAX_PRODUCT_STATES:
    raise ValueError(
        f"exact inference needs the product HMM with |M|^N * N * |S| = "
        f"{mm.memory_size}^{mm.num_cells} * {mm.num_cells} * {mm.num_syntax} "
        f"= {k} states, above MAX_PRODUCT_STATES = {MAX_PRODUCT_STATES}")


def _memory_configs(num_cells: int, memory_size: int) -> np.ndarray:
  """``[M^N, N]`` all memory assignments, first cell most significant."""
  return np.array(list(itertools.product(range(memory_size),
                                         repeat=num_cells)), dtype=np.int32)


def multi_to_hmm(mm: MultiMemoryHMM) -> hmm_lib.HMM:
  """Product-state HMM on ``(m_1..m_N, j, s)``; index ``c * N*S + j*S + s``
  where ``c`` enumerates memory configs as :func:`_memory_configs`."""
  _check_product_size(mm)
  n = mm.num_cells
  configs_CxN = jnp.asarray(_memory_configs(n, mm.memory_size))
  prior_C = jnp.prod(mm.memory_prior[jnp.arange(n), configs_CxN], axis=-1)
  # emission for config c at (j, s) is emission[j, m_j(c), s].
  emis_CxNxSxV = mm.emission[jnp.arange(n)[None, :], configs_CxN]
  return _product_hmm(prior_C, mm, emis_CxNxSxV)


def multi_sample(key, mm: MultiMemoryHMM, length: int):
  """Samples ``(tokens [T], cells J [T], syntax S [T], memory [N])``."""
  check_model(mm)
  tokens, states = hmm_lib.sample(key, multi_to_hmm(mm), length)
  config_T, js_T = jnp.divmod(states, mm.num_cells * mm.num_syntax)
  configs = jnp.asarray(_memory_configs(mm.num_cells, mm.memory_size))
  return (tokens, *jnp.divmod(js_T, mm.num_syntax), configs[config_T[0]])


def token_cell_posteriors(mm: MultiMemoryHMM, tokens_T) -> jax.Array:
  """Kernel of :func:`cell_posteriors`: ``[N, M]`` (position 0's marginal)."""
  post_MH = hmm_lib.token_smooth(multi_to_hmm(mm), tokens_T).posterior[0]
  n, m = mm.num_cells, mm.memory_size
  post_C = post_MH.reshape(-1, n * mm.num_syntax).sum(-1)
  configs_CxN = jnp.asarray(_memory_configs(n, m))
  onehot_CxNxM = jax.nn.one_hot(configs_CxN, m, dtype=post_C.dtype)
  return jnp.einsum("c,cnm->nm", post_C, onehot_CxNxM)


@validation.entry_point(token_cell_posteriors)
def cell_posteriors(mm: MultiMemoryHMM, tokens) -> jax.Array:
  """``[N, M]``: ``P[M_j | observed tokens]`` for every cell ``j`` (mask
  position ``t`` for ``P[M_j | x_{-t}]``; all zeros if impossible), by the
  sequential scan on :func:`multi_to_hmm`. Batches: ``jax.vmap`` on rows
  right-padded with ``MASK`` (never left-pad).

  Raises:
    ValueError: at the call, on a bad model (its own fields named),
      ``tokens`` or a product HMM above :data:`MAX_PRODUCT_STATES` states;
      under your ``jit`` only on dtypes and shapes (:func:`hmm.check_tokens`).
  """
  mm = check_model(mm)
  _check_product_size(mm)
  return validation.kernel_args(mm, hmm_lib.check_sequence(tokens, mm))
