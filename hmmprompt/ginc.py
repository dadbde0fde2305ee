"""GINC (Xie, Raghunathan, Liang & Ma, ICLR 2022): in-context learning on a
mixture of HMM "concepts" (docs/icl.md).

A concept's hidden state is ``(value v, slot s)``, index ``v * S + s``: the
value (an entity) changes slowly, the slot (a property) moves, and the state
emits ``memory[v, s]``. Its transition is ``kron(value_factor [V, V],
slot_factor [S, S])``, each factor a softmax-weighted mixture of random
permutation matrices. A pretraining document comes from one concept drawn
uniformly (:func:`mixture`)."""

import dataclasses
import functools
import os
import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from hmmprompt import validation

PROTOCOLS = ("ID_sample", "OOD_sample")
"""GINC's prompt protocols (``generate_prompts``, ``random_sample=True``)."""


@dataclasses.dataclass(frozen=True)
class GincConfig:
  """GINC's construction (defaults: the released dataset's,
  ``GINC_trans0.1_start10.0_nsymbols50_nvalues10_nslots10_vic0.9_nhmms10``)."""

  num_values: int = 10  # entities V
  num_slots: int = 10  # properties S (slot 0 the delimiter)
  num_symbols: int = 50  # the vocabulary (symbol 0 the delimiter)
  transition_temp: float = 0.1  # the permutation mixtures' softmax's
  start_temp: float = 10.0  # the start distribution's softmax temperature
  value_identity: float = 0.9  # the value factor: c I + (1 - c) mixture
  num_concepts: int = 10  # concepts drawn, the first half in distribution

  def __post_init__(self):
    validation.require_positive(self, "num_values", "num_concepts")
    if self.num_slots < 2 or self.num_symbols < 2:
      raise ValueError(f"GincConfig needs num_slots and num_symbols >= 2 (one "
                       f"of each is the delimiter), got {self.num_slots}, "
                       f"{self.num_symbols}")
    if not (self.transition_temp > 0 and self.start_temp > 0
            and 0 <= self.value_identity <= 1):
      raise ValueError("GincConfig needs temperatures > 0 and value_identity "
                       "in [0, 1]")


def memory_matrix(key, cfg: GincConfig) -> jax.Array:
  """``int32 [V, S]``: each state's symbol, 1.. at random, 0 at slot 0."""
  return jax.random.randint(key, (cfg.num_values, cfg.num_slots), 1,
                            cfg.num_symbols).at[:, 0].set(0)


def concept(key, cfg: GincConfig, memory_VxS: jax.Array,
            value_factor_VxV: jax.Array) -> hmm_lib.HMM:
  """One concept: a new start distribution and slot factor, the shared
  value factor (GINC draws it once, under a fixed seed) and memory."""
  k_start, k_slot = jax.random.split(key)
  n = cfg.num_values * cfg.num_slots
  start = hmm_lib.random_simplex(k_start, (n,), cfg.start_temp)
  slot = hmm_lib.random_transition(k_slot, cfg.num_slots, cfg.transition_temp)
  return hmm_lib.HMM(start, jnp.kron(value_factor_VxV, slot), jax.nn.one_hot(
      memory_VxS.reshape(-1), cfg.num_symbols))


def value_factor(key, cfg: GincConfig) -> jax.Array:
  """``[V, V]``: ``c I + (1 - c)`` a permutation mixture
  (:func:`hmm.random_transition`, GINC's transition block)."""
  mix = hmm_lib.random_transition(key, cfg.num_values, cfg.transition_temp)
  c = cfg.value_identity
  return c * jnp.eye(cfg.num_values) + (1 - c) * mix


def concepts(key, cfg: GincConfig = GincConfig()
             ) -> tuple[hmm_lib.HMM, jax.Array]:
  """``(concepts [num_concepts], memory [V, S])``: the first half ID."""
  k_mem, k_value, k_concepts = jax.random.split(key, 3)
  memory, value = memory_matrix(k_mem, cfg), value_factor(k_value, cfg)
  return jax.vmap(lambda k: concept(k, cfg, memory, value))(
      jax.random.split(k_concepts, cfg.num_concepts)), memory


class _Attributes:
  """A GINC pickle's hmmlearn model: attributes only (no hmmlearn needed)."""

  def __setstate__(self, state):
    self.__dict__.update(state if isinstance(state, dict) else state[-1])


class _Unpickler(pickle.Unpickler):
  """Numbers only: hmmlearn / sklearn classes become :class:`_Attributes`,
  numpy's pass, any other global is refused (a pickle can name any callable)."""

  def find_class(self, module, name):
    if module.split(".")[0] in ("hmmlearn", "sklearn"):
      return _Attributes
    if module.split(".")[0] == "numpy" or (module, name) in (
        ("copyreg", "_reconstructor"), ("builtins", "object")):
      return super().find_class(module, name)
    raise pickle.UnpicklingError(f"a GINC pickle names {module}.{name}, "
                                 f"which is not numbers")


RELEASE_FILES = ("id_hmms.pkl", "ood_hmms.pkl", "id_params.pkl",
                 "ood_params.pkl", "fixed_params.pkl")


def convert_release(source: str, out: str) -> None:
  """Writes :func:`load_released`'s file ``out`` from GINC's own
  (p-lambda/incontext-learning at 84fab21, ``data/GINC_trans0.1_start10.0_
  nsymbols50_nvalues10_nslots10_vic0.9_nhmms10/``): :data:`RELEASE_FILES`
  in ``source``. ``ValueError`` names what is missing or wrong."""
  if missing := [f for f in RELEASE_FILES
                 if not os.path.isfile(os.path.join(source, f))]:
    raise ValueError(f"{source} lacks GINC's {', '.join(missing)}")
  def load(name):
    with open(os.path.join(source, name), "rb") as f:
      return _Unpickler(f).load()
  try:
    arrays: dict[str, Any] = {
        "all_values": np.asarray(load("fixed_params.pkl"), np.int64)}
    for kind in ("id", "ood"):
      hmms, params = load(f"{kind}_hmms.pkl"), load(f"{kind}_params.pkl")
      for name in ("startprob", "transmat", "emissionprob"):
        arrays[f"{kind}_{name}"] = np.stack([getattr(h, f"{name}_")
                                             for h in hmms])
      for i, name in enumerate(("slot_transmat", "value_transmat")):
        arrays[f"{kind}_{name}"] = np.stack([p[i] for p in params])
  except (AttributeError, IndexError, TypeError, pickle.UnpicklingError) as e:
    raise ValueError(f"{source} does not hold GINC's release: {e}") from None
  tmp = out + ".tmp.npz"
  np.savez(tmp, **arrays)
  os.replace(tmp, out)
  load_released(out)  # checked as our HMMs


def load_released(path: str) -> dict:
  """GINC's released HMMs (:func:`convert_release`'s file) as
  ``{"id": HMM [5], "ood": HMM [5], "memory": int [V, S]}``, float32; each
  HMM is checked as our :class:`hmm.HMM` (rows summing to 1)."""
  with np.load(path) as d:
    out: dict = {kind: hmm_lib.HMM(*(
        jnp.asarray(d[f"{kind}_{name}"], jnp.float32)
        for name in ("startprob", "transmat", "emissionprob")))
                 for kind in ("id", "ood")}
    out["memory"] = jnp.asarray(d["all_values"], jnp.int32)
  return out


def mixture(concepts_K: hmm_lib.HMM) -> hmm_lib.HMM:
  """``K`` concepts as one HMM of ``K H`` states: start ``initial_k / K``
  (uniform prior), block-diagonal transition (a document keeps its concept)."""
  k, h = concepts_K.initial.shape
  prior = jnp.full((k,), 1.0 / k)
  eye = jnp.eye(k, dtype=concepts_K.transition.dtype)
  transition = jnp.einsum("kl,kij->kilj", eye, concepts_K.transition)
  return hmm_lib.HMM((prior[:, None] * concepts_K.initial).reshape(-1),
                     transition.reshape(k * h, k * h),
                     concepts_K.emission.reshape(k * h, -1))


def concept_posterior(concepts_K: hmm_lib.HMM, tokens_T: jax.Array
                      ) -> jax.Array:
  """``[K]``: the posterior over concepts of one document (uniform prior),
  from the mixture's smoothed posterior at the first position."""
  k, h = concepts_K.initial.shape
  post = hmm_lib.token_smooth(mixture(concepts_K), tokens_T).posterior
  return post[0].reshape(k, h).sum(-1)


def smoothed(hmm: hmm_lib.HMM, eps: float) -> hmm_lib.HMM:
  """``hmm`` with ``eps`` added to every transition entry, rows renormalised
  (0: unchanged): GINC's exact zeros make most prompts impossible."""
  if eps == 0:
    return hmm
  t = hmm.transition + eps
  return hmm._replace(transition=t / t.sum(-1, keepdims=True))


def predict(model: hmm_lib.HMM,
            prompt_T: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(next-symbol distribution [X], log-likelihood [])`` of ``prompt_T`` under
  ``model`` (a :func:`mixture`): the Bayes-optimal in-context prediction. An
  impossible prompt (log-likelihood ``-inf``) gives zeros, never NaN."""
  tokens = jnp.concatenate([prompt_T, jnp.array([hmm_lib.MASK], jnp.int32)])
  smooth = hmm_lib.token_smooth(model, tokens)
  next_X = smooth.masked_posterior[-1] @ model.emission
  return next_X, smooth.log_likelihood


def _path(key, transition_HxH: jax.Array, start: jax.Array, length: int):
  """``int [length]``: a hidden path from state ``start``."""
  def step(h, k):
    nxt = jax.random.categorical(k, jnp.log(transition_HxH[h]))
    return nxt, nxt
  _, rest = jax.lax.scan(step, start, jax.random.split(key, length - 1))
  return jnp.concatenate([start[None], rest])


def prompt(key, concepts_K: hmm_lib.HMM, memory_VxS: jax.Array,
           protocol: str, num_examples: int, length: int) -> dict:
  """One GINC prompt: ``num_examples`` examples of ``length`` symbols and the
  test example's first ``length - 1``, each example followed by a delimiter, as
  ``{"tokens": int [(k + 1)(length + 1) - 2], "label": [], "concept": []}``.

  ``ID_sample``: one concept and one start slot in ``1..S-1``; each example
  starts at (a random value, that slot) and runs ``length - 1`` hidden steps of
  the concept. The label is the concept's most likely next symbol after the test
  example's ``x``, from a uniform start over the start slot's states.
  ``OOD_sample``: each example a random slot pattern under one random value; the
  label as ``ID_sample``'s, from a uniform start."""
  validation.one_of("protocol", protocol, PROTOCOLS)
  num_values, num_slots = memory_VxS.shape
  k_concept, k_slot, k_examples = jax.random.split(key, 3)
  c = jax.random.randint(k_concept, (), 0, concepts_K.initial.shape[0])
  hmm = jax.tree.map(lambda x: x[c], concepts_K)
  slot0 = jax.random.randint(k_slot, (), 1, num_slots)
  def example(k):
    k_value, k_path = jax.random.split(k)
    value = jax.random.randint(k_value, (), 0, num_values)
    if protocol == "ID_sample":
      states = _path(k_path, hmm.transition, value * num_slots + slot0, length)
      return states // num_slots, states % num_slots
    slots = jax.random.randint(k_path, (length,), 1, num_slots)
    return jnp.full((length,), value), slots
  values, slots = jax.vmap(example)(jax.random.split(k_examples,
                                                     num_examples + 1))
  # Each example then a delimiter (slot 0, its last value).
  values = jnp.concatenate([values, values[:, -1:]], 1).reshape(-1)
  slots = jnp.concatenate([slots, jnp.zeros_like(slots[:, :1])], 1).reshape(-1)
  symbols = memory_VxS[values, slots][:-1]  # the last delimiter dropped
  x = symbols[-length:-1]
  n = num_values * num_slots
  start = (jnp.full((n,), 1.0 / n) if protocol == "OOD_sample" else
           jnp.zeros(n).at[jnp.arange(num_values) * num_slots + slot0].set(
               1.0 / num_values))
  label = jnp.argmax(predict(hmm._replace(initial=start), x)[0])
  return {"tokens": symbols[:-1], "label": label, "concept": c}


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def prompts(key, concepts_K: hmm_lib.HMM, memory_VxS: jax.Array,
            protocol: str, num_examples: int, length: int, num: int) -> dict:
  """``num`` :func:`prompt` s stacked (``{"tokens": [num, T], ...}``)."""
  return jax.vmap(lambda k: prompt(k, concepts_K, memory_VxS, protocol,
                                   num_examples, length))(
                                       jax.random.split(key, num))


@jax.jit
def predict_all(model: hmm_lib.HMM, prompts_NxT: jax.Array) -> jax.Array:
  """``[N, X]``: :func:`predict`'s distribution after each prompt."""
  return jax.vmap(lambda t: predict(model, t)[0])(prompts_NxT)


def scores(next_NxX, labels_N) -> dict:
  """Accuracy (an all-zero row, an impossible prompt, counts wrong), impossible
  share and mean label probability of next-symbol distributions ``[N, X]``."""
  next_NxX, labels_N = np.asarray(next_NxX), np.asarray(labels_N)
  possible = next_NxX.sum(-1) > 0
  right = possible & (next_NxX.argmax(-1) == labels_N)
  return {"accuracy": float(right.mean()),
          "impossible": float(1 - possible.mean()),
          "label_prob": float(np.take_along_axis(
              next_NxX, labels_N[:, None], -1).mean())}


def icl_accuracy(model: hmm_lib.HMM, batch: dict) -> dict:
  """The exact ``model``'s in-context :func:`scores` on :func:`prompts`."""
  return scores(predict_all(model, batch["tokens"]), batch["label"])
