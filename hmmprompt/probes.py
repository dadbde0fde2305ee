"""Linear probes of a transformer's residual stream against exact posteriors
(Shai et al., NeurIPS 2024: belief states in the residual stream): affine maps
fitted in closed form by ridge regression in float64 (:func:`fit`) and scored on
held-out data (:func:`scores`); the probes of ``[K]`` stacked trials in one
batched solve, each trial's its own."""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import numpy as np

from hmmprompt.backbones import transformer

RIDGES = (0.0, 1e-6, 1e-4, 1e-2, 1.0)
"""The ridges tried, times the number of fitting rows (Gram-matrix scale)."""
KL_FLOOR = 1e-6  # a projected prediction's floor before the KL (exact 0s)


def residual_streams(cfg: transformer.MLMConfig, params, tokens_BxT
                     ) -> tuple[jax.Array, jax.Array]:
  """``(logits [B, T, V], streams [L + 1, B, T, D])``: the output, and by
  ``capture_intermediates`` the stream into block 0 and out of each block."""
  keep = lambda mdl, name: name == "__call__" and isinstance(
      mdl, (transformer.Block, nn.Embed))
  logits, state = transformer.MLM(cfg).apply(
      params, tokens_BxT, capture_intermediates=keep, mutable=["intermediates"])
  seen = state["intermediates"]
  pos_TxD = params["params"]["pos_embed"][:tokens_BxT.shape[-1]]
  return logits, jax.numpy.stack(
      [seen["tok_embed"]["__call__"][0] + pos_TxD]
      + [seen[f"block_{i}"]["__call__"][0] for i in range(cfg.num_layers)]
  ).astype(jax.numpy.float32)


class Probe(NamedTuple):
  """Affine maps ``x @ weight + bias``, one per trial: ``weight [K, D, H]``,
  ``bias [K, H]``, ``ridge [K]`` (the chosen one)."""

  weight: np.ndarray
  bias: np.ndarray
  ridge: np.ndarray


def _fit(x_KxNxD, y_KxNxH, ridge: float) -> Probe:
  """The ridge solution on centred rows (the bias unpenalised)."""
  mx, my = x_KxNxD.mean(1, keepdims=True), y_KxNxH.mean(1, keepdims=True)
  xc = x_KxNxD - mx
  gram = np.swapaxes(xc, 1, 2) @ xc
  gram += ridge * x_KxNxD.shape[1] * np.eye(gram.shape[-1])
  # pinv: a stream of fewer directions than D (or ridge 0) stays solvable.
  weight = np.linalg.pinv(gram, hermitian=True) @ (
      np.swapaxes(xc, 1, 2) @ (y_KxNxH - my))
  bias = (my - mx @ weight)[:, 0]
  return Probe(weight, bias, np.full(len(x_KxNxD), ridge))


def predict(probe: Probe, x_KxNxD) -> np.ndarray:
  """``[K, N, H]``."""
  return np.asarray(x_KxNxD, np.float64) @ probe.weight + probe.bias[:, None]


def r2(probe: Probe, x_KxNxD, y_KxNxH) -> np.ndarray:
  """``[K]`` held-out R²: 1 - residual over total sum of squares, pooled
  over the target's coordinates (Shai et al.'s measure)."""
  y = np.asarray(y_KxNxH, np.float64)
  resid = ((y - predict(probe, x_KxNxD)) ** 2).sum((1, 2))
  return 1.0 - resid / ((y - y.mean(1, keepdims=True)) ** 2).sum((1, 2))


def fit(x_train, y_train, x_val, y_val, ridges=RIDGES) -> Probe:
  """Each trial's probe (``x [K, N, D]``, ``y [K, N, H]``, float64) at the
  ridge of :data:`RIDGES` with the best validation R²."""
  if not ridges:
    raise ValueError("probes.fit needs at least one ridge")
  x, y = (np.asarray(a, np.float64) for a in (x_train, y_train))
  fits = [_fit(x, y, r) for r in ridges]
  best = np.argmax([r2(p, x_val, y_val) for p in fits], axis=0)  # [K]
  return Probe(*(np.stack([getattr(fits[b], f)[k] for k, b in
                           enumerate(best)]) for f in Probe._fields))


def to_simplex(y_NxH) -> np.ndarray:
  """Each row's Euclidean projection onto the probability simplex."""
  y = np.asarray(y_NxH, np.float64)
  u = -np.sort(-y, axis=-1)
  css = np.cumsum(u, axis=-1) - 1.0
  k = np.arange(1, y.shape[-1] + 1)
  rho = (u - css / k > 0).sum(-1, keepdims=True)  # a prefix holds
  theta = np.take_along_axis(css, rho - 1, axis=-1) / rho
  return np.maximum(y - theta, 0.0)


def scores(probe: Probe, x_KxNxD, y_KxNxH, mu_KxCxH=None) -> dict:
  """``{"r2", "tv", "kl", "peak", "peak_exact"}``, each ``[K]``: R², the
  mean total variation and KL(exact || prediction) with the prediction
  projected onto the simplex (floored at :data:`KL_FLOOR` for the KL,
  renormalised), and the mean largest probability of the projection and of
  the exact posterior (how sharp each is); with ``mu [K, C, H]`` also
  ``"label_acc"``, how often ``argmax mu @ q`` is the exact one's, and
  ``"label_r2"``, the R² of the label's scores ``mu @ p`` (unprojected)."""
  y = np.asarray(y_KxNxH, np.float64)
  q = to_simplex(predict(probe, x_KxNxD))
  out = {"r2": r2(probe, x_KxNxD, y), "tv": 0.5 * np.abs(y - q).sum(-1).mean(-1),
         "peak": q.max(-1).mean(-1), "peak_exact": y.max(-1).mean(-1)}
  if mu_KxCxH is not None:
    score = lambda p: p @ np.swapaxes(mu_KxCxH, 1, 2)  # [K, N, C]
    out["label_acc"] = (np.argmax(score(q), -1) == np.argmax(score(y), -1)
                        ).mean(-1)
    s, err = score(y), score(y) - score(predict(probe, x_KxNxD))
    out["label_r2"] = 1 - (err ** 2).sum((1, 2)) / (
        (s - s.mean(1, keepdims=True)) ** 2).sum((1, 2))
  q = np.maximum(q, KL_FLOOR)
  q /= q.sum(-1, keepdims=True)
  kl = np.where(y > 0, y * np.log(np.where(y > 0, y, 1.0) / q), 0.0)
  return {**out, "kl": kl.sum(-1).mean(-1)}


@functools.partial(jax.jit, static_argnums=0)
def _features(cfg: transformer.MLMConfig, params_K, tokens_KxBxT, at_P):
  """``(streams [K, L + 1, B, P, D], probs [K, B, P, V])`` at ``at_P``."""
  def one(params, tokens):
    logits, streams = residual_streams(cfg, params, tokens)
    return streams[:, :, at_P], jax.nn.softmax(logits[:, at_P], -1)
  return jax.vmap(one)(params_K, tokens_KxBxT)


def layer_scores(cfg: transformer.MLMConfig, params_K, tokens_KxNxT,
                 targets_KxNxPxH, positions=None,
                 split: tuple[float, float] = (0.6, 0.2), mu_KxCxH=None,
                 shuffle: bool = False, batch: int = 128, keep: bool = False
                 ) -> dict:
  """:func:`scores` of each input's probe, each ``[L + 2, K]`` for ``K`` stacked
  transformers: the stream after the embedding and each of the ``L`` blocks,
  then the output probabilities (what a head reads), at ``positions`` (``P`` of
  them, where the targets are; ``None``: all). The sequences split in order into
  ``split`` (fit, ridge choice) and the held-out rest; ``shuffle``: the targets
  permuted across sequences (the control); ``keep``: also ``"kept"``, the
  held-out targets ``[K, R, H]`` and each input's projected predictions
  ``[L + 2, K, R, H]``. Streams are read ``batch`` sequences at a time."""
  n, length = tokens_KxNxT.shape[1:]
  a, b = int(n * split[0]), int(n * (split[0] + split[1]))
  if not 0 < a < b < n:
    raise ValueError(f"probes.layer_scores: split {split} of {n} sequences "
                     f"leaves a part empty")
  at = np.arange(length) if positions is None else np.asarray(positions)
  parts = [_features(cfg, params_K, tokens_KxNxT[:, i:i + batch], at)
           for i in range(0, n, batch)]
  inputs = [np.concatenate([np.asarray(p[0][:, layer]) for p in parts], 1)
            for layer in range(cfg.num_layers + 1)]
  inputs.append(np.concatenate([np.asarray(p[1]) for p in parts], 1))
  y = np.asarray(targets_KxNxPxH, np.float64)
  if shuffle:
    y = y[:, np.random.default_rng(0).permutation(n)]
  rows = lambda v, lo, hi: v[:, lo:hi].reshape(len(v), -1, v.shape[-1])
  out: dict = {}
  kept = []
  mu = None if mu_KxCxH is None else np.asarray(mu_KxCxH, np.float64)
  for x in inputs:
    x = x.astype(np.float64)
    probe = fit(rows(x, 0, a), rows(y, 0, a), rows(x, a, b), rows(y, a, b))
    for k, v in scores(probe, rows(x, b, n), rows(y, b, n), mu).items():
      out.setdefault(k, []).append(v)
    if keep:
      kept.append(to_simplex(predict(probe, rows(x, b, n))))
  out = {k: np.stack(v) for k, v in out.items()}
  return {**out, "kept": (rows(y, b, n), np.stack(kept))} if keep else out
