"""hmmprompt.ginc: GINC's concepts, their mixture, prompts and the exact
in-context predictor, beside GINC's released arrays (../shared/ginc)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import ginc
from hmmprompt import hmm as hmm_lib
from hmmprompt import icl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "ginc")


@pytest.fixture(scope="module")
def released():
  if not os.path.exists(os.path.join(SHARED, "ginc_hmms.npz")):
    pytest.skip("GINC's released arrays (../shared/ginc) are not here")
  with open(os.path.join(SHARED, "val.jsonl")) as f:
    docs = [json.loads(line) for line in f][:8]
  return ginc.load_released(os.path.join(SHARED, "ginc_hmms.npz")), docs


def _numpy_log_likelihood(initial, transition, emission, tokens) -> float:
  """The scaled forward algorithm in float64: an independent computation."""
  alpha = np.asarray(initial, np.float64) * emission[:, tokens[0]]
  ll = np.log(alpha.sum())
  alpha /= alpha.sum()
  for x in tokens[1:]:
    alpha = (alpha @ transition) * emission[:, x]
    ll += np.log(alpha.sum())
    alpha /= alpha.sum()
  return ll


def test_released_hmms_load_and_score_documents_as_a_float64_forward(
    released):
  """Our HMM type takes GINC's arrays; our forward's log-likelihood of a
  validation document's first 256 symbols is the float64 forward's, within
  float32 rounding (256 steps, each a few ulps: 1e-4 relative)."""
  r, docs = released
  hmms = r["id"]
  assert hmms.transition.shape == (5, 100, 100)
  for doc in docs[:3]:
    k, tokens = doc["hmm_idx"], np.asarray(doc["symbols"][:256])
    one = jax.tree.map(lambda x: x[k], hmms)
    want = _numpy_log_likelihood(*(np.asarray(a, np.float64) for a in one),
                                 tokens)
    got = float(hmm_lib.log_likelihood(one, tokens))
    assert got == pytest.approx(want, rel=1e-4)
  try:
    from hmmlearn import hmm as hl  # pylint: disable=g-import-not-at-top
  except ImportError:
    return  # the bench extra; the float64 forward above stands in
  model = hl.CategoricalHMM(n_components=100)
  one = jax.tree.map(lambda x: np.asarray(x[docs[0]["hmm_idx"]], np.float64),
                     hmms)
  model.startprob_, model.transmat_, model.emissionprob_ = one
  tokens = np.asarray(docs[0]["symbols"][:256])
  assert model.score(tokens[:, None]) == pytest.approx(
      float(hmm_lib.log_likelihood(jax.tree.map(
          lambda x: x[docs[0]["hmm_idx"]], hmms), tokens)), rel=1e-4)


def test_the_mixture_is_the_average_of_its_concepts_and_names_the_source(
    released):
  """The block-diagonal mixture's likelihood is the concepts' average
  (two computations), and its posterior over concepts picks each
  validation document's generating HMM."""
  r, docs = released
  mix = ginc.mixture(r["id"])
  for doc in docs:
    tokens = jnp.asarray(doc["symbols"][:128])
    lls = jnp.stack([hmm_lib.log_likelihood(
        jax.tree.map(lambda x, k=k: x[k], r["id"]), tokens) for k in range(5)])
    assert float(hmm_lib.log_likelihood(mix, tokens)) == pytest.approx(
        float(jax.scipy.special.logsumexp(lls) - np.log(5)), rel=1e-4)
    post = ginc.concept_posterior(r["id"], tokens)
    assert int(jnp.argmax(post)) == doc["hmm_idx"]
    assert float(post.sum()) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("which", ["drawn", "released"])
def test_drawn_concepts_have_the_released_ones_statistics(request, which):
  """A mixture of n random n x n permutations leaves an entry uncovered
  with probability q = (1 - 1/n)^n; the value factor's diagonal is always
  covered (the identity) and its other entries with 1 - q, so about
  1 - (1 - q)(1 - 0.9 q) of the transitions are exact zeros. Released and
  drawn concepts both are within 0.05 of it (the drawn always checked, the
  released where ../shared/ginc is); the value diagonal is at least the
  identity coefficient; a start probability is within e^(+-0.1) of 1/100
  (softmax of (u - 1/2) / 10); each state emits its memory symbol, the
  delimiter 0 exactly at slot 0."""
  if which == "released":
    r, _ = request.getfixturevalue("released")
    concept_sets, memory = (r["id"], r["ood"]), r["memory"]
  else:
    drawn, memory = ginc.concepts(jax.random.PRNGKey(0))
    concept_sets = (drawn,)
    emitted = np.argmax(np.asarray(drawn.emission[0]), -1)
    np.testing.assert_array_equal(emitted, np.asarray(memory).reshape(-1))
    value = np.asarray(ginc.value_factor(jax.random.PRNGKey(1),
                                         ginc.GincConfig()))
    assert np.all(np.diag(value) >= 0.9 - 1e-6)
    np.testing.assert_allclose(value.sum(-1), 1, rtol=1e-6)
  q = (1 - 1 / 10) ** 10
  expect = 1 - (1 - q) * (1 - 0.9 * q)
  for hmms in concept_sets:
    assert np.mean(np.asarray(hmms.transition) == 0) == pytest.approx(
        expect, abs=0.05)
    start = np.asarray(hmms.initial)
    assert np.all(start >= np.exp(-0.1) / 100 - 1e-7)
    assert np.all(start <= np.exp(0.1) / 100 + 1e-7)
  mem = np.asarray(memory)
  assert np.all(mem[:, 0] == 0) and np.all(mem[:, 1:] >= 1)


DRAWN = ginc.GincConfig(num_values=4, num_slots=5, num_symbols=12,
                       num_concepts=4)
"""Concepts the repository draws (no file needed): 20 states, 2 ID, 2 OOD."""
SOURCES = ["drawn", pytest.param("released", marks=pytest.mark.slow)]
"""Every label and layout test runs on drawn concepts, and on GINC's
released ones where ../shared/ginc is (else skipped, saying so)."""


def _concepts(request, which: str) -> dict:
  """``{"id": HMM [K], "ood": HMM [K], "memory": int [V, S]}``: GINC's
  released arrays (skips, naming them, when absent) or :data:`DRAWN`'s
  concepts, the first half ID."""
  if which == "released":
    return request.getfixturevalue("released")[0]
  concepts, memory = ginc.concepts(jax.random.PRNGKey(8), DRAWN)
  half = DRAWN.num_concepts // 2
  return {"id": jax.tree.map(lambda x: x[:half], concepts),
          "ood": jax.tree.map(lambda x: x[half:], concepts), "memory": memory}


def _predictive(hmm, k: int, start, x) -> np.ndarray:
  """``[X]``: concept ``k``'s next-symbol distribution after ``x`` from
  ``start`` (float64 forward; zeros where ``x`` is impossible)."""
  _, trans, emit = (np.asarray(a[k], np.float64) for a in hmm)
  alpha = np.asarray(start, np.float64) * emit[:, x[0]]
  for t in x[1:]:
    alpha = (alpha @ trans) * emit[:, t]
  if alpha.sum() == 0:
    return np.zeros(emit.shape[1])
  return (alpha / alpha.sum()) @ trans @ emit


def _is_label(pred_X, label: int, tol: float) -> bool:
  """Whether ``label`` is an argmax of ``pred_X`` to ``tol`` (0 for an
  impossible prompt, as ``argmax`` of :func:`ginc.predict`'s zeros)."""
  if pred_X.sum() == 0:
    return label == 0
  return pred_X[label] >= pred_X.max() - tol


def _label_tol(num_states: int, length: int) -> float:
  """:func:`ginc.predict` in float32 against the float64 forward: each of
  its ``length + 1`` steps (and the read-out) sums ``H`` products, so
  within ``(length + 2) H eps`` on probabilities, which are at most 1."""
  return (length + 2) * num_states * float(np.finfo(np.float32).eps)


@pytest.mark.parametrize("which", SOURCES)
def test_prompts_follow_gincs_layout_and_labels(request, which):
  """Examples of ``length`` symbols each end with the delimiter; the test
  example's ``x`` is the last ``length - 1``; the ID label is the concept's
  argmax next symbol from a uniform start over the start slot's states
  (recomputed here with the float64 forward, to :func:`_label_tol`)."""
  r = _concepts(request, which)
  memory = np.asarray(r["memory"])
  num_values, num_slots = memory.shape
  n = num_values * num_slots
  length, k = 5, 3
  batch = ginc.prompts(jax.random.PRNGKey(3), r["id"], r["memory"],
                       "ID_sample", k, length, 20)
  tokens = np.asarray(batch["tokens"])
  assert tokens.shape == (20, (k + 1) * (length + 1) - 2)
  assert np.all(tokens[:, length::length + 1] == 0)
  tol = _label_tol(n, length)
  for i in range(20):
    # The start slot is shared: its column holds every example's first
    # symbol (a random slot per example would not, but by chance).
    firsts = set(tokens[i, ::length + 1])
    slots = [s for s in range(1, num_slots) if firsts <= set(memory[:, s])]
    assert slots, firsts
    # The label, recomputed: the predictive after x from a uniform start
    # over one slot's states, for each slot that holds every first symbol
    # (the prompt's start slot is among them).
    c = int(batch["concept"][i])
    x = tokens[i, -(length - 1):]
    right = []
    for s in slots:
      start = np.zeros(n)
      start[np.arange(num_values) * num_slots + s] = 1 / num_values
      pred = _predictive(r["id"], c, start, x)
      # x was drawn from the concept at the start slot: possible there.
      right.append(pred.sum() > 0
                   and _is_label(pred, int(batch["label"][i]), tol))
    assert any(right), i


@pytest.mark.parametrize("which", SOURCES)
def test_ood_prompts_are_labelled_by_the_held_out_concepts(request, which):
  """:func:`icl.cell_prompts`' ``OOD_sample`` prompts (GINC's
  ``hmms=ood_hmms``): each label is the argmax next symbol, after the test
  example's ``x``, of the held-out concept ``concept`` indexes, from GINC's
  uniform start over all its states; recomputed here with the float64
  forward, to :func:`_label_tol`. The same recomputation from the ID
  concept of that index, or from ``ID_sample``'s kind of start (the states
  of a slot emitting x's first symbol), fails on some prompt: labels from
  either would fail here."""
  if which == "released":
    _concepts(request, which)  # skips, naming the files, when absent
    setup = icl.get_setup("cpu", concepts="released", prompts=32,
                          released_path=os.path.join(SHARED, "ginc_hmms.npz"))
  else:
    setup = icl.get_setup("tiny", prompts=64)
  concepts = {kind: icl.load_concepts(setup, kind) for kind in ("id", "ood")}
  num_values, num_slots = setup.ginc.num_values, setup.ginc.num_slots
  n = num_values * num_slots
  length, k = 5, 2
  batch = icl.cell_prompts(setup, concepts, "OOD_sample", length, k)
  tokens = np.asarray(batch["tokens"])
  assert tokens.shape == (setup.prompts, (k + 1) * (length + 1) - 2)
  tol = _label_tol(n, length)
  uniform = np.full(n, 1 / n)
  memory = np.asarray(icl.memory_of(concepts["ood"], setup))
  wrong = {"id": 0, "slot": 0}
  for row, label, c in zip(tokens, np.asarray(batch["label"]),
                           np.asarray(batch["concept"])):
    x = row[-(length - 1):]
    assert _is_label(_predictive(concepts["ood"], c, uniform, x), label, tol)
    wrong["id"] += not _is_label(_predictive(concepts["id"], c, uniform, x),
                                 label, tol)
    slot = [s for s in range(1, num_slots) if x[0] in memory[:, s]][0]
    start = np.zeros(n)
    start[np.arange(num_values) * num_slots + slot] = 1 / num_values
    wrong["slot"] += not _is_label(_predictive(concepts["ood"], c, start, x),
                                   label, tol)
  assert min(wrong.values()) > 0, wrong


def test_exact_zeros_make_prompts_impossible_and_smoothing_restores_them(
    released):
  """As measured on the arrays (../shared/ginc/README.md): with exact-zero
  transitions most 4-example prompts have probability 0 under every ID
  concept, counted wrong, never NaN; adding 1e-6 to the transitions makes
  every prompt possible and the predictor right on most."""
  r, _ = released
  batch = ginc.prompts(jax.random.PRNGKey(4), r["id"], r["memory"],
                       "ID_sample", 4, 5, 30)
  mix = ginc.mixture(r["id"])
  exact = ginc.icl_accuracy(mix, batch)
  assert exact["impossible"] > 0.3
  assert exact["accuracy"] <= 1 - exact["impossible"]
  nxt, ll = jax.vmap(lambda t: ginc.predict(mix, t))(batch["tokens"])
  assert np.all(np.isfinite(np.asarray(nxt)))
  assert np.any(np.isneginf(np.asarray(ll)))
  smooth = ginc.icl_accuracy(ginc.smoothed(mix, 1e-6), batch)
  assert smooth["impossible"] == 0 and smooth["accuracy"] > 0.8


def test_bad_protocol_and_config_are_refused_by_name():
  with pytest.raises(ValueError, match="protocol"):
    ginc.prompt(jax.random.PRNGKey(0), *ginc.concepts(
        jax.random.PRNGKey(0), ginc.GincConfig(num_concepts=2)), "ID", 1, 3)
  with pytest.raises(ValueError, match="num_slots"):
    ginc.GincConfig(num_slots=1)


@pytest.mark.slow
def test_pretraining_documents_each_come_from_one_uniformly_drawn_concept():
  """Sampling the mixture is GINC's corpus: a document's states stay in
  one concept's block (the transition is block-diagonal), and the
  concepts are drawn uniformly: 400 documents over 4 concepts, each count
  within 4 binomial sds (sqrt(400 / 4 * 3 / 4) = 8.7) of 100."""
  cfg = ginc.GincConfig(num_concepts=4)
  concepts, _ = ginc.concepts(jax.random.PRNGKey(2), cfg)
  mix = ginc.mixture(concepts)
  _, states = jax.vmap(lambda k: hmm_lib.sample(k, mix, 40))(
      jax.random.split(jax.random.PRNGKey(3), 400))
  block = np.asarray(states) // 100
  assert np.all(block == block[:, :1])
  counts = np.bincount(block[:, 0], minlength=4)
  assert np.all(np.abs(counts - 100) <= 4 * 8.7), counts


@pytest.mark.slow
def test_next_symbol_conditionals_are_each_prefixs_predictive():
  """A causal model's exact targets, ``P[X_t | x_<t]`` for every t from
  one forward scan, equal the conditionals of each prefix with a ``MASK``
  appended (an independent computation, one pass per t), on the mixture
  of 3 drawn concepts; each row sums to 1. Both are float32 sums of at
  most H = 300 terms per step over 12 steps, other orders: within
  12 x 300 x 2^-24 ~ 2e-4 (Higham's gamma_n, probabilities <= 1)."""
  concepts, _ = ginc.concepts(jax.random.PRNGKey(5),
                              ginc.GincConfig(num_concepts=3))
  mix = ginc.mixture(concepts)
  tokens, _ = hmm_lib.sample(jax.random.PRNGKey(6), mix, 12)
  got = np.asarray(hmm_lib.token_next_conditionals(mix, tokens))
  for t in range(12):
    prefix = jnp.concatenate([tokens[:t], jnp.array([hmm_lib.MASK])])
    np.testing.assert_allclose(
        got[t], np.asarray(hmm_lib.conditionals(mix, prefix))[-1], atol=2e-4)
  np.testing.assert_allclose(got.sum(-1), 1, atol=2e-4)


class _MultinomialHMM:
  """Stands in, while pickling, for hmmlearn's class of the same name: a
  GINC pickle names ``hmmlearn.hmm.MultinomialHMM`` and holds attributes."""


def _write_release(directory, concepts_K, memory_VxS, slot_K, value_K):
  """GINC's release files as its generate_data.py writes them (lists of
  hmmlearn models and of (slot, value) factor pairs, the memory array),
  with the hmmlearn class faked in ``sys.modules`` for the dump alone."""
  import pickle
  import sys
  import types
  fake = types.ModuleType("hmmlearn.hmm")
  _MultinomialHMM.__module__, _MultinomialHMM.__qualname__ = (
      "hmmlearn.hmm", "MultinomialHMM")
  fake.MultinomialHMM = _MultinomialHMM
  saved = {m: sys.modules.get(m) for m in ("hmmlearn", "hmmlearn.hmm")}
  sys.modules.update({"hmmlearn": types.ModuleType("hmmlearn"),
                      "hmmlearn.hmm": fake})
  try:
    for kind, sl in (("id", slice(0, 2)), ("ood", slice(2, 4))):
      hmms = []
      for k in range(sl.start, sl.stop):
        h = _MultinomialHMM()
        h.startprob_, h.transmat_, h.emissionprob_ = (
            np.asarray(x[k], np.float64) for x in concepts_K)
        h.n_components = h.transmat_.shape[0]
        hmms.append(h)
      with open(os.path.join(directory, f"{kind}_hmms.pkl"), "wb") as f:
        pickle.dump(hmms, f)
      with open(os.path.join(directory, f"{kind}_params.pkl"), "wb") as f:
        pickle.dump([(np.asarray(slot_K[k]), np.asarray(value_K[k]))
                     for k in range(sl.start, sl.stop)], f)
    with open(os.path.join(directory, "fixed_params.pkl"), "wb") as f:
      pickle.dump(np.asarray(memory_VxS), f)
  finally:
    for m, was in saved.items():
      if was is None:
        del sys.modules[m]
      else:
        sys.modules[m] = was


def test_gincs_own_files_convert_without_hmmlearn(tmp_path):
  """A release written as GINC writes it (pickled hmmlearn models) converts
  to the arrays load_released reads, equal to what was pickled, with no
  hmmlearn importable; a pickle naming any other callable is refused by
  name, and a missing file is named."""
  cfg = ginc.GincConfig(num_values=3, num_slots=4, num_symbols=8,
                        num_concepts=4)
  concepts, memory = ginc.concepts(jax.random.PRNGKey(3), cfg)
  slot = np.random.default_rng(0).random((4, 4, 4))
  value = np.random.default_rng(1).random((4, 3, 3))
  _write_release(str(tmp_path), concepts, memory, slot, value)
  out = str(tmp_path / "release.npz")
  ginc.convert_release(str(tmp_path), out)
  got = ginc.load_released(out)
  for kind, sl in (("id", slice(0, 2)), ("ood", slice(2, 4))):
    for a, b in zip(got[kind], concepts):
      np.testing.assert_allclose(a, np.asarray(b)[sl], rtol=1e-6)
  np.testing.assert_array_equal(got["memory"], memory)
  with np.load(out) as d:
    np.testing.assert_array_equal(d["ood_slot_transmat"], slot[2:])
    np.testing.assert_array_equal(d["id_value_transmat"], value[:2])
  import pickle
  with open(tmp_path / "fixed_params.pkl", "wb") as f:
    pickle.dump(os.system, f)
  with pytest.raises(ValueError, match="names posix.system"):
    ginc.convert_release(str(tmp_path), out)
  os.remove(tmp_path / "ood_params.pkl")
  with pytest.raises(ValueError, match="lacks GINC's ood_params.pkl"):
    ginc.convert_release(str(tmp_path), out)
