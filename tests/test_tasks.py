import dataclasses

import chex
import jax
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import generative
from hmmprompt import tasks
from hmmprompt.hmm import MASK
import reference as ref

SMALL = tasks.TaskConfig(num_train=40, num_val=8, num_test=16, seq_len=12)


@pytest.fixture(scope="module")
def vanilla():
  return hmm_lib.random_hmm(jax.random.PRNGKey(11), 8, 10)


@pytest.fixture(scope="module")
def mem():
  return memory_lib.random_memory_hmm(jax.random.PRNGKey(12), 3, 4, 10)


def _check_labels(split, mu, latent_fn):
  """Recompute every label by an independent float64 route."""
  mu = np.asarray(mu, np.float64)
  checked = 0
  for toks, label in zip(np.asarray(split.tokens), np.asarray(split.labels)):
    scores = mu @ latent_fn(toks)
    top2 = np.sort(scores)[-2:]
    if top2[1] - top2[0] > 1e-4:  # float32 can't decide nearer ties
      assert label == int(np.argmax(scores))
      checked += 1
  assert checked >= 0.9 * len(split.labels)


def test_vanilla_labels_recomputed_independently(vanilla):
  task = tasks.make_task(jax.random.PRNGKey(0), vanilla, SMALL)
  assert task.train.tokens.shape == (40, 13)
  assert np.all(np.asarray(task.train.tokens)[:, 0] == MASK)

  def latent(toks):  # P[H_0 | x_{1:T}]
    ev = ref.evidence_from_tokens(vanilla.emission, toks)
    return ref.log_forward_backward(vanilla.initial, vanilla.transition,
                                    ev)[1][0]

  for split in (task.train, task.val, task.test):
    _check_labels(split, task.mu, latent)


def test_memory_labels_recomputed_independently(mem):
  task = tasks.make_task(jax.random.PRNGKey(1), mem, SMALL)
  assert task.mu.shape == (2, 3)
  product = memory_lib.to_hmm(mem)

  def latent(toks):  # P[M | x] from the product chain in float64
    ev = ref.evidence_from_tokens(product.emission, toks)
    post = ref.log_forward_backward(product.initial, product.transition,
                                    ev)[1]
    return post[0].reshape(3, 4).sum(-1)

  _check_labels(task.test, task.mu, latent)


def test_authors_labeling(vanilla):
  cfg = dataclasses.replace(SMALL, labeling="authors")
  task = tasks.make_task(jax.random.PRNGKey(2), vanilla, cfg)
  assert task.test.tokens.shape == (16, 13)
  trans = np.asarray(vanilla.transition, np.float64)

  def latent(toks):  # transmat @ P[H_1 | x_{1:T}], H_1 the first real token
    ev = ref.evidence_from_tokens(vanilla.emission, toks[1:])
    return trans @ ref.log_forward_backward(vanilla.initial, trans, ev)[1][0]

  _check_labels(task.test, task.mu, latent)


def test_task_weights():
  mu = tasks.task_weights(jax.random.PRNGKey(0), 30)
  assert mu.shape == (2, 30) and int((mu != 0).sum()) == 6
  small = tasks.task_weights(jax.random.PRNGKey(0), 2)
  assert int((small != 0).sum()) == 4  # only 4 entries exist


def test_deterministic_and_key_dependent(vanilla):
  a = tasks.make_task(jax.random.PRNGKey(5), vanilla, SMALL)
  b = tasks.make_task(jax.random.PRNGKey(5), vanilla, SMALL)
  c = tasks.make_task(jax.random.PRNGKey(6), vanilla, SMALL)
  np.testing.assert_array_equal(a.train.tokens, b.train.tokens)
  np.testing.assert_array_equal(a.mu, b.mu)
  assert not np.array_equal(a.train.tokens, c.train.tokens)


def test_degenerate_draws_are_redrawn(vanilla):
  key = jax.random.PRNGKey(9)
  first = tasks.make_task(key, vanilla, SMALL)
  share = tasks.majority_share(np.concatenate(
      [first.train.labels, first.val.labels, first.test.labels]))
  assert first.redraws == 0
  # Call the first draw degenerate: the task must come from a later key.
  strict = dataclasses.replace(SMALL, max_label_share=share - 1e-6)
  task = tasks.make_task(key, vanilla, strict)
  assert task.redraws >= 1
  direct = tasks.draw_task(jax.random.fold_in(key, task.redraws), vanilla,
                            strict)
  np.testing.assert_array_equal(task.test.tokens, direct[1][2].tokens)
  labels = np.concatenate([task.train.labels, task.val.labels,
                           task.test.labels])
  assert tasks.majority_share(labels) <= strict.max_label_share
  impossible = dataclasses.replace(SMALL, max_label_share=0.5, max_redraws=2)
  with pytest.raises(ValueError, match="every one of 3 drawn tasks"):
    tasks.make_task(key, vanilla, impossible)


@pytest.mark.slow
def test_make_tasks_for_stacked_models_equal_make_task_per_trial():
  """Trials: one vmapped draw per attempt gives every trial the task that
  make_task gives it alone, redraws included."""
  stacked = generative.random_models(jax.random.PRNGKey(4), 3, "vanilla", 5, 10)
  keys = jax.random.split(jax.random.PRNGKey(9), 3)
  # Strict enough that some trial's first draw is degenerate.
  cfg = dataclasses.replace(SMALL, max_label_share=0.75)
  got = tasks.make_tasks(keys, stacked, cfg)
  alone = [tasks.make_task(keys[k], generative.trial(stacked, k), cfg)
           for k in range(3)]
  assert [t.redraws for t in got] == [t.redraws for t in alone]
  assert max(t.redraws for t in got) >= 1
  for a, b in zip(got, alone):
    np.testing.assert_array_equal(a.train.tokens, b.train.tokens)
    np.testing.assert_array_equal(a.test.labels, b.test.labels)
    np.testing.assert_allclose(a.test.latent, b.test.latent, atol=1e-6)
    np.testing.assert_array_equal(a.mu, b.mu)
  with pytest.raises(ValueError, match="2 keys for 3 trials"):
    tasks.make_tasks(keys[:2], stacked, cfg)
  with pytest.raises(ValueError, match="trial .: every one of 2"):
    tasks.make_tasks(keys, stacked, dataclasses.replace(
        SMALL, max_label_share=0.5, max_redraws=1))


@pytest.mark.slow
def test_the_bytes_budget_chunks_the_posteriors_and_changes_no_label():
  """A budget of a few examples' smoothing (chunks of 3 of 32 or 128
  examples, a remainder included) draws the tasks of no budget: tokens and
  labels equal, posteriors to float rounding."""
  stacked = generative.random_models(jax.random.PRNGKey(4), 2, "vanilla", 5, 10)
  keys = jax.random.split(jax.random.PRNGKey(9), 2)
  per_example = 5 * 4 * (SMALL.seq_len + 1) * 5
  budget = 3 * 2 * per_example
  assert tasks.latent_chunk(stacked, SMALL, budget) == 3
  assert tasks.latent_chunk(stacked, SMALL, 1) == 1
  assert tasks.latent_chunk(stacked, SMALL, None) is None
  whole = tasks.make_tasks(keys, stacked, SMALL, budget_bytes=None)
  chunked = tasks.make_tasks(keys, stacked, SMALL, budget_bytes=budget)
  for a, b in zip(whole, chunked):
    for split in ("train", "val", "test"):
      np.testing.assert_array_equal(getattr(a, split).tokens,
                                    getattr(b, split).tokens)
      np.testing.assert_array_equal(getattr(a, split).labels,
                                    getattr(b, split).labels)
      np.testing.assert_allclose(getattr(a, split).latent,
                                 getattr(b, split).latent, atol=1e-6)


@pytest.mark.parametrize("labeling", ["paper", "authors"])
def test_make_task_is_make_tasks_of_one(vanilla, labeling):
  """One task is the stack of one: bit for bit, redraws included."""
  cfg = dataclasses.replace(SMALL, labeling=labeling, max_label_share=0.75)
  key = jax.random.PRNGKey(9)
  alone = tasks.make_task(key, vanilla, cfg)
  (stacked,) = tasks.make_tasks(key[None], generative.stack([vanilla]), cfg)
  chex.assert_trees_all_equal(alone, stacked)
  # One trial needs no trial index in the error; a stack is refused.
  with pytest.raises(ValueError, match="^every one of 2 drawn tasks"):
    tasks.make_task(key, vanilla, dataclasses.replace(
        SMALL, max_label_share=0.5, max_redraws=1))
  with pytest.raises(ValueError, match="takes single models, not stacks"):
    tasks.make_task(key, generative.stack([vanilla, vanilla]), cfg)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_train=0), "num_train must be >= 1"),
    (dict(labeling="bert"), "labeling must be 'paper' or 'authors'"),
    (dict(max_label_share=0.3), "max_label_share"),
    (dict(num_classes=1), "num_classes"),
])
def test_bad_config_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tasks.TaskConfig(**kwargs)


def test_bad_model_raises():
  with pytest.raises(TypeError, match="HMM or a MemoryHMM"):
    tasks.make_task(jax.random.PRNGKey(0), "hmm", SMALL)


@pytest.mark.parametrize("field", ["num_train", "num_val", "num_test",
                                   "seq_len", "num_nonzero"])
def test_every_task_size_must_be_positive(field):
  with pytest.raises(ValueError, match=f"TaskConfig.{field} must be >= 1"):
    tasks.TaskConfig(**{field: 0})


def test_task_config_bounds_are_inclusive():
  """A label share of 0.5 or 1.0 and zero re-draws are valid; just past
  them is not, named."""
  for share in (0.5, 1.0):
    assert tasks.TaskConfig(max_label_share=share).max_label_share == share
  assert tasks.TaskConfig(max_redraws=0).max_redraws == 0
  for share in (0.49, 1.01):
    with pytest.raises(ValueError,
                       match=r"max_label_share must be in \[0.5, 1\]"):
      tasks.TaskConfig(max_label_share=share)
  with pytest.raises(ValueError,
                     match="^TaskConfig.max_redraws must be >= 0$"):
    tasks.TaskConfig(max_redraws=-1)


def test_authors_latent_is_the_transition_times_the_first_real_posterior(
    vanilla, mem):
  """The original code's label reads ``transmat @ P[H_1 | x_{1:T}]`` (a
  vanilla HMM; paper README), computed here through the validating entry
  point; it is not the paper's latent. A memory HMM reads the memory either
  way. An unknown labeling is named."""
  tokens_T = np.asarray([MASK, 1, 2, 3, 4], np.int32)
  want = np.asarray(vanilla.transition) @ np.asarray(
      hmm_lib.posterior(vanilla, tokens_T[1:]))[0]
  got = tasks.label_posterior(vanilla, tokens_T, "authors")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  paper = tasks.label_posterior(vanilla, tokens_T)
  np.testing.assert_array_equal(
      paper, tasks.label_posterior(vanilla, tokens_T, "paper"))
  assert np.max(np.abs(np.asarray(paper) - np.asarray(got))) > 1e-3
  np.testing.assert_array_equal(tasks.label_posterior(mem, tokens_T,
                                                       "authors"),
                                tasks.label_posterior(mem, tokens_T))
  key = jax.random.PRNGKey(0)  # the default labeling is the paper's
  np.testing.assert_array_equal(tasks.sample_examples(key, vanilla, 2, 3),
                                tasks.sample_examples(key, vanilla, 2, 3,
                                                      "paper"))
  for fn in (lambda: tasks.label_posterior(vanilla, tokens_T, "Paper"),
             lambda: tasks.sample_examples(jax.random.PRNGKey(0), vanilla,
                                           2, 3, "Authors")):
    with pytest.raises(ValueError, match="labeling must be 'paper' or 'authors'"):
      fn()


def test_majority_share_counts_every_class():
  assert tasks.majority_share(np.asarray([1])) == 1.0
  assert tasks.majority_share(np.asarray([0, 1, 1])) == pytest.approx(2 / 3)
  assert tasks.majority_share(np.asarray([], np.int64)) == 0.0


@pytest.mark.slow
def test_attempts_are_one_plus_max_redraws_and_the_bound_is_inclusive(
    vanilla):
  """A draw whose majority share equals ``max_label_share`` is taken; a
  key whose first good draw is attempt 2 succeeds with ``max_redraws=2``
  and fails with 1 (exactly ``1 + max_redraws`` attempts)."""
  tiny = dataclasses.replace(SMALL, num_train=4, num_val=1, num_test=1)
  first = tasks.make_task(jax.random.PRNGKey(0), vanilla,
                          dataclasses.replace(tiny, max_label_share=1.0,
                                              max_redraws=0))
  share = tasks.majority_share(np.concatenate(
      [first.train.labels, first.val.labels, first.test.labels]))
  at_bound = tasks.make_task(jax.random.PRNGKey(0), vanilla,
                             dataclasses.replace(tiny, max_label_share=share,
                                                 max_redraws=0))
  assert at_bound.redraws == 0
  balanced = dataclasses.replace(tiny, max_label_share=0.5, max_redraws=20)
  key = next(k for k in (jax.random.PRNGKey(s) for s in range(40))
             if tasks.make_task(k, vanilla, balanced).redraws == 2)
  assert tasks.make_task(key, vanilla, dataclasses.replace(
      balanced, max_redraws=2)).redraws == 2
  with pytest.raises(ValueError, match="every one of 2 drawn tasks"):
    tasks.make_task(key, vanilla, dataclasses.replace(balanced,
                                                      max_redraws=1))


def test_make_tasks_arguments_are_named():
  """Two trials (the smallest vmapped stack) equal their draws alone; a
  single model and a wrong key count are named."""
  stacked = generative.random_models(jax.random.PRNGKey(4), 2, "vanilla", 5, 10)
  keys = jax.random.split(jax.random.PRNGKey(9), 2)
  got = tasks.make_tasks(keys, stacked, SMALL)
  for k in range(2):
    alone = tasks.make_task(keys[k], generative.trial(stacked, k), SMALL)
    np.testing.assert_array_equal(got[k].test.labels, alone.test.labels)
    np.testing.assert_array_equal(got[k].mu, alone.mu)
  with pytest.raises(ValueError, match=r"^make_tasks needs \[K\] stacked "
                     r"models; use make_task for one$"):
    tasks.make_tasks(keys, generative.trial(stacked, 0), SMALL)
  with pytest.raises(ValueError, match="^1 keys for 2 trials$"):
    tasks.make_tasks(keys[:1], stacked, SMALL)
