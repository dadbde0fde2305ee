"""The paper's assumptions, checked on given parameters, and the constructions
of its proofs (Theorems 3.3 and 3.6).

``W = emission.T`` (``[V, H]``, the paper's orientation); the paper's
``A_{:,h}`` (successors of ``h``) is our ``transition[h, :]``. A probability is
non-zero above :data:`SUPPORT_TOL`; columns are independent when their smallest
singular value is above :data:`RANK_TOL` times their largest. ``mu`` is the
task's ``[C, Z]`` weights, ``supp(mu)`` the latents of a non-zero weight."""

import itertools
from typing import Any, NamedTuple

import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import generative

SUPPORT_TOL = 1e-8
RANK_TOL = 1e-6
MAX_SEARCH = 100_000


class Verdict(NamedTuple):
  """Whether an assumption holds, why (not), and the numbers behind it."""

  name: str
  holds: bool
  reason: str
  details: dict

  def as_dict(self) -> dict:
    return {"holds": bool(self.holds), "reason": self.reason,
            **{k: _jsonable(v) for k, v in self.details.items()}}


def _jsonable(v):
  if isinstance(v, (np.floating, float)):
    return float(v) if np.isfinite(v) else str(v)
  if isinstance(v, np.integer):
    return int(v)
  if isinstance(v, (list, tuple, np.ndarray)):
    return [_jsonable(x) for x in v]
  return v


def _np(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def rank_and_condition(cols_VxZ: np.ndarray) -> tuple[int, float]:
  """Numerical rank (relative tolerance ``RANK_TOL``) and condition number."""
  if cols_VxZ.shape[1] == 0:
    return 0, 1.0
  s = np.linalg.svd(cols_VxZ, compute_uv=False)
  rank = int(np.sum(s > RANK_TOL * s[0])) if s[0] > 0 else 0
  cond = float(s[0] / s[-1]) if s[-1] > 0 else float("inf")
  return rank, cond


def support(mu) -> list[int]:
  return [int(k) for k in np.nonzero(np.any(_np(mu) != 0, axis=0))[0]]


# Vanilla HMM (Section 3).
def assumption_3_1(hmm: hmm_lib.HMM) -> Verdict:
  """W has linearly independent columns."""
  w = _np(hmm.emission).T
  v, h = w.shape
  rank, cond = rank_and_condition(w)
  details = {"rank": rank, "num_states": h, "vocab_size": v,
             "condition_number": cond}
  if h > v:
    return Verdict("3.1", False, f"|H| = {h} > |X| = {v}: at most {v} "
                   f"independent columns", details)
  if rank < h:
    return Verdict("3.1", False, f"W has rank {rank} < |H| = {h} at "
                   f"relative tolerance {RANK_TOL}", details)
  return Verdict("3.1", True, f"W has full column rank {h} (condition number "
                 f"{cond:.3g})", details)


def _primitive(support_HxH: np.ndarray) -> bool:
  """Irreducible and aperiodic iff some power is all-positive (Wielandt: any
  power from ``(H - 1)^2 + 1`` on), so squaring past it tells."""
  reach = support_HxH.astype(np.int64)
  for _ in range(((len(reach) - 1) ** 2).bit_length()):
    reach = np.minimum(reach @ reach, 1)
  return bool(reach.all())


def assumption_3_2(hmm: hmm_lib.HMM) -> Verdict:
  """The chain is ergodic (irreducible, aperiodic), P[H_0] of full support."""
  trans = _np(hmm.transition) > SUPPORT_TOL
  init = _np(hmm.initial)
  details = {"min_initial": float(init.min())}
  # Irreducible iff I + A is primitive.
  if not _primitive(trans | np.eye(len(trans), dtype=bool)):
    return Verdict("3.2", False, "the chain is reducible (not every state "
                   "reaches every other)", details)
  if not _primitive(trans):
    return Verdict("3.2", False, "the chain is periodic", details)
  if init.min() <= SUPPORT_TOL:
    return Verdict("3.2", False, f"P[H_0] lacks full support (state "
                   f"{int(init.argmin())} has probability {init.min():.3g})",
                   details)
  return Verdict("3.2", True, "ergodic chain, P[H_0] has full support", details)


def assumption_3_5(hmm: hmm_lib.HMM, mu) -> Verdict:
  """Some ``B`` has ``H* = ∪_{h∈B} supp(A_{:,h}) ⊇ supp(mu)``, ``W[:, H*]``
  independent; reports the best-conditioned ``B`` of one predecessor per state
  of ``supp(mu)`` (enough: a smaller ``B`` has a smaller ``H*``)."""
  w, trans = _np(hmm.emission).T, _np(hmm.transition)
  supp_mu = support(mu)
  preds = {s: np.nonzero(trans[:, s] > SUPPORT_TOL)[0].tolist()
           for s in supp_mu}
  details: dict[str, Any] = {"support_mu": supp_mu}
  for s, p in preds.items():
    if not p:
      return Verdict("3.5", False, f"state {s} in supp(mu) has no "
                     f"predecessor, so no H* can contain it", details)
  best, seen = None, set()
  for choice in itertools.product(*preds.values()):
    b = frozenset(choice)
    if b in seen:
      continue
    seen.add(b)
    if len(seen) > MAX_SEARCH:
      break
    # The union of the successors of B's states, sorted.
    h_star = np.nonzero((trans[list(b)] > SUPPORT_TOL).any(axis=0))[0].tolist()
    if len(h_star) > w.shape[0]:
      continue
    rank, cond = rank_and_condition(w[:, h_star])
    if rank == len(h_star) and (best is None or cond < best[2]):
      best = (sorted(b), h_star, cond)
  details["sets_searched"] = len(seen)
  if best is None:
    why = ("no set B gives an H* with independent W columns"
           if len(seen) <= MAX_SEARCH else f"none of the first {MAX_SEARCH} "
           "sets B works (search cut)")
    return Verdict("3.5", False, why, details)
  details.update(B=best[0], H_star=best[1], condition_number=best[2])
  return Verdict("3.5", True, f"B = {best[0]} gives H* = {best[1]} with "
                 f"condition number {best[2]:.3g}", details)


def theorem_3_3_head(hmm: hmm_lib.HMM, mu) -> dict:
  """Linear head ``{w [V, C], bias [C]}`` on raw ``G_MASK`` computing
  ``mu @ P[H_0 | x_{1:T}] = mu @ W^† G`` (exact under Assumption 3.1)."""
  if not (verdict := assumption_3_1(hmm)).holds:
    raise ValueError(f"Theorem 3.3 needs Assumption 3.1: {verdict.reason}")
  w_pinv = np.linalg.pinv(_np(hmm.emission).T)
  return {"w": (_np(mu) @ w_pinv).T.astype(np.float32),
          "bias": np.zeros(np.shape(mu)[0], np.float32)}


def theorem_3_6_prompt_head(hmm: hmm_lib.HMM, mu) -> tuple[np.ndarray, dict]:
  """Theorem 3.6's prompt ``u = 1_B`` (``[1, H]``, an embedding for ``apply``)
  and linear head on ``G`` at the ``MASK`` (index 1): after ``u``, the
  ``MASK``'s state has prior ``π_u ∝ (P[H_0] ⊙ u) A`` on ``H*``, so ``G ∝ W[:,
  H*] (r ⊙ P[H_0 | x])[H*]``, ``r = π_u / P[H_0]``, which the head undoes."""
  if not (verdict := assumption_3_5(hmm, mu)).holds:
    raise ValueError(f"Theorem 3.6 needs Assumption 3.5: {verdict.reason}")
  u = np.zeros((1, hmm.num_states), np.float32)
  u[0, verdict.details["B"]] = 1.0
  init = _np(hmm.initial)
  prior = (init * u[0]) @ _np(hmm.transition)
  prior /= prior.sum()
  h_star = verdict.details["H_star"]
  r = prior[h_star] / init[h_star]
  w_pinv = np.linalg.pinv(_np(hmm.emission).T[:, h_star])
  return u, {"w": ((_np(mu)[:, h_star] / r) @ w_pinv).T.astype(np.float32),
             "bias": np.zeros(np.shape(mu)[0], np.float32)}


# Memory HMM, single cell (Section 4).
def _memory_columns(mhmm, memory_values, states) -> np.ndarray:
  e = _np(mhmm.emission)  # [M, H, V]
  cols = [e[m, h] for m in memory_values for h in states]
  return np.column_stack(cols) if cols else np.zeros((e.shape[-1], 0))


def _search_recoverable(mhmm, memory_values, name) -> Verdict:
  h = mhmm.num_states
  if h > 16:
    raise ValueError(f"Assumption {name} search enumerates subsets of the "
                     f"{h} syntax states; at most 16 are supported")
  best = None
  for size in range(h, 0, -1):
    for subset in itertools.combinations(range(h), size):
      rest = [x for x in range(h) if x not in subset]
      a, b = (_memory_columns(mhmm, memory_values, s) for s in (subset, rest))
      rank_a, cond = rank_and_condition(a)
      if rank_a < a.shape[1]:
        continue
      rank_b = rank_and_condition(b)[0]
      rank_ab = rank_and_condition(np.concatenate([a, b], axis=1))[0]
      if rank_ab == rank_a + rank_b and (best is None or cond < best[1]):
        best = (list(subset), cond)
    if best is not None:
      break  # the largest recoverable sets are the most useful
  details: dict[str, Any] = {"memory_values": list(memory_values)}
  if best is None:
    return Verdict(name, False, "no set of syntax states H* has independent "
                   "emission columns with a span disjoint from the rest",
                   details)
  details.update(H_star=best[0], condition_number=best[1])
  return Verdict(name, True, f"H* = {best[0]} (condition number "
                 f"{best[1]:.3g})", details)


def assumption_4_2(mhmm: memory_lib.MemoryHMM) -> Verdict:
  """Some ``H*`` has ``{W[:, (m, h)]: m ∈ M, h ∈ H*}`` independent, with a
  span disjoint from the columns of the other states (single cell)."""
  return _search_recoverable(mhmm, range(mhmm.memory_size), "4.2")


def assumption_4_5(mhmm: memory_lib.MemoryHMM, mu) -> Verdict:
  """Assumption 4.2 restricted to memory values in ``supp(mu)``."""
  return _search_recoverable(mhmm, support(mu), "4.5")


def assumption_4_4(mhmm: memory_lib.MemoryHMM, atol: float = 1e-3) -> Verdict:
  """Regularity of the syntax chain and ``P[H_0] = P[H_0] A`` (stationary)."""
  base = hmm_lib.HMM(mhmm.initial, mhmm.transition, mhmm.emission[0])
  reg = assumption_3_2(base)
  init = _np(mhmm.initial)
  gap = float(np.abs(init @ _np(mhmm.transition) - init).max())
  details = {"stationarity_gap": gap, **reg.details}
  if not reg.holds:
    return Verdict("4.4", False, reg.reason, details)
  if gap > atol:
    return Verdict("4.4", False, f"P[H_0] is not stationary (max gap "
                   f"{gap:.3g} > {atol})", details)
  return Verdict("4.4", True, "regular and stationary", details)


def verdicts(model: generative.Model, mu) -> dict:
  """The assumptions of the model's section, as JSON-ready dicts."""
  found = ((assumption_4_2(model), assumption_4_4(model),
            assumption_4_5(model, mu)) if generative.is_memory(model) else
           (assumption_3_1(model), assumption_3_2(model),
            assumption_3_5(model, mu)))
  return {v.name: v.as_dict() for v in found}
