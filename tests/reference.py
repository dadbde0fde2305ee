"""Independent float64 NumPy references for the HMM tests.

Nothing here shares code with ``hmmprompt``: brute-force enumeration of all
hidden paths for tiny models, and a log-space forward-backward for long ones.
"""

import itertools

import numpy as np

MASK = -1


def evidence_from_tokens(emission_HxV, tokens):
  emission_HxV = np.asarray(emission_HxV, np.float64)
  return np.stack([np.ones(emission_HxV.shape[0]) if x == MASK
                   else emission_HxV[:, x] for x in tokens])


def brute_force(initial, transition, evidence_TxH):
  """Exact quantities by summing over all ``H^T`` hidden paths.

  Returns (likelihood, posterior [T,H], tau [T,H]) where
  ``tau[t, h] = sum over paths with H_t = h of the path weight without the
  evidence at t`` (unnormalised ``P[H_t, e_{-t}]``).
  """
  initial = np.asarray(initial, np.float64)
  transition = np.asarray(transition, np.float64)
  ev = np.asarray(evidence_TxH, np.float64)
  t_len, h = ev.shape
  joint = np.zeros((t_len, h))
  tau = np.zeros((t_len, h))
  total = 0.0
  for path in itertools.product(range(h), repeat=t_len):
    prior = initial[path[0]]
    for a, b in zip(path[:-1], path[1:]):
      prior *= transition[a, b]
    lik = np.array([ev[t, s] for t, s in enumerate(path)])
    w = prior * np.prod(lik)
    total += w
    for t, s in enumerate(path):
      joint[t, s] += w
      tau[t, s] += prior * np.prod(np.delete(lik, t))
  post = joint / total if total > 0 else np.zeros_like(joint)
  return total, post, tau


def normalize_rows(x):
  s = x.sum(-1, keepdims=True)
  return np.where(s > 0, x / np.where(s > 0, s, 1), 0.0)


def log_forward_backward(initial, transition, evidence_TxH):
  """Float64 log-space forward-backward: (log_lik, posterior, masked)."""
  with np.errstate(divide="ignore"):
    log_a = np.log(np.asarray(transition, np.float64))
    log_e = np.log(np.asarray(evidence_TxH, np.float64))
    log_pi = np.log(np.asarray(initial, np.float64))

  def lse(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
      return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))

  t_len, h = log_e.shape
  pred = np.zeros((t_len, h))
  back = np.zeros((t_len, h))
  pred[0] = log_pi
  for t in range(1, t_len):
    pred[t] = lse((pred[t - 1] + log_e[t - 1])[:, None] + log_a, axis=0)
  for t in range(t_len - 2, -1, -1):
    back[t] = lse(log_a + (log_e[t + 1] + back[t + 1])[None, :], axis=1)
  log_lik = lse(pred[-1] + log_e[-1], axis=0)

  def softmax(x):
    m = np.max(x, -1, keepdims=True)
    w = np.where(np.isfinite(m), np.exp(x - np.where(np.isfinite(m), m, 0)),
                 0.0)
    return normalize_rows(w)

  return log_lik, softmax(pred + log_e + back), softmax(pred + back)


def custom_vmap_calls(closed_jaxpr) -> list:
  """Every ``custom_vmap`` call in a closed jaxpr, sub-jaxprs included: the
  attention calls left after the fold rules ran (their ``invars`` and
  ``outvars`` carry the shapes the attention saw)."""
  calls = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "custom_vmap_call":
        calls.append(eqn)
      for value in eqn.params.values():
        for sub in (value if isinstance(value, (list, tuple)) else [value]):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(closed_jaxpr.jaxpr)
  return calls
