import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
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
      apply=lambda p, e: exact._apply(sentinel(p), e))


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
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(bp)):
    np.testing.assert_array_equal(a, np.asarray(b))
  # The sentinel does fire when a gradient w.r.t. the backbone is taken, so
  # the check above can fail.
  jax.grad(lambda p: sbb.apply(p, sbb.embed(p, data.train_tokens[0])).sum())(
      bp)
  assert flag["backbone_grad_traced"]


@pytest.mark.parametrize("method", ["head", "prompt"])
def test_vmapped_seeds_equal_one_by_one(setup, method):
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, method=method, epochs=1)
  datas = [tuning.data_from_task(t, cfg) for t in task_list]
  keys = [jax.random.PRNGKey(10 + i) for i in range(2)]
  records, stacked = tuning.tune_many(keys, bb, bp, datas, cfg)
  for i, (key, data) in enumerate(zip(keys, datas)):
    rec, tunable = tuning.tune(key, bb, bp, data, cfg)
    assert rec["test_accuracy"] == pytest.approx(records[i]["test_accuracy"],
                                                 abs=1e-6)
    for a, b in zip(jax.tree.leaves(tunable), jax.tree.leaves(stacked)):
      np.testing.assert_allclose(a, b[i], rtol=2e-4, atol=2e-5)


def test_head_and_prompt_tuning_learn(setup):
  model, bb, bp, task_list = setup
  for cfg in (dataclasses.replace(FAST, features="log"),
              dataclasses.replace(FAST, method="prompt", features="log")):
    rec, _ = tuning.tune(jax.random.PRNGKey(0), bb, bp,
                         tuning.data_from_task(task_list[0], cfg), cfg)
    assert rec["test_accuracy"] >= 0.9, (cfg, rec)
    assert rec["steps"] == 3 * 256 // 32
    assert set(rec) >= {"config", "train_accuracy", "val_accuracy",
                        "test_accuracy", "steps", "seconds"}


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
  assert rec["test_accuracy"] >= 0.85, rec


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
  assert rec["test_accuracy"] >= 0.9


def test_exact_backbone_refuses_finetuning(setup):
  model, bb, bp, task_list = setup
  cfg = dataclasses.replace(FAST, method="finetune")
  with pytest.raises(ValueError, match="cannot be fine-tuned"):
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
