"""Properties the paper's claims rest on, above the kernels (issue 23).

The kernel tests check numbers against brute force; these check that the
layers above them do what Figure 3 needs: tuning trains exactly what it
should, an accuracy is measured on the split it names, the attention head
attends, and the exact backbone reproduces both findings on a small scale.
Each was found missing by a mutation-testing pass (docs/mutation.md): a
mutant that broke it left every earlier test green.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import generative
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import Backbone
from hmmprompt.backbones import exact

V = 8  # vocabulary of the constructed backbones


# ----------------------------------------------------------------------------
# Constructed backbones, where the right answer is known by construction.
# Module-level functions: each backbone is one static jit argument.


def _one_hot_embed(params, tokens_T):
  """``e(x)`` one-hot; ``MASK`` all ones, as the exact backbone's."""
  del params
  onehot_TxV = jax.nn.one_hot(tokens_T, V)
  return jnp.where((tokens_T == hmm_lib.MASK)[:, None], 1.0, onehot_TxV)


def _next_token(params, emb_TxD):
  """``G_t``: mostly the next position's token (so ``G`` at the ``MASK``
  shows ``x_1``)."""
  del params
  nxt_TxD = jnp.roll(emb_TxD, -1, axis=0) * 0.9 + 0.1 / V
  return nxt_TxD / nxt_TxD.sum(-1, keepdims=True)


def _uniform(params, emb_TxD):
  """``G_t`` uniform: the outputs carry no information at all."""
  del params
  return jnp.full(emb_TxD.shape[:1] + (V,), 1.0 / V)


def _backbone(name, apply):
  return Backbone(name=name, embed=_one_hot_embed, apply=apply,
                  prompt_embedding=lambda raw: raw, embed_dim=V,
                  vocab_size=V)


NEXT_TOKEN = _backbone("next_token", _next_token)
UNIFORM = _backbone("uniform", _uniform)
NO_PARAMS = jnp.zeros(())


def _tokens(key, n, seq_len, first=None):
  """``[n, seq_len + 1]``, ``MASK`` then uniform tokens; ``first`` fixes
  ``x_1``."""
  x = jax.random.randint(key, (n, seq_len), 0, V)
  if first is not None:
    x = x.at[:, 0].set(first)
  return jnp.concatenate([jnp.full((n, 1), hmm_lib.MASK), x], axis=1)


def _high(tokens_NxT, pos):
  """Label 1 where the token at ``pos`` is in the upper half of the
  vocabulary."""
  return (tokens_NxT[:, pos] >= V // 2).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Tuning trains exactly the tunable pytree.


@pytest.fixture(scope="module")
def small_exact():
  model = hmm_lib.random_hmm(jax.random.PRNGKey(4), 4, 10)
  bb, bp = exact.make(model)
  task = tasks.make_task(jax.random.PRNGKey(0), model, tasks.TaskConfig(
      num_train=64, num_val=16, num_test=16, seq_len=8))
  return bb, bp, task


@pytest.mark.parametrize("method,head", [
    pytest.param("head", "linear", marks=pytest.mark.slow),
    pytest.param("head", "attention", marks=pytest.mark.slow),
    pytest.param("prompt", "linear", marks=pytest.mark.slow),
    ("prompt", "attention")])
def test_tuning_moves_every_tunable_leaf_and_no_frozen_one(small_exact,
                                                          method, head):
  """Every leaf of the tunable pytree (head; prompt) leaves its
  initialisation, with its shape kept; the tunable pytree has exactly the
  method's entries; the backbone's params are untouched. (A prompt held
  by ``stop_gradient`` stayed at its init and cost the paper's main
  finding, with every test green.)"""
  bb, bp, task = small_exact
  cfg = tuning.TuneConfig(method=method, head=head, features="log",
                          epochs=1, batch_size=32, prompt_len=2,
                          eval_chunk=16)
  data = tuning.data_from_task(task, cfg)
  key = jax.random.PRNGKey(1)
  init = tuning.init_tunable(jax.random.split(key)[0], bb, bp, cfg,
                             data.train_tokens)
  frozen = jax.tree.map(lambda a: np.array(a, copy=True), bp)
  _, tunable = tuning.tune(key, bb, bp, data, cfg)
  want = {"head"} | ({"prompt"} if method == "prompt" else set())
  assert set(tunable) == set(init) == want
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(init),
                          jax.tree.leaves(tunable)):
    assert a.shape == b.shape, path
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) > 1e-6, (
        f"{jax.tree_util.keystr(path)} was not trained")
  chex.assert_trees_all_equal(frozen, bp)


# ----------------------------------------------------------------------------
# Accuracies are measured on the split they name.


@pytest.mark.parametrize("method", ["head", "prompt"])
def test_each_accuracy_is_measured_on_the_split_it_names(method):
  """Splits built to be told apart by their accuracy. The task (``x_1``
  in the upper half, read off ``G`` at the ``MASK``) is learnt perfectly,
  so a split's accuracy is the share of its labels that are true: train
  1.0 (all true, every ``x_1`` value seen), val 0.0 (all flipped), test
  0.75 (a quarter of 32 flipped). Sizes differ too (64 / 16 / 32)."""
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  train = _tokens(keys[0], 64, 6, first=jnp.arange(64) % V)
  val, test = _tokens(keys[1], 16, 6), _tokens(keys[2], 32, 6)
  flip_test = (jnp.arange(32) < 8).astype(jnp.int32)
  data = tuning.Data(train, _high(train, 1), val, 1 - _high(val, 1),
                     test, _high(test, 1) ^ flip_test)
  cfg = tuning.TuneConfig(method=method, features="raw", lr=0.1,
                          epochs=10, batch_size=16, prompt_len=2,
                          eval_chunk=16)
  res, _ = tuning.tune(jax.random.PRNGKey(0), NEXT_TOKEN, NO_PARAMS, data,
                       cfg)
  assert (float(res.train_accuracy), float(res.val_accuracy),
          float(res.test_accuracy)) == (1.0, 0.0, 0.75)


# ----------------------------------------------------------------------------
# The attention head attends (Section 4).


def _attention_weights(params, feats_TxV):
  """Eq. 4.1's weights, written out here (independent of heads.py):
  ``softmax_i(exp(log_temp) q^T (Θ_K f(G_i) + β_i))``."""
  p = jax.tree.map(np.asarray, params)
  scores_T = (feats_TxV @ p["theta_k"].T + p["beta"][:len(feats_TxV)]) @ p["q"]
  z = np.exp(p["log_temp"]) * scores_T
  w = np.exp(z - z.max())
  return w / w.sum()


def test_attention_head_attends_to_the_one_position_that_holds_the_label():
  """A construction in the spirit of Theorem 4.3: ``G`` is uniform (it
  says nothing), the label is the class of the token at position 5, which
  only that position's value ``b^T((Θ_V f(G_5)) ⊙ e(x_5))`` can show. The
  attention head must put its weight on position 5 and reach the accuracy
  the construction allows (all of it); a linear head at the ``MASK``
  sees nothing and stays at chance."""
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  pos = 5
  splits = [_tokens(k, n, 8) for k, n in zip(keys, (256, 32, 128))]
  data = tuning.Data(*[a for t in splits for a in (t, _high(t, pos))])
  cfg = tuning.TuneConfig(head="attention", features="raw", lr=0.05,
                          epochs=10, batch_size=32, eval_chunk=32)
  res, tunable = tuning.tune(jax.random.PRNGKey(0), UNIFORM, NO_PARAMS,
                             data, cfg)
  assert float(res.test_accuracy) >= 0.95, res
  weights_T = _attention_weights(tunable["head"], np.full((9, V), 1.0 / V))
  assert weights_T[pos] >= 0.9, np.round(weights_T, 3)
  linear, _ = tuning.tune(jax.random.PRNGKey(0), UNIFORM, NO_PARAMS, data,
                          dataclasses.replace(cfg, head="linear"))
  majority = max(float(data.test_labels.mean()),
                 1 - float(data.test_labels.mean()))
  assert float(linear.test_accuracy) <= majority + 1e-6


# ----------------------------------------------------------------------------
# Both findings, small, on the exact backbone (slow tier).

_SCIENCE_TASK = tasks.TaskConfig(num_train=1024, num_val=32, num_test=256,
                                 seq_len=24)
_SCIENCE_TUNE = tuning.TuneConfig(epochs=5, prompt_len=4, batch_size=32,
                                  eval_chunk=64)
_DRAWS = 8


def _accuracies(kind, num_states, memory_size, cfg):
  """Test accuracy (%) of ``cfg`` on ``_DRAWS`` HMM draws, one task each,
  in one vmapped program."""
  draws = generative.random_models(
      jax.random.PRNGKey(100 + num_states + memory_size), _DRAWS, kind,
      num_states, 10, memory_size)
  bb, _ = exact.make(generative.trial(draws, 0))
  task_k = tasks.make_tasks(jax.random.split(jax.random.PRNGKey(7), _DRAWS),
                            draws, _SCIENCE_TASK)
  res, _ = tuning.tune_trials(
      [[jax.random.PRNGKey(k)] for k in range(_DRAWS)], bb,
      jax.vmap(generative.as_hmm)(draws),
      [[tuning.data_from_task(t, cfg)] for t in task_k], cfg)
  return 100 * res.test_accuracy[:, 0]


@pytest.mark.slow
def test_both_findings_on_the_exact_backbone():
  """Figure 3's two findings, paired per HMM draw (8 draws, raw features).

  Left: |H| = 20 > |X| = 10, prompt tuning beats head tuning. Measured
  (2026-11-23) per draw: +7.4, 0, +6.2, 0, 0, +17.2, +1.2, +4.3 points:
  never worse, mean +4.5 (standard error 2.0). Right: memory HMM (|M| = 5,
  |H| = 4) with the attention head beats its vanilla twin (|H| = 20) with
  a linear head: +29.7, +27.0, +17.6, +23.8, +9.8, +12.5, +10.2, +2.7,
  mean +16.7 (standard error 3.3). The seeds are fixed, so these numbers
  reproduce; the bounds are about half the measured means (a broken prompt
  or attention gives a gain near 0) and one flipped test example (0.4
  points) of slack per draw for float differences between jax versions.
  """
  head = _accuracies("vanilla", 20, 0, _SCIENCE_TUNE)
  prompt = _accuracies("vanilla", 20, 0,
                       dataclasses.replace(_SCIENCE_TUNE, method="prompt"))
  gain = prompt - head
  assert gain.mean() >= 2.0 and gain.min() >= -1.0, np.round(gain, 1)
  memory = _accuracies("memory", 4, 5, dataclasses.replace(
      _SCIENCE_TUNE, head="attention"))
  gain = memory - head  # head: the vanilla twins, |H| = 4 * 5
  assert gain.mean() >= 8.0 and gain.min() >= -1.0, np.round(gain, 1)


# ----------------------------------------------------------------------------
# Theorem 4.6's arm: prompt tuning with the attention head on a memory HMM.


@pytest.mark.slow
def test_prompt_tuning_with_the_attention_head_on_a_memory_hmm():
  """The right panel's extra arm (``Setup.prompt_attention``): on a memory
  HMM's exact backbone (|M| = 2, |H| = 4), prompt tuning trains exactly a
  soft prompt and an attention head (the backbone's params untouched, the
  prompt moved) and learns the task far above chance."""
  model = generative.random_model(jax.random.PRNGKey(5), "memory", 4, 10, 2)
  bb, bp = exact.make(model)
  task = tasks.make_task(jax.random.PRNGKey(0), model, tasks.TaskConfig(
      num_train=256, num_val=32, num_test=128, seq_len=12))
  cfg = tuning.TuneConfig(method="prompt", head="attention", features="log",
                          epochs=3, prompt_len=2, batch_size=32,
                          eval_chunk=64)
  data = tuning.data_from_task(task, cfg)
  key = jax.random.PRNGKey(1)
  init = tuning.init_tunable(jax.random.split(key)[0], bb, bp, cfg,
                             data.train_tokens)
  frozen = jax.tree.map(lambda a: np.array(a, copy=True), bp)
  res, tunable = tuning.tune(key, bb, bp, data, cfg)
  assert set(tunable) == {"prompt", "head"}
  assert tunable["prompt"].shape == (2, bb.embed_dim) == (2, 8)
  assert set(tunable["head"]) == set(init["head"]) >= {"theta_k", "q",
                                                       "theta_v", "b"}
  assert np.max(np.abs(tunable["prompt"] - init["prompt"])) > 1e-3
  chex.assert_trees_all_equal(frozen, bp)
  majority = max(float(data.test_labels.mean()),
                 1 - float(data.test_labels.mean()))
  assert majority < 0.6  # chance is about a half
  assert float(res.test_accuracy) >= 0.9, res
