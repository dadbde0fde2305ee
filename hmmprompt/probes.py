"""Linear probes of a transformer's residual stream against exact posteriors
(Shai et al., NeurIPS 2024: belief states in the residual stream). The
stream is read with flax's ``capture_intermediates`` (the model's outputs
unchanged): the input embedding and each block's output. A probe is affine,
fitted in closed form by ridge regression in float64, its ridge chosen on a
validation split; it is scored on held-out data by R², and by the total
variation and KL from the exact posterior to its prediction projected onto
the simplex. Probes of ``[K]`` stacked trials are fitted in one batched
solve, each trial's its own."""

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
  """``(logits [B, T, V], streams [L + 1, B, T, D])``: the model's output,
  as without the capture, and the residual stream entering block 0 (token
  and position embeddings) and leaving each of the ``L`` blocks."""
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


def scores(probe: Probe, x_KxNxD, y_KxNxH) -> dict:
  """``{"r2", "tv", "kl"}``, each ``[K]``: R², and the mean total variation
  and KL(exact || prediction) with the prediction projected onto the
  simplex (floored at :data:`KL_FLOOR` for the KL, renormalised)."""
  y = np.asarray(y_KxNxH, np.float64)
  q = to_simplex(predict(probe, x_KxNxD))
  tv = 0.5 * np.abs(y - q).sum(-1).mean(-1)
  q = np.maximum(q, KL_FLOOR)
  q /= q.sum(-1, keepdims=True)
  kl = np.where(y > 0, y * np.log(np.where(y > 0, y, 1.0) / q), 0.0)
  return {"r2": r2(probe, x_KxNxD, y), "tv": tv, "kl": kl.sum(-1).mean(-1)}


def layer_scores(cfg: transformer.MLMConfig, params_K, tokens_KxNxT,
                 targets_KxNxTxH, position: int | None = None,
                 split: tuple[float, float] = (0.6, 0.2)) -> dict:
  """:func:`scores` of each layer's probe, ``{"r2", "tv", "kl"}`` each
  ``[L + 1, K]``, for ``K`` stacked transformers: the stream at
  ``position`` (every position where ``None``) against the targets there;
  the sequences split in order into ``split`` (fit, ridge choice), the
  rest held out, so no sequence's positions are on two sides."""
  n = tokens_KxNxT.shape[1]
  a, b = int(n * split[0]), int(n * (split[0] + split[1]))
  if not 0 < a < b < n:
    raise ValueError(f"probes.layer_scores: split {split} of {n} sequences "
                     f"leaves a part empty")
  streams = np.asarray(jax.vmap(lambda p, t: residual_streams(cfg, p, t)[1])(
      params_K, tokens_KxNxT), np.float64)  # [K, L + 1, N, T, D]
  y = np.asarray(targets_KxNxTxH, np.float64)
  if position is not None:
    at = slice(position, position + 1)
    streams, y = streams[:, :, :, at], y[:, :, at]
  rows = lambda v, lo, hi: v[:, lo:hi].reshape(len(v), -1, v.shape[-1])
  out: dict = {"r2": [], "tv": [], "kl": []}
  for layer in range(streams.shape[1]):
    x = streams[:, layer]
    probe = fit(rows(x, 0, a), rows(y, 0, a), rows(x, a, b), rows(y, a, b))
    for k, v in scores(probe, rows(x, b, n), rows(y, b, n)).items():
      out[k].append(v)
  return {k: np.stack(v) for k, v in out.items()}

