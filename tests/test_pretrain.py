import dataclasses
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import checkpoints as ckpt_lib
from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import config_flags
from hmmprompt import pretrain
from hmmprompt.pretrain import train as pretrain_train
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = pretrain.preset_config("tiny")


@pytest.fixture(scope="module")
def model():
  return hmm_lib.random_hmm(jax.random.PRNGKey(3), 6, 10)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model):
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  final = pretrain.run(workdir, TINY, model, log=lambda s: None)
  return workdir, final


def test_model_shapes_and_split_forward():
  cfg = TINY.model
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  toks = jnp.array([[hmm_lib.MASK, 1, 2, 9]], jnp.int32)
  mlm = transformer.MLM(cfg)
  logits = mlm.apply(params, toks)
  assert logits.shape == (1, 4, 10) and logits.dtype == jnp.float32
  emb = mlm.apply(params, toks, method=transformer.MLM.embed)
  np.testing.assert_allclose(
      mlm.apply(params, emb, method=transformer.MLM.encode), logits,
      rtol=1e-6)
  # MASK (-1) and the explicit mask id V share one embedding row.
  alt = mlm.apply(params, toks.at[0, 0].set(cfg.mask_id),
                  method=transformer.MLM.embed)
  np.testing.assert_array_equal(alt, emb)
  bb = transformer.make_backbone(cfg)
  probs, full = bb.outputs(params, toks[0], jnp.zeros((3, cfg.d_model)))
  assert probs.shape == (7, 10) and full.shape == (7, cfg.d_model)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="exceeds the model's context"):
    bb.apply(params, jnp.zeros((cfg.max_len + 1, cfg.d_model)))
  with pytest.raises(ValueError, match="out of range"):
    bb.embed(params, jnp.array([0, 10]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=30, num_heads=4), "divisible by num_heads"),
    (dict(dtype="float16"), "float32 or bfloat16"),
    (dict(num_layers=0), "num_layers must be >= 1"),
])
def test_bad_model_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    transformer.MLMConfig(**kwargs)


def test_masking_statistics_and_determinism(model):
  toks = jnp.zeros((400, 100), jnp.int32) + 3
  inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(0), toks, 0.15,
                                           10)
  w = np.asarray(weights).astype(bool)
  assert abs(w.mean() - 0.15) < 0.01
  sel = np.asarray(inputs)[w]
  assert abs(np.mean(sel == hmm_lib.MASK) - 0.8) < 0.02
  # 10% random (of which 1/10 equal 3 by chance) + 10% kept.
  assert abs(np.mean(sel == 3) - 0.11) < 0.02
  np.testing.assert_array_equal(np.asarray(inputs)[~w], 3)
  cfg = dataclasses.replace(TINY.corpus, fresh=False, num_seqs=4,
                            seq_len=64)
  chunks = corpus_lib.build_chunks(jax.random.PRNGKey(1), model, cfg)
  assert chunks.shape == (8, 32)
  seen = []
  for step in range(4):  # one epoch of 4 steps x 2 chunks
    a = corpus_lib.batch_at(jax.random.PRNGKey(2), step, model, chunks, cfg,
                            2, 10)
    b = corpus_lib.batch_at(jax.random.PRNGKey(2), step, model, chunks, cfg,
                            2, 10)
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y)
    seen += [tuple(r) for r in np.asarray(a[1])]
  assert sorted(seen) == sorted(tuple(r) for r in np.asarray(chunks))


def test_pretraining_learns_and_reports_bayes_gap(trained, model):
  workdir, final = trained
  lines = [json.loads(l) for l in open(os.path.join(workdir,
                                                    "metrics.jsonl"))]
  assert [m["step"] for m in lines] == [20, 40]
  for m in lines:
    assert {"step", "mlm_ce", "bayes_ce", "tv"} <= set(m)
    assert m["mlm_ce"] >= m["bayes_ce"] - 0.05  # Bayes is the floor
    assert 0.0 <= m["tv"] <= 1.0
  # The Bayes CE is that of the exact conditionals on the same inputs.
  val = pretrain.validation_set(
      jax.random.split(jax.random.PRNGKey(TINY.seed), 4)[3], model, TINY)
  inputs, targets, weights, exact = val
  cond = jax.vmap(hmm_lib.conditionals, in_axes=(None, 0))(model, inputs)
  p = np.take_along_axis(np.asarray(cond), np.asarray(targets)[..., None],
                         -1)[..., 0]
  w = np.asarray(weights)
  np.testing.assert_allclose(final["bayes_ce"],
                             -(np.log(p) * w).sum() / w.sum(), rtol=1e-5)
  # An untrained model is far from Bayes; training closes part of the gap.
  untrained = pretrain.evaluate(
      transformer.init_params(jax.random.PRNGKey(9), TINY.model), TINY, val)
  assert final["ce_gap"] < 0.7 * untrained["ce_gap"]


def test_load_backbone_feeds_tuning(trained, model):
  workdir, _ = trained
  bb, params, info = pretrain.load_backbone(workdir)
  assert info["step"] == 40 and info["config"] == TINY
  before = jax.tree.map(lambda a: np.array(a, copy=True), params)
  task = tasks.make_task(jax.random.PRNGKey(0), model, tasks.TaskConfig(
      num_train=64, num_val=16, num_test=32, seq_len=12))
  for method in ("head", "prompt"):
    cfg = tuning.TuneConfig(method=method, prompt_len=4, epochs=1,
                            batch_size=32)
    rec, tunable = tuning.tune(jax.random.PRNGKey(0), bb, params,
                               tuning.data_from_task(task, cfg), cfg)
    assert 0.0 <= rec["test_accuracy"] <= 1.0
  assert tunable["prompt"].shape == (4, TINY.model.d_model)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_transformer_backbone_frozen_unless_finetuning(trained, model):
  """Head and prompt tuning never differentiate the backbone (a sentinel on
  its params would fire); the fine-tuning arm does, on its own copy."""
  workdir, _ = trained
  bb, params, _ = pretrain.load_backbone(workdir)
  flag = {"traced": False}

  @jax.custom_vjp
  def sentinel(p):
    return p

  def bwd(_, g):
    flag["traced"] = True
    return (g,)

  sentinel.defvjp(lambda p: (p, None), bwd)
  sbb = dataclasses.replace(bb, name="sentinel",
                            apply=lambda p, e: bb.apply(sentinel(p), e))
  task = tasks.make_task(jax.random.PRNGKey(1), model, tasks.TaskConfig(
      num_train=64, num_val=16, num_test=32, seq_len=12))
  before = jax.tree.map(lambda a: np.array(a, copy=True), params)
  for method in ("head", "prompt"):
    cfg = tuning.TuneConfig(method=method, prompt_len=4, epochs=1,
                            batch_size=32)
    tuning.tune(jax.random.PRNGKey(0), sbb, params,
                tuning.data_from_task(task, cfg), cfg)
  assert not flag["traced"]
  cfg = tuning.TuneConfig(method="finetune", epochs=4, batch_size=32,
                          backbone_lr=1e-3)
  rec, tunable = tuning.tune(jax.random.PRNGKey(0), sbb, params,
                             tuning.data_from_task(task, cfg), cfg)
  assert flag["traced"] and set(tunable) == {"head", "backbone"}
  assert 0.0 <= rec["test_accuracy"] <= 1.0
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(tunable["backbone"]), jax.tree.leaves(params))]
  assert max(moved) > 1e-4  # the copy was trained ...
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))  # ... the original not


def test_load_backbone_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a pretraining workdir"):
    pretrain.load_backbone(str(tmp_path))


def test_other_config_in_same_workdir_is_refused(trained, model):
  workdir, _ = trained
  with pytest.raises(ValueError, match="different config"):
    pretrain.run(workdir, dataclasses.replace(TINY, lr=1e-3), model)


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(
    tmp_path, model, monkeypatch):
  real = pretrain_train.make_train_step

  def diverging(cfg, mesh):
    step = real(cfg, mesh)

    def wrapped(state, *batch):
      new, loss = step(state, *batch)
      if int(new.step) >= 16:
        new = new.replace(params=jax.tree.map(lambda x: x * jnp.nan,
                                              new.params))
        loss = loss * jnp.nan
      return new, loss

    return wrapped

  monkeypatch.setattr(pretrain_train, "make_train_step", diverging)
  cfg = dataclasses.replace(TINY, log_every=5, ckpt_every=10, eval_every=10)
  with pytest.raises(FloatingPointError,
                     match=r"non-finite loss at step 16.*step 10"):
    pretrain.run(str(tmp_path), cfg, model, log=lambda s: None)
  ck = ckpt_lib.Checkpoints(os.path.join(str(tmp_path), "checkpoints"))
  assert ck.latest_step() == 10
  ck.close()
  _, params, info = pretrain.load_backbone(str(tmp_path))
  assert info["step"] == 10
  assert all(np.isfinite(np.asarray(x)).all()
             for x in jax.tree.leaves(params))


def _run_binary(workdir, *extra):
  return subprocess.run(
      [sys.executable, "-m", "experiments.pretrain", "--preset=tiny",
       f"--workdir={workdir}", "--config.num_states=6",
       "--config.hmm_seed=3", *extra],
      capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_sigkill_then_rerun_equals_uninterrupted(tmp_path):
  clean, crashed = str(tmp_path / "clean"), str(tmp_path / "crashed")
  assert _run_binary(clean).returncode == 0
  first = _run_binary(crashed, "--crash_at_step=25")
  assert first.returncode == -signal.SIGKILL
  second = _run_binary(crashed)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resumed from step 20" in second.stderr
  a = pretrain.load_backbone(clean)[1]
  b = pretrain.load_backbone(crashed)[1]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  def metrics(workdir):  # all but the wall clock are bit-identical
    lines = [json.loads(l) for l in open(os.path.join(workdir,
                                                      "metrics.jsonl"))]
    assert all(l.pop("wall_s") > 0 for l in lines)
    return lines

  assert metrics(clean) == metrics(crashed)


def test_bad_flags_fail_clearly(tmp_path):
  out = subprocess.run([sys.executable, "-m", "experiments.pretrain",
                        "--preset=tiny"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
  assert out.returncode != 0 and "--workdir is required" in out.stderr
  out = _run_binary(str(tmp_path), "--config.pretrain.model.num_heads=3")
  assert out.returncode != 0 and "divisible by num_heads" in out.stderr
  assert "Traceback" not in out.stderr
  out = _run_binary(str(tmp_path), "--config.pretrain.lr_typo=1")
  assert out.returncode != 0 and "config.pretrain.lr_typo" in out.stderr
  out = _run_binary(str(tmp_path), "--config.pretrain.steps=ten")
  assert out.returncode != 0 and "config.pretrain.steps" in out.stderr
  assert "Traceback" not in out.stderr


_DP_SCRIPT = """
import json, jax
from hmmprompt import corpus, hmm, pretrain, sharding
cfg = pretrain.preset_config("tiny")
model = hmm.random_hmm(jax.random.PRNGKey(3), 6, 10)
mesh = sharding.data_mesh()
state = jax.device_put(pretrain.init_state(jax.random.PRNGKey(0), cfg),
                       sharding.replicated(mesh))
step = pretrain.make_train_step(cfg, mesh)
losses = []
for s in range(3):
  batch = jax.device_put(
      corpus.batch_at(jax.random.PRNGKey(1), s, model, None, cfg.corpus,
                      cfg.batch_size, 10), sharding.batch_sharded(mesh))
  state, loss = step(state, *batch)
  losses.append(float(loss))
leaf = jax.tree.leaves(state.params)[0]
print(json.dumps({"devices": jax.device_count(), "losses": losses,
                  "shards": len(batch[0].sharding.device_set),
                  "param_sum": float(abs(leaf).sum())}))
"""


def test_data_parallel_matches_single_device():
  results = []
  for n in (1, 4):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _DP_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
  one, four = results
  assert one["devices"] == 1 and four["devices"] == 4 and four["shards"] == 4
  np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-5)
  np.testing.assert_allclose(four["param_sum"], one["param_sum"], rtol=1e-5)


def test_target_gap_stops_early_and_rerun_is_a_no_op(tmp_path, model):
  cfg = dataclasses.replace(TINY, steps=400, eval_every=20, ckpt_every=20,
                            target_gap=10.0)  # met at the first evaluation
  first = pretrain.run(str(tmp_path), cfg, model, log=lambda s: None)
  assert first["step"] == 20 and first["ce_gap"] <= 10.0
  logs = []
  again = pretrain.run(str(tmp_path), cfg, model, log=logs.append)
  assert again == first and any("already reached" in l for l in logs)
  with pytest.raises(ValueError, match="target_gap must be > 0"):
    dataclasses.replace(TINY, target_gap=0.0)


def test_lr_cycles_schedule_steps_cap_and_stop_points(tmp_path, model):
  cfg = pretrain.configure("cpu", 10, steps=3500)
  assert cfg.cycles == (1000, 2000, 500) and cfg.cycle_ends == (1000, 3000,
                                                                3500)
  sched = pretrain.lr_schedule(cfg)
  w = cfg.warmup_steps
  np.testing.assert_allclose(
      [sched(0), sched(w), sched(1000), sched(1000 + w), sched(3000),
       sched(3000 + w)], [0, cfg.lr, 0, cfg.lr / 2, 0, cfg.lr / 2],
      atol=1e-9)
  with pytest.raises(ValueError, match="must equal sum"):
    dataclasses.replace(cfg, steps=100)
  # With cycles, a met target stops the run only at the end of a cycle.
  tiny = dataclasses.replace(TINY, steps=40, cycles=(30, 10), eval_every=10,
                             ckpt_every=10, target_gap=10.0)
  final = pretrain.run(str(tmp_path), tiny, model, log=lambda s: None)
  assert final["step"] == 30


def test_config_overrides_build_configs_and_name_bad_items():
  base = pretrain.configure("cpu", 10)
  cfg = config_flags.apply(base, {
      "batch_size": "64", "lr": "3e-3", "model.num_heads": "2",
      "cycles": "500:1500", "corpus.mask_rate": "0.05",
      "model.dtype": "float32", "target_gap": "none"})
  assert (cfg.batch_size, cfg.lr, cfg.model.num_heads, cfg.cycles,
          cfg.steps, cfg.corpus.mask_rate, cfg.target_gap) == (
              64, 3e-3, 2, (500, 1500), 2000, 0.05, None)
  # A steps override cuts the preset's cycles, as configure(steps=...).
  assert config_flags.apply(base, {"steps": 3500}) == pretrain.configure(
      "cpu", 10, steps=3500)
  for item, match in [({"model.foo": "1"}, "model.foo"),
                      ({"bogus": "1"}, "unknown config key 'bogus'"),
                      ({"cycles": "1:x"}, "config.cycles"),
                      ({"model.num_heads": "3"}, "divisible by num_heads")]:
    with pytest.raises(ValueError, match=match):
      config_flags.apply(base, item)


def test_train_flops_per_token_matches_xla_cost_analysis():
  # Two independent counts of one training step's FLOPs: our formula
  # (used for MFU) and XLA's cost analysis of the compiled gradient.
  cfg = transformer.MLMConfig(vocab_size=10, d_model=128, num_heads=4,
                              d_ff=512, num_layers=2, max_len=64)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  x_BxT = jnp.zeros((4, 64), jnp.int32)
  grad = jax.jit(jax.grad(lambda p: pretrain.mlm_loss(
      p, cfg, x_BxT, x_BxT, jnp.ones((4, 64)))))
  cost = grad.lower(params).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  ours = transformer.train_flops_per_token(cfg, 64) * 4 * 64
  assert 0.97 < cost["flops"] / ours < 1.1
