import dataclasses
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import backbones
from hmmprompt import heads
from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import generative
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import exact

SMALL = tasks.TaskConfig(num_train=256, num_val=32, num_test=128, seq_len=24)
FAST = tuning.TuneConfig(batch_size=32, epochs=3, prompt_len=4,
                         eval_chunk=64)


@pytest.fixture(scope="module")
def setup():
  model = hmm_lib.random_hmm(jax.random.PRNGKey(4), 4, 10)
  bb, bp = exact.make(model)
  task_list = [tasks.make_task(jax.random.PRNGKey(s), model, SMALL)
               for s in range(2)]
  return model, bb, bp, task_list


def _sentinel_backbone(bb, flag):
  @jax.custom_vjp
  def sentinel(p):
    return p

  def fwd(p):
    return p, None

  def bwd(_, g):
    flag["backbone_grad_traced"] = True
    return (g,)

  sentinel.defvjp(fwd, bwd)
  return dataclasses.replace(
      bb, name="sentinel",
      apply=lambda p, e: bb.apply(sentinel(p), e),
      apply_at=bb.apply_at and (
          lambda p, e, i: bb.apply_at(sentinel(p), e, i)))


@pytest.mark.slow
def test_backbone_is_frozen(setup):
  model, bb, bp, task_list = setup
  flag = {"backbone_grad_traced": False}
  sbb = _sentinel_backbone(bb, flag)
  before = jax.tree.map(lambda a: np.array(a, copy=True), bp)
  cfg = dataclasses.replace(FAST, method="prompt", epochs=1)
  data = tuning.data_from_task(task_list[0], cfg)
  rec, tunable = tuning.tune(jax.random.PRNGKey(0), sbb, bp, data, cfg)
  assert set(tunable) == {"head", "prompt"}
  assert not flag["backbone_grad_traced"]
  chex.assert_trees_all_equal(before, bp)
  # The sentinel does fire when a gradient w.r.t. the backbone is taken, so
  # the check above can fail.
  jax.grad(lambda p: sbb.apply(p, sbb.embed(p, data.train_tokens[0])).sum())(
      bp)
  assert flag["backbone_grad_traced"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["head", "prompt"])
def test_vmapped_seeds_equal_one_by_one(setup, method):
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, method=method, epochs=1)
  datas = [tuning.data_from_task(t, cfg) for t in task_list]
  keys = [jax.random.PRNGKey(10 + i) for i in range(2)]
  res, stacked = tuning.tune_many(keys, bb, bp, datas, cfg)
  assert res.test_accuracy.shape == (2,)
  for i, (key, data) in enumerate(zip(keys, datas)):
    rec, tunable = tuning.tune(key, bb, bp, data, cfg)
    assert rec.test_accuracy == pytest.approx(res.test_accuracy[i], abs=1e-6)
    chex.assert_trees_all_close(
        tunable, jax.tree.map(lambda x: x[i], stacked), rtol=2e-4, atol=2e-5)


@pytest.mark.slow
def test_lane_groups_with_a_remainder_equal_one_vmap(setup):
  """3 seeds in groups of 2 (a group and a remainder, lax.map) give what
  one vmap over the 3 gives, to float rounding."""
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, epochs=1)
  datas = [tuning.data_from_task(task_list[i % 2], cfg) for i in range(3)]
  keys = [jax.random.PRNGKey(30 + i) for i in range(3)]
  whole, whole_t = tuning.tune_many(keys, bb, bp, datas, cfg)
  grouped, grouped_t = tuning.tune_many(keys, bb, bp, datas, cfg,
                                        lane_group=2)
  np.testing.assert_array_equal(grouped.test_accuracy, whole.test_accuracy)
  np.testing.assert_allclose(grouped.final_loss, whole.final_loss, rtol=1e-5)
  chex.assert_trees_all_close(grouped_t, whole_t, rtol=2e-4, atol=2e-5)
  # Lanes differ (seeds and data), so a group mixing them up would fail.
  assert len({float(x) for x in whole.final_loss}) == 3


def test_head_and_prompt_tuning_learn(setup):
  model, bb, bp, task_list = setup
  for cfg in (dataclasses.replace(FAST, features="log"),
              dataclasses.replace(FAST, method="prompt", features="log")):
    rec, _ = tuning.tune(jax.random.PRNGKey(0), bb, bp,
                         tuning.data_from_task(task_list[0], cfg), cfg)
    assert rec.test_accuracy >= 0.9, (cfg, rec)
    assert rec.steps == 3 * 256 // 32
    assert rec.test_accuracy.shape == rec.final_loss.shape == ()  # one seed
    assert set(rec._fields) >= {"train_accuracy", "val_accuracy",
                                "test_accuracy", "steps", "seconds"}


@pytest.mark.slow
def test_attention_head_on_memory_hmm():
  mhmm = memory_lib.random_memory_hmm(jax.random.PRNGKey(2), 3, 4, 10)
  bb, bp = exact.make(mhmm)
  assert bb.embed_dim == 12
  task = tasks.make_task(jax.random.PRNGKey(0), mhmm, SMALL)
  cfg = dataclasses.replace(FAST, head="attention", features="log",
                            epochs=5)
  rec, tunable = tuning.tune(jax.random.PRNGKey(0), bb, bp,
                             tuning.data_from_task(task, cfg), cfg)
  assert tunable["head"]["beta"].shape[0] == 25
  assert rec.test_accuracy >= 0.85, rec


def test_standardized_features_and_authors_preset(setup):
  model, bb, bp, task_list = setup
  cfg = tuning.TuneConfig.authors(method="prompt", prompt_len=4, epochs=1,
                                  max_len=16, batch_size=64)
  data = tuning.data_from_task(task_list[0], cfg)
  assert data.train_tokens.shape == (256, 12)  # 16 - 4 prompt positions
  assert cfg.warmup_steps == 500 and cfg.lr == 0.01
  std = dataclasses.replace(FAST, features="standardized")
  rec, _ = tuning.tune(jax.random.PRNGKey(0), bb, bp,
                       tuning.data_from_task(task_list[0], std), std)
  assert rec.test_accuracy >= 0.9


@pytest.mark.parametrize("method", ["finetune", "prefix", "lora"])
def test_exact_backbone_refuses_the_transformer_methods(setup, method):
  """Refused by name before any work (no program is traced)."""
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, method=method)
  with pytest.raises(ValueError, match=f"method '{method}' has no meaning "
                     f"on the 'exact' backbone"):
    tuning.tune(jax.random.PRNGKey(0), bb, bp,
                tuning.data_from_task(task_list[0], cfg), cfg)


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="full"), "method must be one of"),
    (dict(backbone_lr=-1.0), "backbone_lr must be > 0"),
    (dict(head="mlp"), "head must be one of"),
    (dict(features="sqrt"), "features must be one of"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(method="prompt", prompt_len=20, max_len=10), "leaves no room"),
    (dict(batch_size=0), "batch_size must be >= 1"),
])
def test_bad_tune_config_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tuning.TuneConfig(**kwargs)


# A mean-over-positions linear head, defined here: a new head is one object
# and one registry entry, with no edit to hmmprompt/tuning/.
MEAN_LINEAR = heads.Head(
    "mean_linear",
    init=lambda key, vocab_size, embed_dim, input_len: heads.init_linear(
        key, vocab_size),
    apply=lambda params, feats_TxV, emb_TxD: heads.apply_linear(
        params, feats_TxV.mean(0)),
    reads_all_positions=True)


def _tiny(data: tuning.Data) -> tuning.Data:
  """64 / 16 / 32 examples of 8 tokens after the MASK: compiles fast."""
  return tuning.Data(*(a[:n, :9] if i % 2 == 0 else a[:n] for i, (a, n) in
                       enumerate(zip(data, (64, 64, 16, 16, 32, 32)))))


def test_new_head_trains_through_registry(setup, monkeypatch):
  model, bb, bp, task_list = setup
  monkeypatch.setitem(heads.HEADS, "mean_linear", MEAN_LINEAR)
  cfg = dataclasses.replace(FAST, head="mean_linear", features="standardized",
                            epochs=1)
  rec, tunable = tuning.tune(jax.random.PRNGKey(0), bb, bp,
                             _tiny(tuning.data_from_task(task_list[0], cfg)),
                             cfg)
  assert set(tunable) == {"head"}
  assert tunable["head"]["w"].shape == (bb.vocab_size, 2)
  assert np.abs(np.asarray(tunable["head"]["w"])).max() > 0  # it trained
  assert np.isfinite(rec.final_loss) and 0 <= rec.test_accuracy <= 1


def test_a_head_must_return_one_examples_logits(setup, monkeypatch):
  """A head that forgets to pool (logits [T, C], not [C]) is refused when
  the loop is traced: accuracy would argmax over the flattened array."""
  model, bb, bp, task_list = setup
  unpooled = dataclasses.replace(
      MEAN_LINEAR, name="unpooled",
      apply=lambda params, feats_TxV, emb_TxD: heads.apply_linear(
          params, feats_TxV))
  monkeypatch.setitem(heads.HEADS, "unpooled", unpooled)
  cfg = dataclasses.replace(FAST, head="unpooled", epochs=1)
  data = _tiny(tuning.data_from_task(task_list[0], cfg))
  with pytest.raises(AssertionError,
                     match=r"assert_shape failed.*shape \(9, 2\)"):
    tuning.tune(jax.random.PRNGKey(0), bb, bp, data, cfg)


def test_new_method_through_registry(setup, monkeypatch):
  # Head tuning without the feature cache: the same training, recomputing
  # the frozen backbone at every step. Caching is only a shortcut. (The
  # "head" run is test_vmapped_seeds_equal_one_by_one's: compiled once.)
  model, bb, bp, task_list = setup
  uncached = dataclasses.replace(tuning.METHODS["head"], name="uncached",
                                 caches_features=False)
  monkeypatch.setitem(tuning.METHODS, "uncached", uncached)
  runs = {}
  for method in ("head", "uncached"):
    cfg = dataclasses.replace(FAST, method=method, epochs=1)
    data = tuning.data_from_task(task_list[0], cfg)
    runs[method] = tuning.tune(jax.random.PRNGKey(10), bb, bp, data, cfg)
  (rec_h, tun_h), (rec_u, tun_u) = runs["head"], runs["uncached"]
  assert set(tun_u) == {"head"}
  chex.assert_trees_all_close(tun_h, tun_u, rtol=1e-4, atol=1e-5)
  assert rec_u.test_accuracy == pytest.approx(rec_h.test_accuracy,
                                              abs=1 / 128)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["head", "prompt"])
def test_vmapped_trials_equal_one_by_one(method):
  """Trials x tasks: 2 HMMs (exact backbone params), 2 tasks on each, tuned
  in one vmapped program, give what each gets alone."""
  stacked_models = generative.random_models(jax.random.PRNGKey(8), 2, "vanilla",
                                        4, 10)
  cfg = dataclasses.replace(FAST, method=method, epochs=1)
  singles = [generative.trial(stacked_models, k) for k in range(2)]
  datas = [[tuning.data_from_task(tasks.make_task(
      jax.random.PRNGKey(10 * k + s), m, SMALL), cfg) for s in range(2)]
           for k, m in enumerate(singles)]
  keys = [[jax.random.PRNGKey(20 + 2 * k + s) for s in range(2)]
          for k in range(2)]
  bb, _ = exact.make(singles[0])
  bparams_k = jax.vmap(generative.as_hmm)(stacked_models)
  res, stacked = tuning.tune_trials(keys, bb, bparams_k, datas, cfg)
  assert res.test_accuracy.shape == (2, 2)
  for k, model in enumerate(singles):
    _, bp = exact.make(model)
    for s in range(2):
      rec, tunable = tuning.tune(keys[k][s], bb, bp, datas[k][s], cfg)
      assert rec.test_accuracy == pytest.approx(res.test_accuracy[k, s],
                                                abs=1e-6)
      chex.assert_trees_all_close(
          tunable, jax.tree.map(lambda x: x[k, s], stacked), rtol=2e-4,
          atol=2e-5)
  # One trial at a time (lax.map over the trials, the CPU default) is the
  # same program per lane.
  grouped, grouped_tunable = tuning.tune_trials(keys, bb, bparams_k, datas,
                                                cfg, lane_group=1)
  np.testing.assert_array_equal(grouped.test_accuracy, res.test_accuracy)
  chex.assert_trees_all_close(grouped_tunable, stacked, rtol=2e-4,
                              atol=2e-5)
  with pytest.raises(ValueError, match="params for 2 trials, 1 trials"):
    tuning.tune_trials(keys[:1], bb, bparams_k, datas[:1], cfg)
  with pytest.raises(ValueError, match="same number"):
    tuning.tune_trials(keys, bb, bparams_k, [datas[0], datas[1][:1]], cfg)
  # The driver itself: every argument's leading axes are the lanes [K, S].
  keys_KxS = np.stack([np.stack(kk) for kk in keys])
  data_KxS = tuning.stack_data([tuning.stack_data(d) for d in datas])
  one_trial = jax.tree.map(lambda x: x[:1], bparams_k)
  for bad_keys, bad_params, axes in ((keys_KxS[0], bparams_k, 1),
                                     (keys_KxS, one_trial, 1),
                                     (keys_KxS, bparams_k, 3)):
    with pytest.raises(ValueError, match="lanes"):
      tuning.tune(bad_keys, bb, bad_params, data_KxS, cfg, param_axes=axes)


def test_labels_outside_the_heads_classes_are_refused(setup):
  """The heads give ``heads.NUM_CLASSES`` logits; a task with more classes
  is refused by name at the boundary (it would train on out-of-range
  labels silently)."""
  model, bb, bp, _ = setup
  task = tasks.make_task(jax.random.PRNGKey(0), model, dataclasses.replace(
      SMALL, num_classes=3, num_nonzero=12))
  assert int(np.max(task.train.labels)) == 2
  with pytest.raises(ValueError, match=r"labels must be in \[0, 2\)"):
    tuning.tune(jax.random.PRNGKey(0), bb, bp,
                tuning.data_from_task(task, FAST), FAST)


@pytest.mark.parametrize("field", ["prompt_len", "epochs", "batch_size",
                                   "eval_chunk"])
def test_every_count_must_be_positive(field):
  with pytest.raises(ValueError, match=f"TuneConfig.{field} must be >= 1"):
    tuning.TuneConfig(**{field: 0})


def test_tune_config_bounds():
  """``warmup_frac`` is in [0, 1) (0: no warmup); ``max_len`` may leave
  exactly the prompt and the ``MASK``, not one position less."""
  for frac in (0.0, 0.999):
    assert tuning.TuneConfig(warmup_frac=frac).warmup_frac == frac
  for frac in (1.0, -0.1):
    with pytest.raises(ValueError,
                       match=r"^TuneConfig.warmup_frac must be in \[0, 1\)$"):
      tuning.TuneConfig(warmup_frac=frac)
  room = tasks.input_len(4, 0)  # 4 prompt vectors and the MASK
  assert tuning.TuneConfig(method="prompt", prompt_len=4,
                           max_len=room).max_len == room
  with pytest.raises(ValueError, match="leaves no room"):
    tuning.TuneConfig(method="prompt", prompt_len=4, max_len=room - 1)


def test_authors_preset_is_the_original_scripts():
  """The authors' fine-tuning scripts (paper README, "Fine-tuning in the
  original scripts"): lr 0.01, 500 warmup steps, batch 128, 100 epochs,
  inputs cut to 80 positions; overrides win."""
  cfg = tuning.TuneConfig.authors()
  assert (cfg.lr, cfg.warmup_steps, cfg.batch_size, cfg.epochs,
          cfg.max_len) == (0.01, 500, 128, 100, 80)
  assert tuning.TuneConfig.authors(epochs=3).epochs == 3


def test_num_steps_counts_whole_batches_and_at_least_one():
  cfg = tuning.TuneConfig(batch_size=32, epochs=2)
  assert tuning.num_steps(100, cfg) == 6 and isinstance(
      tuning.num_steps(100, cfg), int)
  assert tuning.num_steps(10, cfg) == 2  # a split smaller than a batch


def test_prompt_starts_uniform_in_plus_minus_prompt_init(setup):
  """The soft prompt starts Uniform[-0.5, 0.5] (the authors' init), so it
  is symmetric about 0 and spans the interval."""
  model, bb, bp, _ = setup
  cfg = tuning.TuneConfig(method="prompt", prompt_len=200)
  prompt = np.asarray(tuning.init_tunable(
      jax.random.PRNGKey(0), bb, bp, cfg, np.zeros((4, 9), int))["prompt"])
  assert prompt.shape == (200, bb.embed_dim)
  assert -0.5 <= prompt.min() < -0.45 and 0.45 < prompt.max() <= 0.5
  assert abs(prompt.mean()) < 0.05


def test_tuning_lr_warms_up_to_lr_and_decays_to_zero():
  """Warmup over ``warmup_frac`` of the steps (or ``warmup_steps``, at most
  ``total - 1``), the peak at ``lr``, linear decay to 0 at ``total``; no
  warmup starts at the peak."""
  cfg = tuning.TuneConfig(lr=0.02, warmup_frac=0.1)
  sched = tuning.tuning_lr(100, cfg)
  np.testing.assert_allclose([sched(0), sched(5), sched(10), sched(55),
                              sched(100)], [0, 0.01, 0.02, 0.01, 0],
                             atol=1e-9)
  sched = tuning.tuning_lr(100, dataclasses.replace(cfg, warmup_steps=20))
  np.testing.assert_allclose([sched(10), sched(20), sched(60), sched(100)],
                             [0.01, 0.02, 0.01, 0], atol=1e-9)
  sched = tuning.tuning_lr(10, dataclasses.replace(cfg, warmup_steps=50))
  np.testing.assert_allclose([sched(9), sched(10)], [0.02, 0], atol=1e-9)
  sched = tuning.tuning_lr(10, dataclasses.replace(cfg, warmup_steps=1))
  np.testing.assert_allclose([sched(0), sched(1)], [0, 0.02], atol=1e-9)
  sched = tuning.tuning_lr(50, dataclasses.replace(cfg, warmup_frac=0.0))
  np.testing.assert_allclose([sched(0), sched(25), sched(50)],
                             [0.02, 0.01, 0], atol=1e-9)


def test_finetuning_moves_the_backbone_at_its_own_rate():
  """Adam's first step moves every coordinate by its learning rate: the
  head by ``lr``, a fine-tuned backbone by ``backbone_lr`` (a pretrained
  transformer is wrecked at the head's rate)."""
  cfg = tuning.TuneConfig(method="finetune", lr=0.01, backbone_lr=1e-4,
                          warmup_steps=0)
  params = {"head": np.zeros(3), "backbone": {"w": np.zeros(2)}}
  opt = tuning.tuning_optimizer(100, cfg)
  grads = jax.tree.map(np.ones_like, params)
  updates, _ = opt.update(grads, opt.init(params), params)
  np.testing.assert_allclose(updates["head"], -0.01, rtol=1e-4)
  np.testing.assert_allclose(updates["backbone"]["w"], -1e-4, rtol=1e-4)
  head_only = tuning.tuning_optimizer(100, dataclasses.replace(cfg,
                                                            method="head"))
  updates, _ = head_only.update({"head": grads["head"]},
                                head_only.init({"head": params["head"]}))
  np.testing.assert_allclose(updates["head"], -0.01, rtol=1e-4)


@pytest.mark.parametrize("num_train", [16, 64])
def test_run_takes_num_steps_steps(setup, num_train):
  """One loss per optimizer step, ``num_steps`` of them: whole batches
  per epoch, and one step of the whole split when it is smaller than a
  batch."""
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, epochs=2)
  data = _tiny(tuning.data_from_task(task_list[0], cfg))
  data = data._replace(train_tokens=data.train_tokens[:num_train],
                       train_labels=data.train_labels[:num_train])
  _, losses, accs = jax.jit(tuning.run_seed, static_argnums=(3, 4))(
      jax.random.PRNGKey(0), bp, data, bb, cfg)
  assert losses.shape == (tuning.num_steps(num_train, cfg),)
  assert tuning.num_steps(num_train, cfg) == (2 if num_train < 32 else 4)
  assert set(accs) == set(tuning.SPLITS)


def test_lane_drivers_name_what_disagrees(setup):
  """``tune_many`` and ``tune_trials`` name a key count that is not the
  dataset count, and a trial without tasks; one task per trial is fine."""
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, epochs=1)
  data = _tiny(tuning.data_from_task(task_list[0], cfg))
  with pytest.raises(ValueError, match="^2 keys for 1 datasets$"):
    tuning.tune_many([jax.random.PRNGKey(0)] * 2, bb, bp, [data], cfg)
  bparams_k = jax.tree.map(lambda x: np.stack([x, x]), bp)
  keys = [[jax.random.PRNGKey(0)], [jax.random.PRNGKey(1)]]
  with pytest.raises(ValueError, match="params for 2 trials, 2 trials of "
                     "datasets and 1 of keys"):
    tuning.tune_trials(keys[:1], bb, bparams_k, [[data], [data]], cfg)
  with pytest.raises(ValueError, match="same number"):
    tuning.tune_trials([[], []], bb, bparams_k, [[], []], cfg)
  res, _ = tuning.tune_trials(keys, bb, bparams_k, [[data], [data]], cfg)
  assert res.test_accuracy.shape == (2, 1)
  short = data._replace(val_labels=data.val_labels[:-1])  # one split off
  with pytest.raises(ValueError, match="disagree"):
    tuning.tune(jax.random.PRNGKey(0), bb, bp, short, cfg)


# ----------------------------------------------------------------------------
# The head's optimum (TuneConfig.optimizer = "lbfgs").

_V = 8  # vocabulary of the faint backbone


def _faint_embed(params, tokens_T):
  del params
  onehot_TxV = jax.nn.one_hot(tokens_T, _V)
  return jnp.where((tokens_T == hmm_lib.MASK)[:, None], 1.0, onehot_TxV)


def _faint_apply(params, emb_TxD):
  """``G_t``: 95% uniform, 5% the next token, so ``G`` at the ``MASK``
  separates every labelling of ``x_1`` (one-hot plus a constant), by a
  margin too small for a few Adam steps at the paper's rate."""
  del params
  nxt_TxD = jnp.roll(emb_TxD, -1, axis=0) * 0.05 + 0.95 / _V
  return nxt_TxD / nxt_TxD.sum(-1, keepdims=True)


FAINT = backbones.Backbone(name="faint", embed=_faint_embed,
                           apply=_faint_apply,
                           prompt_embedding=lambda raw: raw, embed_dim=_V,
                           vocab_size=_V)


def _faint_data() -> tuning.Data:
  """64 / 16 / 32 examples of ``MASK`` and 4 tokens; label 1 where ``x_1``
  is in {1, 2, 5, 6} (every ``x_1`` value is in the training split)."""
  def split(key, n):
    x_NxL = jax.random.randint(key, (n, 4), 0, _V).at[:, 0].set(
        jnp.arange(n) % _V)
    tokens_NxT = jnp.concatenate([jnp.full((n, 1), hmm_lib.MASK), x_NxL], 1)
    return tokens_NxT, jnp.isin(x_NxL[:, 0], jnp.array([1, 2, 5, 6])
                                ).astype(jnp.int32)
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  return tuning.Data(*(a for k, n in zip(keys, (64, 16, 32))
                       for a in split(k, n)))


@pytest.mark.slow
def test_the_head_optimum_separates_what_the_papers_recipe_does_not():
  """Separable features with a faint signal: the paper's recipe (5 epochs
  of Adam at lr 0.01, batch 32: 10 steps on 64 examples) stays far from
  100% train accuracy; L-BFGS reaches it, stopping on its tolerance."""
  data = _faint_data()
  adam = tuning.TuneConfig(features="raw", eval_chunk=16)
  res, _ = tuning.tune(jax.random.PRNGKey(0), FAINT, jnp.zeros(()), data,
                       adam)
  assert float(res.train_accuracy) < 0.8, res
  assert res.steps == int(res.lane_steps) == tuning.num_steps(64, adam) == 10
  lbfgs = dataclasses.replace(adam, optimizer="lbfgs")
  res, tunable = tuning.tune(jax.random.PRNGKey(0), FAINT, jnp.zeros(()),
                             data, lbfgs)
  assert float(res.train_accuracy) == 1.0, res
  assert float(res.test_accuracy) == 1.0, res
  assert set(tunable) == {"head"}
  # It stopped on the gradient norm, not the step limit.
  assert 0 < res.steps == int(res.lane_steps) < lbfgs.lbfgs_max_steps


class _Optimum(NamedTuple):
  value: float  # the objective at the optimum
  x_NxF: np.ndarray  # features with a column of ones (the offset c)
  u_F: np.ndarray  # (u, c) at the optimum
  hess_FxF: np.ndarray  # the objective's Hessian in (u, c) there


def _newton_optimum(feats_NxV: np.ndarray, labels_N: np.ndarray,
                    l2: float) -> _Optimum:
  """The optimum of the L-BFGS objective by Newton's method in float64,
  through another parametrisation: two-class softmax regression with
  ``(w, bias)`` is binary logistic regression on ``z = f u + c`` (``u =
  w_1 - w_0``, ``c = bias_1 - bias_0``), and ``l2 / 2 |w|^2`` at its
  minimum over the ``w`` with a given ``u`` is ``l2 / 4 |u|^2``."""
  x_NxF = np.concatenate([feats_NxV, np.ones((len(feats_NxV), 1))], 1)
  y_N = labels_N.astype(np.float64)
  reg_F = np.r_[np.full(feats_NxV.shape[1], l2 / 2), 0.0]
  u_F = np.zeros(x_NxF.shape[1])
  for _ in range(100):
    p_N = 1 / (1 + np.exp(-(x_NxF @ u_F)))
    grad_F = x_NxF.T @ (p_N - y_N) / len(y_N) + reg_F * u_F
    hess_FxF = ((x_NxF * (p_N * (1 - p_N))[:, None]).T @ x_NxF / len(y_N)
                + np.diag(reg_F))
    u_F -= np.linalg.solve(hess_FxF, grad_F)
  assert np.linalg.norm(grad_F) < 1e-12
  return _Optimum(_head_objective(x_NxF @ u_F, labels_N, l2, u_F[:-1] / 2,
                                  -u_F[:-1] / 2), x_NxF, u_F, hess_FxF)


def _head_objective(z_N, labels_N, l2, *w) -> float:
  """The L-BFGS objective in float64 from the logit differences ``z`` and
  the head's penalised weights."""
  ce = np.mean(np.logaddexp(0, z_N) - labels_N * z_N)
  return ce + l2 / 2 * sum(np.sum(np.square(x)) for x in w)


@pytest.mark.slow
def test_the_head_optimum_is_the_float64_optimum(setup):
  """On an HMM's raw ``G`` at the ``MASK`` (not separable: a finite
  optimum the L2 barely moves), L-BFGS ends at Newton's float64 optimum to
  what float32 determines.

  float32 resolves the objective ``f`` only to about ``eps32 |f|`` per
  rounding of its ``N``-term mean (``log2 N`` levels of pairwise sums), so
  no line search can tell apart points closer in ``f`` than ``df = eps32
  |f| log2 N``: that is the claim on the objective. Near the optimum ``f -
  f* = |d|^2_H / 2`` for the step ``d`` in ``(u, c)`` and the Hessian
  ``H``, so ``|d|_H <= sqrt(2 df)``, and by Cauchy-Schwarz a logit moves by
  at most ``|x_n|_{H^-1} sqrt(2 df)``: tight where the problem is well
  conditioned, loose along the flat directions (eigenvalues down to 4e-5,
  the L2's) where which point L-BFGS stops at depends on how XLA
  vectorises for the CPU (``--xla_cpu_max_isa``). The predictions are
  determined wherever ``|z*_n|`` exceeds that bound."""
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, optimizer="lbfgs")
  data = tuning.data_from_task(task_list[0], cfg)
  res, tunable = tuning.tune(jax.random.PRNGKey(0), bb, bp, data, cfg)
  assert res.steps < cfg.lbfgs_max_steps  # the tolerance was met
  g_NxV = np.asarray(jax.vmap(lambda t: tuning.backbone_head_inputs(
      bb, bp, cfg, t)[0])(data.train_tokens), np.float64)
  labels_N = np.asarray(data.train_labels)
  opt = _newton_optimum(g_NxV, labels_N, cfg.lbfgs_l2)
  df = np.finfo(np.float32).eps * abs(opt.value) * np.log2(len(labels_N))
  w, bias = (np.asarray(tunable["head"][k], np.float64)
             for k in ("w", "bias"))
  logits_NxC = g_NxV @ w + bias
  z_N = logits_NxC[:, 1] - logits_NxC[:, 0]
  # The objective, in float32 as L-BFGS saw it and in float64 at its point.
  assert abs(float(res.final_loss) - opt.value) <= df
  assert 0 <= _head_objective(z_N, labels_N, cfg.lbfgs_l2, *w.T) - opt.value
  assert _head_objective(z_N, labels_N, cfg.lbfgs_l2, *w.T) - opt.value <= df
  # The step in (u, c) in the Hessian's norm, then each logit.
  d_F = np.r_[w[:, 1] - w[:, 0], bias[1] - bias[0]] - opt.u_F
  assert d_F @ opt.hess_FxF @ d_F <= 2 * df
  z_star_N = opt.x_NxF @ opt.u_F
  lev_N = np.einsum("nf,fg,ng->n", opt.x_NxF, np.linalg.inv(opt.hess_FxF),
                    opt.x_NxF)
  atol_N = np.sqrt(2 * df * lev_N)
  np.testing.assert_array_less(np.abs(z_N - z_star_N), atol_N)
  sure_N = np.abs(z_star_N) > atol_N
  assert sure_N.mean() > 0.9  # the claim on the predictions is not empty
  np.testing.assert_array_equal((z_N > 0)[sure_N], (z_star_N > 0)[sure_N])
  correct_N = (z_star_N > 0) == labels_N
  assert (np.mean(correct_N & sure_N) <= float(res.train_accuracy)
          <= np.mean(correct_N | ~sure_N))


@pytest.mark.slow
def test_head_optimum_lanes_equal_one_by_one(setup):
  """Lanes that stop after different numbers of steps, vmapped (the loop
  runs until the last stops) and in lane groups (lax.map), end where each
  ends alone, after as many steps; ``steps`` is the most any lane took.
  (The tolerance is above float32's floor, where the step a lane stops at
  would depend on rounding.)"""
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, optimizer="lbfgs", lbfgs_tol=1e-4)
  datas = [_tiny(tuning.data_from_task(t, cfg)) for t in task_list]
  keys = [jax.random.PRNGKey(40 + i) for i in range(2)]
  whole, whole_t = tuning.tune_many(keys, bb, bp, datas, cfg)
  assert len(set(whole.lane_steps.tolist())) > 1, whole.lane_steps
  assert whole.steps == max(whole.lane_steps)
  grouped, grouped_t = tuning.tune_many(keys, bb, bp, datas, cfg,
                                        lane_group=1)
  for i, (key, data) in enumerate(zip(keys, datas)):
    rec, tunable = tuning.tune(key, bb, bp, data, cfg)
    for res, stacked in ((whole, whole_t), (grouped, grouped_t)):
      assert rec.test_accuracy == res.test_accuracy[i]
      assert rec.train_accuracy == res.train_accuracy[i]
      assert float(rec.final_loss) == pytest.approx(res.final_loss[i],
                                                    rel=1e-5)
      assert int(rec.lane_steps) == int(res.lane_steps[i])
      chex.assert_trees_all_close(
          tunable, jax.tree.map(lambda x: x[i], stacked), rtol=1e-3,
          atol=1e-3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer="sgd"),
     r"^TuneConfig.optimizer must be one of \('adam', 'lbfgs'\), got 'sgd'$"),
    (dict(optimizer="lbfgs", method="prompt"),
     r"optimizer='lbfgs' .* method='prompt' does not cache"),
    (dict(optimizer="lbfgs", method="finetune"),
     r"method='finetune' does not cache.*\('head',\)"),
    (dict(optimizer="lbfgs", lbfgs_tol=0.0), "lbfgs_tol must be > 0"),
    (dict(optimizer="lbfgs", lbfgs_l2=-1e-3), "lbfgs_l2 must be >= 0"),
    (dict(optimizer="lbfgs", lbfgs_max_steps=0),
     "lbfgs_max_steps must be >= 1"),
])
def test_bad_optimizer_settings_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tuning.TuneConfig(**kwargs)
  # The paper's recipe is the default; L-BFGS is given its step limit.
  assert tuning.TuneConfig().optimizer == "adam"
  assert tuning.num_steps(100, tuning.TuneConfig(optimizer="lbfgs")) == 500
