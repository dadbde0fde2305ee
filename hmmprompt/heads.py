"""Classification heads on a frozen backbone's outputs (paper Sections 3-4).

Features ``f(G_i)`` of the backbone's probabilities: ``"raw"`` (the paper);
``"log"``, ``log(G + 1e-6)`` (near-deterministic HMMs put the signal in small
probabilities); ``"standardized"``, ``(G - mean) / (std + 1e-6)`` with the
training set's statistics (a fixed affine map: only the optimisation's
conditioning changes). Heads: linear (Theorem 3.3 / 3.6), ``logits = w^T
f(G_mask) + bias``; attention (eq. 4.1-4.2), score ``s_i = q^T (Θ_K f(G_i) +
β_i)``, weights ``a = softmax(exp(log_temp) * s)`` (the paper's argmax in the
limit), value ``v_i = b^T ((Θ_V f(G_i)) ⊙ e(x_i))``, ``logits = Σ_i a_i v_i``.
:mod:`hmmprompt.tuning` reads :data:`HEADS`, :data:`TRANSFORMS`."""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

_LOG_EPS, _STD_EPS = 1e-6, 1e-6

NUM_CLASSES = 2
"""Logits every registered head gives: the paper's tasks are binary."""


@dataclasses.dataclass(frozen=True)
class Features:
  """A feature transform ``f``, in :data:`TRANSFORMS` under its ``name``:
  ``apply(G [.., V], stats | None) -> features [.., V]``."""

  name: str
  apply: Callable[[jax.Array, Any], jax.Array]  # stats: dict, or None
  needs_stats: bool = False  # reads :func:`feature_stats` (computed at init)


def feature_stats(probs_NxV: jax.Array) -> dict:
  """Mean and std per vocabulary entry over all leading axes."""
  flat = probs_NxV.reshape(-1, probs_NxV.shape[-1])
  return {"mean": flat.mean(0), "std": flat.std(0)}


TRANSFORMS: dict[str, Features] = {
    "raw": Features("raw", lambda probs, stats: probs),
    "log": Features("log", lambda probs, stats: jnp.log(probs + _LOG_EPS)),
    "standardized": Features("standardized", lambda probs, stats: (
        probs - stats["mean"]) / (stats["std"] + _STD_EPS), needs_stats=True)}
FEATURES = tuple(TRANSFORMS)


def transform(probs_xV: jax.Array, kind: str, stats: dict | None):
  """``TRANSFORMS[kind]`` applied to ``G [.., V]``."""
  if kind not in TRANSFORMS:
    raise ValueError(f"unknown feature transform {kind!r}; expected one of "
                     f"{tuple(TRANSFORMS)}")
  return TRANSFORMS[kind].apply(probs_xV, stats)


@dataclasses.dataclass(frozen=True)
class Head:
  """A classification head, in :data:`HEADS` under its ``name``:
  ``init(key, V, D, T) -> params``, ``T`` every backbone position, soft
  prompt included; ``apply(params, feats, emb) -> logits [C]``, with
  ``feats [T, V]`` and ``emb [T, D]`` if ``reads_all_positions`` (what head
  tuning caches), else ``feats [V]`` at the ``MASK`` and ``emb`` ``None``."""

  name: str
  init: Callable[[Any, int, int, int], Any]
  apply: Callable[[Any, jax.Array, Any], jax.Array]  # emb: [T, D] or None
  reads_all_positions: bool


def init_linear(key, num_features: int) -> dict:
  del key  # zero init: a linear model has no symmetry to break
  return {"w": jnp.zeros((num_features, NUM_CLASSES)),
          "bias": jnp.zeros((NUM_CLASSES,))}


def apply_linear(params: dict, feats_F: jax.Array) -> jax.Array:
  return feats_F @ params["w"] + params["bias"]


def init_attention(key, vocab_size: int, embed_dim: int, seq_len: int) -> dict:
  """Keys of ``embed_dim + 1`` dimensions (the paper's ``|H| + 1``)."""
  key_dim = embed_dim + 1
  k_k, k_q, k_v, k_b = jax.random.split(key, 4)
  normal = lambda k, shape, fan_in: jax.random.normal(k, shape) * (
      1.0 / jnp.sqrt(fan_in))
  return {"theta_k": normal(k_k, (key_dim, vocab_size), vocab_size),
          "beta": jnp.zeros((seq_len, key_dim)),
          "q": normal(k_q, (key_dim,), key_dim), "log_temp": jnp.zeros(()),
          "theta_v": normal(k_v, (embed_dim, vocab_size), vocab_size),
          "b": normal(k_b, (embed_dim, NUM_CLASSES), embed_dim),
          "bias": jnp.zeros((NUM_CLASSES,))}


def apply_attention(params: dict, feats_TxV: jax.Array,
                    emb_TxD: jax.Array) -> jax.Array:
  t = feats_TxV.shape[0]
  keys_TxE = feats_TxV @ params["theta_k"].T + params["beta"][:t]
  scores_T = keys_TxE @ params["q"]
  attn_T = jax.nn.softmax(jnp.exp(params["log_temp"]) * scores_T)
  values_TxC = ((feats_TxV @ params["theta_v"].T) * emb_TxD) @ params["b"]
  return attn_T @ values_TxC + params["bias"]


LINEAR = Head(
    "linear", init=lambda key, vocab_size, *_: init_linear(key, vocab_size),
    apply=lambda params, feats_V, emb: apply_linear(params, feats_V),
    reads_all_positions=False)

ATTENTION = Head("attention", init=init_attention,
                 apply=apply_attention, reads_all_positions=True)

HEADS: dict[str, Head] = {"linear": LINEAR, "attention": ATTENTION}
