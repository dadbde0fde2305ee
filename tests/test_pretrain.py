"""hmmprompt.pretrain: config, train step, evaluation, loop, workdir."""

import dataclasses
import functools
import glob
import json
import logging
import os
import re
import shutil
import socket
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import checkpoints as ckpt_lib
from hmmprompt import config_flags
from hmmprompt import corpus
from hmmprompt import hmm as hmm_lib
from hmmprompt import generative
from hmmprompt import pretrain
from hmmprompt import sharding
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import depth
from hmmprompt.backbones import transformer
from hmmprompt.pretrain import batches as pretrain_batches
from hmmprompt.pretrain import loop as pretrain_loop
from hmmprompt.pretrain import train as pretrain_train
from hmmprompt.pretrain import workdir as pretrain_workdir
TINY = pretrain.preset_config("tiny")


class _Crash(Exception):
  """Stands for a killed process (the binary tests use real SIGKILLs)."""


def _step_clock():
  """The loop's clock, read once a step while a deadline is set: step
  ``s`` reads ``s`` seconds."""
  steps = [0]

  def tick() -> float:
    steps[0] += 1
    return float(steps[0])
  return tick


def _three_trials_in_4_s(monkeypatch, cfg) -> int:
  """Sets the assumed save rate to 3 trials' state (of ``cfg``, counted
  from a real state, not the loop's shapes) in 4 seconds; returns one
  trial's bytes."""
  trial_bytes = sum(x.nbytes for x in jax.tree.leaves(
      pretrain.init_states(jax.random.split(jax.random.PRNGKey(0), 1), cfg)))
  monkeypatch.setattr(pretrain_loop, "SAVE_BYTES_PER_S", 3 * trial_bytes / 4)
  return trial_bytes


def _crash_after(at: int):
  """An ``after_step`` that raises once step ``at`` is done."""
  def crash(step):
    if step == at:
      raise _Crash
  return crash


@pytest.fixture(scope="module")
def model():
  return hmm_lib.random_hmm(jax.random.PRNGKey(3), 6, 10)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model):
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  final = pretrain.run(workdir, TINY, model, log=lambda s: None)
  return workdir, final


@pytest.mark.slow
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


@pytest.mark.slow
def test_no_model_beats_the_bayes_ce_beyond_sampling_noise(trained, model):
  """With the right reference, a model's expected gap is its expected KL
  to the exact conditionals, >= 0; the held-out mean of the per-position
  differences can fall below 0 by sampling noise only, so it stays above
  -3 standard errors (a 0.1% event; the seeds are fixed). Models: a
  transformer at init, the same briefly trained, uniform, and the exact
  conditionals smoothed toward uniform (tests/test_bayes_gap.py holds the
  reference's own checks)."""
  cfg = dataclasses.replace(TINY, corpus=dataclasses.replace(
      TINY.corpus, val_seqs=64))
  val = pretrain.validation_set(jax.random.PRNGKey(7), model, cfg)
  params0 = transformer.init_params(jax.random.PRNGKey(9), cfg.model)
  _, params, _ = pretrain.load_backbone(trained[0])
  # (One program for both params, not a compile per op and shape.)
  probs = jax.jit(lambda p: jax.nn.softmax(
      transformer.MLM(cfg.model).apply(p, val.inputs), -1))
  apply = lambda p: np.asarray(probs(p))
  exact = np.asarray(val.exact)
  targets, w = np.asarray(val.targets), np.asarray(val.weights) > 0
  for name, p in [("init", apply(params0)),
                  ("trained", apply(params)),
                  ("uniform", np.full_like(exact, 0.1)),
                  ("smoothed", 0.9 * exact + 0.01)]:
    take = lambda q: np.take_along_axis(q, targets[..., None], -1)[..., 0]
    d = (np.log(take(exact)) - np.log(take(p)))[w]
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert d.mean() >= -3 * se, (name, d.mean(), se)


@pytest.mark.slow
def test_loaded_backbone_tunes_frozen_unless_finetuning(trained, model):
  """A loaded backbone feeds tuning; head and prompt tuning never
  differentiate it (a sentinel on its params would fire); the fine-tuning
  arm does, on its own copy."""
  workdir, _ = trained
  bb, params, info = pretrain.load_backbone(workdir)
  assert info.step == 40 and info.config == TINY
  flag = {"traced": False}

  @jax.custom_vjp
  def sentinel(p):
    return p

  def bwd(_, g):
    flag["traced"] = True
    return (g,)

  sentinel.defvjp(lambda p: (p, None), bwd)
  # Every function of the backbone that reads its params for G.
  sbb = dataclasses.replace(
      bb, name="sentinel", apply=lambda p, e: bb.apply(sentinel(p), e),
      apply_at=lambda p, e, i: bb.apply_at(sentinel(p), e, i))
  task = tasks.make_task(jax.random.PRNGKey(1), model, tasks.TaskConfig(
      num_train=64, num_val=16, num_test=32, seq_len=12))
  before = jax.tree.map(lambda a: np.array(a, copy=True), params)
  for method in ("head", "prompt"):
    cfg = tuning.TuneConfig(method=method, prompt_len=4, epochs=1,
                            batch_size=32)
    rec, tunable = tuning.tune(jax.random.PRNGKey(0), sbb, params,
                               tuning.data_from_task(task, cfg), cfg)
    assert 0.0 <= rec.test_accuracy <= 1.0
  assert tunable["prompt"].shape == (4, TINY.model.d_model)
  assert not flag["traced"]
  cfg = tuning.TuneConfig(method="finetune", epochs=4, batch_size=32,
                          backbone_lr=1e-3)
  rec, tunable = tuning.tune(jax.random.PRNGKey(0), sbb, params,
                             tuning.data_from_task(task, cfg), cfg)
  assert flag["traced"] and set(tunable) == {"head", "backbone"}
  assert 0.0 <= rec.test_accuracy <= 1.0
  moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(tunable["backbone"]), jax.tree.leaves(params))]
  assert max(moved) > 1e-4  # the copy was trained ...
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))  # ... the original not


def test_load_backbone_missing(tmp_path):
  with pytest.raises(FileNotFoundError, match="not a pretraining workdir"):
    pretrain.load_backbone(str(tmp_path))


@pytest.mark.slow
def test_other_config_in_same_workdir_is_refused(trained, model):
  workdir, _ = trained
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{workdir} holds a run with a different config (lr: 0.003 -> 0.001; "
      f"warmup_steps: 5 -> 6); use a new --workdir (or delete it) to start "
      f"another") + "$"):
    pretrain.run(workdir, dataclasses.replace(TINY, lr=1e-3, warmup_steps=6),
                 model)
  # An identity.ADDED field at its default (left out of the identity) is
  # named by that default, as --print_config shows it (issue 66: None).
  with pytest.raises(ValueError, match=re.escape(
      "(corpus.train_mask_rate: 0.0 -> 0.4)")):
    pretrain.run(workdir, dataclasses.replace(TINY, corpus=dataclasses.replace(
        TINY.corpus, train_mask_rate=0.4)), model)
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{workdir} was pretrained on a different HMM") + "$"):
    pretrain.run(workdir, TINY, hmm_lib.random_hmm(jax.random.PRNGKey(4), 6,
                                                   10))


# Full suite (2.7 s); the fast tier keeps
# test_a_nonfinite_state_is_refused_by_leaf_checked_where_it_lives.
@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(
    tmp_path, model, monkeypatch):
  real = pretrain_train.make_train_step

  def diverging(cfg, mesh):
    step = real(cfg, mesh)

    def wrapped(state, *batch):
      new, loss = step(state, *batch)
      if int(new.step.max()) >= 16:  # [K] steps, a stack of one
        new = new.replace(params=jax.tree.map(lambda x: x * jnp.nan,
                                              new.params))
        loss = loss * jnp.nan
      return new, loss

    return wrapped

  monkeypatch.setattr(pretrain_train, "make_train_step", diverging)
  cfg = dataclasses.replace(TINY, log_every=5, ckpt_every=10, eval_every=10)
  ckpt_dir = os.path.join(str(tmp_path), "checkpoints")
  with pytest.raises(FloatingPointError, match="^" + re.escape(
      f"non-finite loss at step 16; stopping. The last good checkpoint "
      f"(step 10) is in {ckpt_dir}; lower --lr or raise --warmup_steps")
                     + "$"):
    pretrain.run(str(tmp_path), cfg, model, log=lambda s: None)
  ck = ckpt_lib.Checkpoints(os.path.join(str(tmp_path), "checkpoints"))
  assert ck.latest_step() == 10
  ck.close()
  _, params, info = pretrain.load_backbone(str(tmp_path))
  assert info.step == 10
  assert all(np.isfinite(np.asarray(x)).all()
             for x in jax.tree.leaves(params))


def test_a_nonfinite_state_is_refused_by_leaf_checked_where_it_lives(
    tmp_path):
  """The finiteness check runs on the device: with implicit device-to-host
  copies disallowed it still names the bad leaf (a bfloat16 one too) and
  refuses to save it; only its verdicts are fetched, explicitly."""
  state = {"w": jnp.ones((3, 4), jnp.bfloat16).at[1, 2].set(jnp.inf),
           "b": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)}
  with jax.transfer_guard_device_to_host("disallow"):
    assert ckpt_lib.nonfinite_leaves(state) == ["['w']"]
    assert ckpt_lib.nonfinite_leaves({**state, "w": state["b"]}) == []
  ckpts = ckpt_lib.Checkpoints(str(tmp_path))
  with pytest.raises(FloatingPointError, match=re.escape(
      "refusing to checkpoint a non-finite state at step 3 (first bad leaf "
      "['w'])")):
    ckpts.save(3, state)
  assert ckpts.all_steps() == []
  ckpts.close()


def test_a_full_disk_is_an_oserror_naming_the_directory(small_disk,
                                                       monkeypatch):
  """Where the free space is below the state's bytes, ``save`` refuses
  before writing; where it looks enough but is not, orbax's failed write
  (tensorstore's message) comes back as the same ``OSError``. Nothing is
  saved; orbax's threads log no traceback (the absl logger's filter)."""
  ckpts = ckpt_lib.Checkpoints(str(small_disk("size=64k") / "c"))
  # Random: orbax compresses, and ones would fit.
  state = {"w": jax.random.normal(jax.random.PRNGKey(0), (100_000,)),
           "step": jnp.zeros((), jnp.int32)}
  logged = logging.Handler()
  logged.emit = lambda record: records.append(record)
  records = []
  logging.getLogger("absl").addHandler(logged)
  try:
    for saving in ("step 1's checkpoint needs 0.4 MB, 0.0", "saving step 1)"):
      with pytest.raises(OSError, match=re.escape(saving)) as e:
        ckpts.save(1, state)
      assert (e.value.errno, e.value.filename) == (28, ckpts.directory)
      monkeypatch.setattr(ckpt_lib.shutil, "disk_usage",
                          lambda _: types.SimpleNamespace(free=2**40))
  finally:
    logging.getLogger("absl").removeHandler(logged)
  # This write's tracebacks: another test's orbax thread may log its own
  # while this one runs (seen under the full suite's load).
  text = lambda r: f"{r.getMessage()} {r.exc_info[1]!r}"
  ours = [text(r) for r in records if r.exc_info and any(
      s in text(r) for s in (ckpts.directory, "os_error_code='28'",
                             "No space left"))]
  assert ckpts.all_steps() == [] and not ours, ours


@pytest.mark.slow
def test_exact_targets_train_and_beat_sampled_at_equal_steps(
    tmp_path, model, trained):
  """The same run (data, masks, init) with exact-conditional targets: the
  loss it logs is against the conditionals, and it ends closer to Bayes
  than sampled targets (lower gradient variance)."""
  cfg = TINY.with_overrides(targets="exact")
  final = pretrain.run(str(tmp_path), cfg, model, log=lambda s: None)
  _, sampled = trained
  assert final["bayes_ce"] == sampled["bayes_ce"]  # same validation set
  assert final["ce_gap"] < sampled["ce_gap"]
  step = pretrain.make_train_step(cfg, sharding.data_mesh())
  with pytest.raises(ValueError, match=re.escape(
      "PretrainConfig.targets='exact' needs the generating HMMs: pass "
      "hmms=jax.vmap(generative.as_hmm)(models_K) to the step")):
    step(pretrain.init_states(jax.random.PRNGKey(0)[None], cfg),
         *jax.tree.map(lambda x: x[None], corpus.batch_at(
             jax.random.PRNGKey(1), 0, model, None, cfg.corpus,
             cfg.batch_size, 10)))
  # Sampled targets need none.
  _, losses = pretrain.make_train_step(TINY, sharding.data_mesh())(
      pretrain.init_states(jax.random.PRNGKey(0)[None], TINY),
      *jax.tree.map(lambda x: x[None], corpus.batch_at(
          jax.random.PRNGKey(1), 0, model, None, TINY.corpus,
          TINY.batch_size, 10)))
  assert np.isfinite(np.asarray(losses)).all()
  with pytest.raises(ValueError, match="targets must be one of"):
    TINY.with_overrides(targets="soft")
  with pytest.raises(ValueError, match="corruption must be one of"):
    dataclasses.replace(TINY.corpus, corruption="drop")


@pytest.mark.slow
def test_target_gap_stops_early_and_rerun_is_a_no_op(tmp_path, model,
                                                      monkeypatch):
  """Also: every checkpoint manager the loop opens (the rotation,
  ``stopped/`` and ``retained/``) is closed on each way out, the early return included."""
  opened = []

  class Tracked(ckpt_lib.Checkpoints):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.closed = False
      opened.append(self)

    def close(self):
      self.closed = True
      super().close()

  monkeypatch.setattr(ckpt_lib, "Checkpoints", Tracked)
  cfg = dataclasses.replace(TINY, steps=400, eval_every=20, ckpt_every=20,
                            target_gap=10.0,  # met at the first evaluation
                            retain=(0, 20))
  logs = []
  first = pretrain.run(str(tmp_path), cfg, model, log=logs.append)
  assert first["step"] == 20 and first["ce_gap"] <= 10.0
  assert (f"CE gap {first['ce_gap']:.4f} <= target 10.0 at step 20: "
          f"stopping") in logs
  assert len(opened) == 3 and all(m.closed for m in opened)
  logs = []
  again = pretrain.run(str(tmp_path), cfg, model, log=logs.append)
  assert again == first and logs == [
      "resumed from step 20", "already reached the target gap at step 20"]
  assert len(opened) == 6 and all(m.closed for m in opened)
  with pytest.raises(ValueError, match="target_gap must be > 0"):
    dataclasses.replace(TINY, target_gap=0.0)


@pytest.mark.slow
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
  half = (1000 - w) // 2  # the first cycle's decay, half way
  np.testing.assert_allclose(sched(w + half), cfg.lr * (1 - half / (1000 - w)),
                             rtol=1e-5)
  # Cycles no longer than the warmup: it ends a step before the cycle does,
  # so each reaches its peak (lr, then cycle_lr x lr) on its last step.
  short = TINY.with_overrides(cycles=(1, 2, 3), steps=6, warmup_steps=100,
                              lr=1.0)
  p = short.cycle_lr
  np.testing.assert_allclose([pretrain.lr_schedule(short)(i) for i in range(6)],
                             [1.0, 0.0, p, 0.0, p / 2, p], atol=1e-7)
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


@pytest.mark.parametrize("name", ["batch_size", "epochs", "log_every",
                                  "eval_every", "ckpt_every", "keep",
                                  "eval_batch", "steps"])
def test_pretrain_config_counts_are_named_when_below_one_or_none(name):
  """Every count is an int >= 1, each refusal naming its field; ``None``
  only for ``steps`` (then the epochs set the length). A ``keep=None``
  once passed here and would have failed at the first checkpoint."""
  paper = pretrain.preset_config("paper")  # not fresh: steps may be None
  for bad in (0, -3) if name == "steps" else (0, None):
    with pytest.raises(ValueError, match=rf"^PretrainConfig\.{name} must be "
                       rf">= 1, got {bad}$"):
      dataclasses.replace(paper, **{name: bad})
  assert getattr(dataclasses.replace(paper, **{name: 1}), name) == 1
  assert dataclasses.replace(paper, steps=None).total_steps == 37500


def test_the_paper_preset_is_appendix_d():
  """Appendix D (and the authors' run_pretrain.sh): 5000 sequences of
  10240 tokens, 5% masked LM on chunks of 512, batch 8, lr 1e-5 with 500
  warmup steps then linear decay, 3 epochs, BERT-base width with 6
  layers, the ordinary (sampled-target) MLM with no early stop."""
  cfg = pretrain.preset_config("paper")
  m, c = cfg.model, cfg.corpus
  assert (m.vocab_size, m.d_model, m.num_heads, m.d_ff, m.num_layers,
          m.max_len) == (10, 768, 12, 3072, 6, 512)
  assert (c.num_seqs, c.seq_len, c.chunk_len, c.mask_rate) == (
      5000, 10240, 512, 0.05)
  assert (cfg.lr, cfg.warmup_steps, cfg.batch_size, cfg.epochs, cfg.steps,
          cfg.cycles, cfg.target_gap, cfg.targets, cfg.optimizer) == (
              1e-5, 500, 8, 3, None, None, None, "sampled", "adamw")
  # 3 epochs of 5000 x 20 chunks in batches of 8.
  assert cfg.total_steps == 37500
  # Ours, not the paper's: the held-out set and the runtime settings.
  assert (c.val_seqs, cfg.log_every, cfg.eval_every, cfg.ckpt_every,
          cfg.keep) == (64, 100, 2000, 2000, 3)
  assert pretrain.preset_config("paper", vocab_size=7).model.vocab_size == 7


@pytest.mark.slow
def test_stacked_step_equals_separate_steps_and_drops_stopped_trials():
  """K = 2 models (own HMMs, inits and batches) in one vmapped step give
  each model's separate run (a stack of one); a trial dropped from the
  stack (as the loop drops a stopped one) keeps its state, and the other
  steps on alone. (trials_per_vmap=0: the accelerators' path; the CPU
  path, one trial at a time, is bit-exact:
  test_run_trials_equals_separate_runs...)"""
  cfg = TINY.with_overrides(targets="exact", trials_per_vmap=0)
  mesh = sharding.data_mesh()
  stacked_hmms = generative.random_models(jax.random.PRNGKey(11), 2, "vanilla",
                                      5, 10)
  hmms = [jax.tree.map(lambda x, k=k: x[k:k + 1], stacked_hmms)
          for k in range(2)]  # stacks of one
  keys = jax.random.split(jax.random.PRNGKey(20), 2)
  states = [pretrain.init_states(keys[k:k + 1], cfg) for k in range(2)]
  batches = [[jax.tree.map(lambda x: x[None], corpus.batch_at(
      jax.random.PRNGKey(30 + k), s, generative.trial(stacked_hmms, k), None,
      cfg.corpus, cfg.batch_size, 10)) for s in range(3)] for k in range(2)]
  step = pretrain.make_train_step(cfg, mesh)
  cat = lambda trees: jax.tree.map(lambda *x: jnp.concatenate(x), *trees)
  state_k = cat(states)
  for s in range(3):
    if s < 2:
      state_k, losses = step(state_k, *cat([batches[0][s], batches[1][s]]),
                             stacked_hmms)
    else:  # trial 1 reached its target after 2 steps: dropped
      sub, losses = step(jax.tree.map(lambda x: x[:1], state_k),
                         *batches[0][s], hmms[0])
      state_k = jax.tree.map(lambda full, part: full.at[:1].set(part),
                             state_k, sub)
    for k in range(2 if s < 2 else 1):
      states[k], loss = step(states[k], *batches[k][s], hmms[k])
      np.testing.assert_allclose(losses[k], loss[0], rtol=1e-5)
  # Float tolerance: vmapped reductions round differently, and Adam's
  # first steps (update ~ lr * sign(g)) amplify that on near-zero gradient
  # entries. One step's update is ~lr = 1e-3 here, 20x the tolerance.
  for k in range(2):
    got = jax.tree.map(lambda x: x[k], state_k)
    assert int(got.step) == (3 if k == 0 else 2)
    for a, b in zip(jax.tree.leaves(got.params),
                    jax.tree.leaves(states[k].params)):
      np.testing.assert_allclose(a, b[0], rtol=1e-4, atol=5e-5)


@pytest.mark.default_compiler
def test_run_trials_equals_separate_runs_and_stops_each(tmp_path):
  """K = 2 stacked trials (one program, one trial after another) equal the
  two separate runs bit for bit, trial 1 with seed + 1; each stops at the
  target on its own. (A stack killed mid-way resumes bit for bit:
  tests/integration/test_figure3_sweep.py, under the suite's compiler.)"""
  cfg = dataclasses.replace(TINY, target_gap=0.5)
  assert cfg.trials_per_vmap == 1
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6, 10)
  workdir = str(tmp_path / "stacked")
  final = pretrain.run_trials(workdir, cfg, stacked, log=lambda s: None)
  # Trial 0 (gap 0.29 at step 20) stops there; trial 1 (1.02) runs on.
  assert [(m["trial"], m["step"]) for m in final] == [(0, 20), (1, 40)]
  _, params_k, infos = pretrain.load_trials(workdir)
  assert [i.step for i in infos] == [20, 40]
  for k in range(2):
    alone = str(tmp_path / f"alone{k}")
    m = pretrain.run(alone, dataclasses.replace(cfg, seed=cfg.seed + k),
                     generative.trial(stacked, k), log=lambda s: None)
    drop = lambda d: {a: b for a, b in d.items()
                      if a not in ("wall_s", "trial")}
    assert drop(m) == drop(final[k])
    for a, b in zip(jax.tree.leaves(params_k),
                    jax.tree.leaves(pretrain.load_backbone(alone)[1])):
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b))
  assert pretrain.run_trials(workdir, cfg, stacked) == final  # a no-op

  with pytest.raises(ValueError, match="holds a run of 2 stacked trials, "
                     "this run has 3 stacked trials"):
    pretrain.run_trials(workdir, cfg, generative.random_models(
        jax.random.PRNGKey(5), 3, "vanilla", 6, 10))
  with pytest.raises(ValueError, match="load it with load_trials"):
    pretrain.load_backbone(workdir)
  with pytest.raises(ValueError, match="needs \\[K\\] stacked models"):
    pretrain.run_trials(workdir, cfg, generative.trial(stacked, 0))


@pytest.mark.slow  # a pretraining loop (the fast tier's minute)
def test_groups_of_trials_per_vmap_step_in_fixed_shapes_and_equal_one_stack(
    tmp_path, monkeypatch):
  """trials_per_vmap = 2 over 3 trials: the train step is called on
  groups of 2 and 1 (the rest, padded up to a power of two) and never on
  the stack of 3 or on a new shape when a trial stops (each new shape is
  a compile: ~35 s at BERT width); the trials' lines are those of the
  stack stepped one trial at a time, to float rounding (vmapped
  reductions round otherwise), the same steps and stops."""
  cfg = dataclasses.replace(TINY, target_gap=0.5)
  stacked = generative.random_models(jax.random.PRNGKey(5), 3, "vanilla", 6,
                                     10)
  one = pretrain.run_trials(str(tmp_path / "one"), cfg, stacked,
                            log=lambda s: None)
  assert len({m["step"] for m in one}) > 1  # trials stop at different steps
  shapes = []
  make = pretrain_train.make_train_step

  def recording(cfg, mesh):
    step = make(cfg, mesh)

    def counted(states, *args):
      shapes.append(int(states.step.shape[0]))
      return step(states, *args)
    return counted

  monkeypatch.setattr(pretrain_train, "make_train_step", recording)
  grouped = pretrain.run_trials(
      str(tmp_path / "grouped"), cfg.with_overrides(trials_per_vmap=2),
      stacked, log=lambda s: None)
  assert set(shapes) == {2, 1}
  assert len(shapes) == sum(  # one call per group and step
      -(-sum(m["step"] > s for m in one) // 2) for s in range(40))
  # The same stops and steps; gaps to float rounding: a vmapped group's
  # reductions round otherwise (~1e-7 relative an op), Adam's first
  # sign-like steps amplify that on near-zero gradients as in the vmapped
  # test above (params within 1e-4 relative there), and a gap is a
  # difference of two CEs ~10x larger than itself: 1e-3 of the gap.
  for a, b in zip(grouped, one):
    assert (a["trial"], a["step"]) == (b["trial"], b["step"])
    assert a["ce_gap"] == pytest.approx(b["ce_gap"], rel=1e-3, abs=1e-4)


@pytest.mark.slow  # a pretraining loop (the fast tier's minute)
def test_a_group_padded_to_a_power_of_two_counts_each_real_trial_once(
    tmp_path, monkeypatch):
  """3 running trials at trials_per_vmap = 4 (as on the gpu preset once a
  trial stops): the step runs on 4 rows, a copy of the first trial padding
  the group, but the run writes exactly one metrics line per trial per
  evaluation, and each progress line's loss is the mean over the real
  trials of their own curves' losses (a padded copy counted would weigh
  trial 0 twice: (2 l0 + l1 + l2) / 4)."""
  pytest.importorskip("tensorboardX")
  from hmmprompt.pretrain import curves
  cfg = dataclasses.replace(TINY, target_gap=0.5, trials_per_vmap=4)
  stacked = generative.random_models(jax.random.PRNGKey(5), 3, "vanilla", 6,
                                     10)
  shapes = []
  make = pretrain_train.make_train_step

  def recording(cfg, mesh):
    step = make(cfg, mesh)

    def counted(states, *args):
      shapes.append(int(states.step.shape[0]))
      return step(states, *args)
    return counted

  monkeypatch.setattr(pretrain_train, "make_train_step", recording)
  workdir, logs = str(tmp_path), []
  final = pretrain.run_trials(workdir, cfg, stacked, log=logs.append)
  assert shapes[0] == 4  # 3 trials padded to 4: the path under test
  lines = [json.loads(l) for l in open(os.path.join(workdir,
                                                    "metrics.jsonl"))]
  for k in range(3):
    steps = [m["step"] for m in lines if m["trial"] == k]
    # Every evaluation up to the trial's stop, each once.
    assert steps == list(range(cfg.eval_every, final[k]["step"] + 1,
                               cfg.eval_every))
  assert len(lines) == sum(m["step"] // cfg.eval_every for m in final)
  train_loss = [dict(curves.read_scalars(curves.trial_logdir(workdir, k))
                     ["by_step/train_loss"]) for k in range(3)]
  flushes = [l.split() for l in logs if re.match(r"step \d+/\d+ loss ", l)]
  assert len(flushes) == cfg.total_steps // cfg.log_every
  for words in flushes:
    step = int(words[1].split("/")[0])
    ran = [t[step] for t in train_loss if step in t]  # the trials stepping
    assert ran and len(ran) == sum(m["step"] >= step for m in final)
    # The line rounds to 4 decimals; the two means differ by rounding.
    assert float(words[3]) == pytest.approx(np.mean(ran), abs=6e-5)


@pytest.mark.slow  # a pretraining loop (the fast tier's minute)
def test_a_deadline_stops_between_steps_with_a_checkpoint_to_resume(
    tmp_path, monkeypatch):
  """``stop_at``: past it the stack stops after the step in hand, saves
  that step (not an evaluation or checkpoint step) and raises; the rerun
  resumes there and ends as the run never stopped, bit for bit."""
  cfg = dataclasses.replace(TINY, target_gap=0.5)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  whole = pretrain.run_trials(str(tmp_path / "whole"), cfg, stacked,
                              log=lambda s: None)
  # Finished, a trial at the step cap included: nothing trains on.
  assert cfg.total_steps in [m["step"] for m in whole]
  assert pretrain.running_at_checkpoint(str(tmp_path / "whole")) == []
  now = [0.0]
  monkeypatch.setattr(pretrain_loop, "_clock", lambda: now[0])

  def late_after_7(step):
    if step == 7:
      now[0] = 100.0

  workdir = str(tmp_path / "cut")
  with pytest.raises(pretrain.DeadlineReached, match="^" + re.escape(
      f"the deadline came at pretraining step 7 of {workdir} (checkpointed: "
      f"a rerun resumes there)") + "$"):
    pretrain.run_trials(workdir, cfg, stacked, log=lambda s: None,
                        after_step=late_after_7, stop_at=50.0)
  assert 7 % cfg.ckpt_every and 7 % cfg.eval_every  # an ordinary step
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  assert ckpts.latest_step() == 7
  ckpts.close()
  logs = []
  again = pretrain.run_trials(workdir, cfg, stacked, log=logs.append)
  assert "resumed 2 trials from step 7" in logs
  drop = lambda d: {a: b for a, b in d.items() if a != "wall_s"}
  assert [drop(m) for m in again] == [drop(m) for m in whole]
  jax.tree.map(np.testing.assert_array_equal,
               pretrain.load_trials(workdir)[1],
               pretrain.load_trials(str(tmp_path / "whole"))[1])


@pytest.mark.slow  # a pretraining loop (the fast tier's minute)
def test_deadline_checkpoints_are_written_only_at_the_stop_and_resume(
    tmp_path, monkeypatch):
  """``checkpoints="deadline"`` (an accelerator command's kept workdir):
  no checkpoint at ``ckpt_every`` or at a trial's stop; at ``stop_at``,
  less the time to write it, one checkpoint of every trial (the stopped
  one too, which has no other copy); the rerun resumes it and hands over
  the params of the run that never stopped, bit for bit; a run that
  meets no deadline leaves no checkpoint."""
  cfg = dataclasses.replace(TINY, target_gap=0.5)
  stacked = generative.random_models(jax.random.PRNGKey(5), 3, "vanilla", 6,
                                     10)
  quiet = lambda s: None
  _, whole, whole_infos = pretrain.train_trials(str(tmp_path / "whole"), cfg,
                                                stacked, log=quiet)
  steps = [info.step for info in whole_infos]
  assert min(steps) == cfg.eval_every < max(steps)  # one stops, one runs on
  monkeypatch.setattr(pretrain_loop, "_clock", _step_clock())
  # Writing 3 trials takes 4 "seconds": the stop comes at step 31 - 4.
  trial_bytes = _three_trials_in_4_s(monkeypatch, cfg)
  workdir, logs = str(tmp_path / "cut"), []
  with pytest.raises(pretrain.DeadlineReached, match=re.escape(
      f"the deadline came at pretraining step 27 of {workdir} "
      f"(checkpointed: a rerun resumes there)")):
    pretrain.train_trials(workdir, cfg, stacked, log=logs.append,
                          stop_at=31.0, checkpoints="deadline")
  assert 27 % cfg.ckpt_every and 27 > cfg.eval_every
  said, = [line for line in logs if "at the deadline" in line]
  assert said.startswith(f"checkpoint of step 27 at the deadline: "
                         f"{3 * trial_bytes / 1e9:.2f} GB in ")
  assert said.endswith(" MB/s; 4.0 s kept for it)")
  assert 0 <= float(said.split(" GB in ")[1].split(" s ")[0]) < 60
  ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
  assert ckpts.all_steps() == [27]  # not 10 or 20
  assert ckpts.item_tree(27)["trials"].shape == (3,)  # stopped ones too
  ckpts.close()
  assert not os.listdir(os.path.join(workdir, "stopped"))
  # What a deadline's estimate counts: the trials a rerun still trains.
  running = [k for k, step in enumerate(steps) if step > cfg.eval_every]
  assert pretrain.running_at_checkpoint(workdir) == running
  assert pretrain.running_at_checkpoint(str(tmp_path / "whole")) is None
  monkeypatch.setattr(pretrain_loop, "_clock", time.monotonic)
  logs = []
  _, again, infos = pretrain.train_trials(workdir, cfg, stacked,
                                          log=logs.append,
                                          checkpoints="deadline")
  assert "resumed 3 trials from step 27" in logs
  jax.tree.map(np.testing.assert_array_equal, again, whole)
  drop = lambda d: {a: b for a, b in d.items() if a != "wall_s"}
  assert [(i.step, drop(i.metrics)) for i in infos] == [
      (i.step, drop(i.metrics)) for i in whole_infos]
  # Its checkpoint stays: a rerun (its tuning cut) trains them from there.
  assert pretrain.running_at_checkpoint(workdir) == running
  # Ending past keep_by (step 40's clock reads 40, the end's 41), it saves
  # every trial first: a rerun (the tuning cut) trains nothing.
  monkeypatch.setattr(pretrain_loop, "_clock", _step_clock())
  late, logs = str(tmp_path / "late"), []
  pretrain.train_trials(late, cfg, stacked, log=logs.append, stop_at=99.0,
                        checkpoints="deadline", keep_by=41.0)
  said, = [line for line in logs if "checkpoint of step" in line]
  assert said.startswith(f"checkpoint of step {cfg.total_steps} before a "
                         f"tuning the deadline would cut: ")
  assert pretrain.running_at_checkpoint(late) == []
  monkeypatch.setattr(pretrain_loop, "_clock", time.monotonic)
  logs = []
  _, again, _ = pretrain.train_trials(late, cfg, stacked, log=logs.append,
                                      checkpoints="deadline")
  assert f"resumed 3 trials from step {cfg.total_steps}" in logs
  assert not [line for line in logs if line.startswith("step ")]
  jax.tree.map(np.testing.assert_array_equal, again, whole)
  # A run the deadline never stops, ending before keep_by, writes none;
  # "always" is run_trials'.
  fresh = str(tmp_path / "fresh")
  pretrain.train_trials(fresh, cfg, stacked, log=quiet,
                        stop_at=time.monotonic() + 600,
                        checkpoints="deadline",
                        keep_by=time.monotonic() + 600)
  assert not os.listdir(os.path.join(fresh, "checkpoints"))
  assert pretrain.running_at_checkpoint(fresh) is None
  for bad, refusal in (
      ("always", "train_trials writes no periodic checkpoints: use "
       "run_trials, then load_trials"),
      ("sometimes", "checkpoints must be one of ('always', 'deadline', "
       "'never'), got 'sometimes'")):
    with pytest.raises(ValueError, match=f"^{re.escape(refusal)}$"):
      pretrain.train_trials(fresh, cfg, stacked, checkpoints=bad)


def test_running_at_checkpoint_reads_the_evaluations_up_to_it(tmp_path):
  """What a rerun still trains, from the files alone: the trials whose
  evaluations up to the newest checkpoint do not stop them (one at its
  target before it; one reaching it only after it still trains), none at
  the step cap, ``None`` without a checkpoint (nothing made on disk);
  with cycles, a trial at its target stops only at a cycle's end."""
  cfg = TINY.with_overrides(target_gap=0.5, eval_every=10, cycles=(20, 20))
  models = generative.random_models(jax.random.PRNGKey(5), 3, "vanilla", 6,
                                    10)
  workdir = str(tmp_path)
  paths = pretrain_workdir.prepare(workdir, cfg, models)
  assert pretrain.running_at_checkpoint(workdir) is None
  assert not os.path.exists(paths.ckpt)
  line = lambda k, step, gap: {"trial": k, "step": step, "ce_gap": gap}
  pretrain_workdir.write_metrics(paths, [
      line(0, 10, 0.9), line(1, 10, 0.1), line(2, 10, 0.9),
      line(0, 20, 0.1), line(1, 20, 0.9), line(2, 20, 0.9),
      line(1, 30, 0.9), line(2, 30, 0.1), line(1, 40, 0.1)])
  ckpts = ckpt_lib.Checkpoints(paths.ckpt)
  for step in (20, 30):
    ckpts.save(step, {"x": jnp.zeros(2)})
  ckpts.close()
  assert pretrain.running_at_checkpoint(workdir) == [1, 2]
  ckpts = ckpt_lib.Checkpoints(paths.ckpt)
  ckpts.save(cfg.total_steps, {"x": jnp.zeros(2)})
  ckpts.close()
  assert pretrain.running_at_checkpoint(workdir) == []


@pytest.mark.slow  # two pretraining loops (the fast tier's minute)
def test_a_deadline_stops_earlier_by_the_checkpoint_it_writes(
    tmp_path, monkeypatch):
  """The time kept for the stop's checkpoint is that of the rows it
  writes: ``always`` the trials still running (the stopped one is in
  ``stopped/``), ``never`` none: no checkpoint, no time kept."""
  cfg = dataclasses.replace(TINY, target_gap=0.5)
  stacked = generative.random_models(jax.random.PRNGKey(5), 3, "vanilla", 6,
                                     10)
  _three_trials_in_4_s(monkeypatch, cfg)
  for name, train, step in (
      ("always", pretrain.run_trials, 29),  # 2 rows: 8/3 s before 31
      ("never", pretrain.train_trials, 31)):
    monkeypatch.setattr(pretrain_loop, "_clock", _step_clock())
    workdir = str(tmp_path / name)
    checkpointed = " (checkpointed: a rerun resumes there)"
    with pytest.raises(pretrain.DeadlineReached, match=re.escape(
        f"the deadline came at pretraining step {step} of {workdir}"
        f"{checkpointed if name == 'always' else ''}") + "$"):
      train(workdir, cfg, stacked, log=lambda s: None, stop_at=31.0)
    if name == "always":
      ckpts = ckpt_lib.Checkpoints(os.path.join(workdir, "checkpoints"))
      assert ckpts.latest_step() == 29
      assert ckpts.item_tree(29)["trials"].shape == (2,)  # running ones
      ckpts.close()
      assert os.listdir(os.path.join(workdir, "stopped"))
    else:
      assert not os.path.exists(os.path.join(workdir, "checkpoints"))


@pytest.mark.slow
def test_step_bytes_counts_the_state_and_scales_with_what_steps_at_once(
    model):
  """XLA's buffer sizes of the stacked step, compiled on shapes: the state
  is the stack's, the temporaries grow with the batch and with trials
  vmapped together instead of one after another."""
  cfg = TINY.with_overrides(targets="exact")
  mesh = sharding.data_mesh()
  hmms = jax.tree.map(lambda x: jnp.stack([x, x]), model)  # K = 2
  states = pretrain.init_states(jax.random.split(jax.random.PRNGKey(0), 2),
                                cfg)
  # Each trial's step counter: an int32 0 (checkpoints store it so).
  assert states.step.dtype == jnp.int32 and states.step.tolist() == [0, 0]
  mem = lambda **kw: pretrain.step_bytes(cfg.with_overrides(**kw), hmms,
                                          mesh)
  one_at_a_time = mem(trials_per_vmap=1)
  assert one_at_a_time["state_bytes"] == sum(
      x.nbytes for x in jax.tree.leaves(states))
  assert one_at_a_time["argument_bytes"] >= one_at_a_time["state_bytes"]
  # The step returns the new state (and the losses).
  assert one_at_a_time["output_bytes"] >= one_at_a_time["state_bytes"]
  assert mem(trials_per_vmap=0)["temp_bytes"] > one_at_a_time["temp_bytes"]
  # Groups of 2 of the 2: the one vmap's temporaries.
  assert mem(trials_per_vmap=2)["temp_bytes"] > one_at_a_time["temp_bytes"]
  assert mem(trials_per_vmap=1, batch_size=32)["temp_bytes"] > (
      one_at_a_time["temp_bytes"])
  # One model with sampled targets (the tokens): half the stack's state
  # (a stack of one runs unbatched, whatever trials_per_vmap says).
  one = pretrain.step_bytes(
      TINY.with_overrides(targets="sampled", trials_per_vmap=0),
      jax.tree.map(lambda x: x[None], model), mesh)
  assert 2 * one["state_bytes"] == one_at_a_time["state_bytes"]


RUNTIME_FIELDS = {"log_every": 7, "ckpt_every": 5, "keep": 5,
                  "eval_batch": 3, "trials_per_vmap": 0,
                  "exact_method": "parallel", "exact_window": 4}


@pytest.mark.slow
def test_runtime_fields_resume_and_reuse_result_fields_are_refused(
    trained, model, monkeypatch):
  """Changing a runtime field keeps the run's identity: the finished run is
  reused as it is (nothing trains), and the sweep's pretraining directory
  and fingerprint stay. A result-deciding field is refused by name."""
  workdir, final = trained
  from hmmprompt.figure3 import configs as fig_configs
  from hmmprompt import protocol
  setup = fig_configs.get_setup("tiny")
  mid = protocol.vanilla(4)
  pdir, fp = (protocol.pretrain_dir("W", setup, mid),
              setup.fingerprint("transformer"))

  def boom(*a, **k):
    raise AssertionError("a runtime field re-ran finished work")

  monkeypatch.setattr(pretrain_train, "make_train_step", boom)
  for field, value in RUNTIME_FIELDS.items():
    cfg = dataclasses.replace(TINY, **{field: value})
    assert cfg.identity() == TINY.identity()
    assert pretrain.run(workdir, cfg, model, log=lambda s: None) == final
    other = dataclasses.replace(
        setup, pretrain=dataclasses.replace(setup.pretrain, **{field: value}))
    assert protocol.pretrain_dir("W", other, mid) == pdir
    assert other.fingerprint("transformer") == fp
  monkeypatch.undo()
  for field, value, named in [
      ("lr", 1e-3, "lr: 0.003 -> 0.001"), ("steps", 60, "steps: 40 -> 60"),
      ("model", dataclasses.replace(TINY.model, d_model=16),
       "model.d_model: 32 -> 16")]:
    cfg = dataclasses.replace(TINY, **{field: value})
    with pytest.raises(ValueError, match=re.escape(named)):
      pretrain.run(workdir, cfg, model)
    other = dataclasses.replace(
        setup, pretrain=dataclasses.replace(setup.pretrain, **{field: value}))
    assert protocol.pretrain_dir("W", other, mid) != pdir
    assert other.fingerprint("transformer") != fp


def _damage(step_dir: str, how: str) -> None:
  if how == "item folder missing":  # a partial copy between machines
    shutil.rmtree(os.path.join(step_dir, "default"))
  else:  # every data file overwritten
    for root, _, files in os.walk(step_dir):
      for name in files:
        if "metadata" not in name.lower() and "commit" not in name:
          with open(os.path.join(root, name), "wb") as f:
            f.write(b"\0garbage" * 8)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["item folder missing", "data corrupted"])
def test_damaged_newest_checkpoint_falls_back_and_ends_as_uninterrupted(
    tmp_path, trained, model, how):
  """Killed after step 30 (checkpoints 20 and 30 kept), the newest then
  damaged: the rerun warns naming step 30, resumes from 20 and ends bit
  for bit as the uninterrupted run; the damaged one is set aside. With no
  readable checkpoint left, the error names the folder."""
  workdir, final = trained
  crashed = str(tmp_path / "crashed")

  crash = _crash_after(30)
  with pytest.raises(_Crash):
    pretrain.run(crashed, TINY, model, log=lambda s: None, after_step=crash)
  ckpt_dir = os.path.join(crashed, "checkpoints")
  assert sorted(os.listdir(ckpt_dir)) == ["20", "30"]
  _damage(os.path.join(ckpt_dir, "30"), how)
  logs = []
  again = pretrain.run(crashed, TINY, model, log=logs.append)
  assert any("checkpoint at step 30" in l and "unreadable" in l
             for l in logs), logs
  assert "resumed from step 20" in logs
  drop = lambda m: {k: v for k, v in m.items() if k != "wall_s"}
  assert drop(again) == drop(final)
  for a, b in zip(jax.tree.leaves(pretrain.load_backbone(crashed)[1]),
                  jax.tree.leaves(pretrain.load_backbone(workdir)[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert os.listdir(ckpt_dir + ".damaged")[0].startswith("30-")

  for step in os.listdir(ckpt_dir):
    _damage(os.path.join(ckpt_dir, step), how)
  with pytest.raises(FileNotFoundError,
                     match=f"no readable checkpoint in {re.escape(ckpt_dir)}"
                     ".*step 40.*step 30"):
    pretrain.run(crashed, TINY, model, log=lambda s: None)


@pytest.mark.slow
def test_a_failed_restores_orphaned_tasks_log_nothing(caplog):
  """An orbax restore that fails on a damaged checkpoint leaves sibling
  asyncio tasks whose tensorstore errors nobody retrieves; asyncio logged
  each with its traceback when collected (a rerun's stderr, in CI) after
  restore_latest's one line. Those are dropped, and only those."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top

  async def fail(message):
    raise ValueError(message)

  def orphan(message):
    loop = asyncio.new_event_loop()
    task = loop.create_task(fail(message))
    loop.run_until_complete(asyncio.sleep(0))  # it runs and fails
    loop.close()
    del task
    gc.collect()

  damaged = ('DATA_LOSS: Error opening "zarr" driver: Error reading '
             '"states.step/.zarray" [tensorstore_spec=\'{"driver": "zarr"}\']')
  own = "a task of the caller's own"
  gc.collect()  # earlier tests' orphans (real restores') go before capture
  with caplog.at_level(logging.ERROR, logger="asyncio"):
    orphan(damaged)
    orphan(own)
  (record,) = [r for r in caplog.records if r.name == "asyncio"
               and r.exc_info and str(r.exc_info[1]) in (damaged, own)]
  assert record.getMessage().startswith("Task exception was never retrieved")
  assert str(record.exc_info[1]) == own


@pytest.mark.slow
def test_evaluations_past_the_restored_checkpoint_are_redone_once(
    tmp_path, trained, model):
  """A finished run (checkpoints 30 and 40, lines at 20 and 40) whose
  newest checkpoint is lost resumes from 30: step 40's line, past it, is
  dropped and redone, so the lines are the uninterrupted run's, once."""
  workdir = str(tmp_path / "copy")
  shutil.copytree(trained[0], workdir)
  _damage(os.path.join(workdir, "checkpoints", "40"), "item folder missing")
  logs = []
  final = pretrain.run(workdir, TINY, model, log=logs.append)
  assert "resumed from step 30" in logs
  drop = lambda m: {a: b for a, b in m.items() if a != "wall_s"}
  got = pretrain_workdir.read_metrics(pretrain_workdir.Paths.of(workdir))
  want = pretrain_workdir.read_metrics(pretrain_workdir.Paths.of(trained[0]))
  assert [drop(m) for m in got] == [drop(m) for m in want]
  assert drop(final) == drop(trained[1])


def test_layout1_one_model_run_is_refused_by_name(tmp_path, model):
  """A one-model workdir written before layout 2 (bare config.json, an
  unstacked model and checkpoint) is refused by name, resume and load."""
  old = str(tmp_path / "old")
  os.makedirs(old)
  with open(os.path.join(old, "config.json"), "w") as f:
    json.dump(TINY.to_json(), f)
  generative.save(os.path.join(old, "hmm.npz"), model)
  for call in (lambda: pretrain.run(old, TINY, model),
               lambda: pretrain.load_backbone(old)):
    with pytest.raises(ValueError, match="^" + re.escape(
        f"{old} holds a one-model run of layout 1")):
      call()


@pytest.mark.slow
def test_load_retained_stacks_every_retained_step_of_every_trial(tmp_path):
  """``retain=(0, 10, 20)`` of a 2-stack: ``params_QxK[2, k]`` is trial
  ``k``'s state at step 20 (what the same run killed there holds), step 0's
  another, and each trial's info names its config, model and steps."""
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  cfg = dataclasses.replace(TINY, retain=(0, 10, 20))
  workdir = str(tmp_path / "run")
  pretrain.run_trials(workdir, cfg, stacked, log=lambda s: None)
  _, params_QxK, steps, infos = pretrain_workdir.load_retained(workdir)
  assert steps == [0, 10, 20]
  # evaluate_checkpoints: at an evaluation step (20), trial k's line of
  # metrics.jsonl (the same params and validation set); at the others, the
  # same measure of that step's state.
  metrics_QxK = pretrain.evaluate_checkpoints(cfg, stacked, params_QxK)
  assert [len(row) for row in metrics_QxK] == [2, 2, 2]
  lines = pretrain_workdir.read_metrics(pretrain_workdir.Paths.of(workdir))
  for k in range(2):
    (line,) = [m for m in lines if (m["trial"], m["step"]) == (k, 20)]
    assert metrics_QxK[2][k] == {a: b for a, b in line.items()
                                 if a not in ("trial", "step", "wall_s")}
    gaps = [metrics_QxK[q][k]["ce_gap"] for q in range(3)]
    assert gaps[0] > gaps[1] > gaps[2] > 0, gaps  # training closes the gap
  assert metrics_QxK[0][0] != metrics_QxK[0][1]  # each trial's own HMM
  # The same run killed after step 20 (a checkpoint step) holds step 20.
  crashed = str(tmp_path / "crashed")
  with pytest.raises(_Crash):
    pretrain.run_trials(crashed, dataclasses.replace(cfg, retain=()),
                        stacked, log=lambda s: None,
                        after_step=_crash_after(20))
  at_20 = pretrain.load_trials(crashed)[1]
  equal = lambda a, b: np.testing.assert_array_equal(np.asarray(a),
                                                     np.asarray(b))
  jax.tree.map(lambda a, b: equal(a[2], b), params_QxK, at_20)
  assert not all(np.array_equal(np.asarray(a[0]), np.asarray(a[2]))
                 for a in jax.tree.leaves(params_QxK))
  for k, info in enumerate(infos):
    assert info["config"] == cfg and info["steps"] == [0, 10, 20]
    assert generative.same(info["model"], generative.trial(stacked, k))


def test_a_run_killed_before_its_first_checkpoint_loads_nothing(tmp_path,
                                                               model):
  crashed = str(tmp_path / "crashed")
  with pytest.raises(_Crash):
    pretrain.run(crashed, TINY, model, log=lambda s: None,
                 after_step=_crash_after(TINY.ckpt_every - 1))
  ckpt = pretrain_workdir.Paths.of(crashed).ckpt
  with pytest.raises(FileNotFoundError, match="^" + re.escape(
      f"no checkpoints in {ckpt}") + "$"):
    pretrain.load_trials(crashed)


def test_a_fallback_line_is_the_deeper_runs_with_both_wall_times():
  shallow = {"trial": 1, "step": 40, "ce_gap": 0.3, "wall_s": 2.5}
  deep = {"trial": 0, "step": 30, "ce_gap": 0.02, "wall_s": 4.0, "tv": 0.1}
  assert pretrain_workdir.fallback_line(shallow, deep, 1, 4) == {
      "trial": 1, "step": 30, "ce_gap": 0.02, "wall_s": 6.5, "tv": 0.1,
      "layers": 4}


@pytest.mark.slow
def test_tensorboard_curves_per_trial_read_back_across_a_resume(tmp_path):
  """Each trial's TensorBoard run holds its evaluations (the values of
  metrics.jsonl), training loss and throughput, against steps and tokens.
  Killed after a log line past its checkpoint, the rerun adds an event file
  whose rewritten steps replace the old points (TensorBoard's rule, which
  read_scalars follows), equal to them (resumes are bit-exact)."""
  pytest.importorskip("tensorboardX")
  from hmmprompt.pretrain import curves
  cfg = dataclasses.replace(TINY, ckpt_every=20)  # log at 30, ckpt at 20
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6, 10)
  workdir = str(tmp_path)

  crash = _crash_after(35)
  with pytest.raises(_Crash):
    pretrain.run_trials(workdir, cfg, stacked, log=lambda s: None,
                        after_step=crash)
  before = [curves.read_scalars(curves.trial_logdir(workdir, k))
            for k in range(2)]
  assert [s for s, _ in before[1]["by_step/train_loss"]] == [10, 20, 30]
  logs = []
  pretrain.run_trials(workdir, cfg, stacked, log=logs.append)
  assert logs[0] == "resumed 2 trials from step 20"
  assert f"TensorBoard curves: tensorboard --logdir {workdir}/tb" in logs
  assert sorted(os.listdir(os.path.join(workdir, "tb"))) == ["trial_0",
                                                             "trial_1"]
  lines = [json.loads(l) for l in open(os.path.join(workdir,
                                                    "metrics.jsonl"))]
  tokens = cfg.batch_size * cfg.corpus.chunk_len
  names = ("train_loss", "tokens_per_s") + curves.EVAL_KEYS
  losses = []
  for k in range(2):
    logdir = curves.trial_logdir(workdir, k)
    assert len(os.listdir(logdir)) == 2  # one event file per process
    got = curves.read_scalars(logdir)
    assert set(got) == {f"{a}/{n}" for a in curves.AXES for n in names}
    for name in names:
      by_step, by_tokens = got[f"by_step/{name}"], got[f"by_tokens/{name}"]
      assert by_tokens == [(s * tokens, v) for s, v in by_step]
    mine = [m for m in lines if m["trial"] == k]
    for key in curves.EVAL_KEYS:
      assert got[f"by_step/{key}"] == [(m["step"], np.float32(m[key]))
                                       for m in mine]
    assert [s for s, _ in got["by_step/train_loss"]] == [10, 20, 30, 40]
    # The rewritten steps equal the killed run's points.
    assert got["by_step/train_loss"][:3] == before[k]["by_step/train_loss"]
    assert got["by_step/ce_gap"][:1] == before[k]["by_step/ce_gap"]
    assert all(v > 0 for _, v in got["by_step/tokens_per_s"])
    losses.append(dict(got["by_step/train_loss"]))
  # The log line's loss is the mean over both trials; its tokens/s counts
  # both, each trial's curve its share (the line rounds to 0.1k: 50).
  logged = [l for l in logs if l.startswith("step 40/40 loss ")][0]
  assert float(logged.split()[3]) == pytest.approx(
      (losses[0][40] + losses[1][40]) / 2, abs=1e-4)
  rate = float(logged.split()[4].removesuffix("k")) * 1e3
  for k in range(2):
    got = dict(curves.read_scalars(curves.trial_logdir(
        workdir, k))["by_step/tokens_per_s"])
    assert 2 * got[40] == pytest.approx(rate, abs=51)


def test_curves_match_losses_to_trials_and_skip_without_tensorboardx(
    tmp_path, monkeypatch):
  """A log window in which the stack lost a trial averages each trial over
  its own steps; without tensorboardX nothing is written and the log line
  says why."""
  pytest.importorskip("tensorboardX")
  from hmmprompt.pretrain import curves
  c = curves.Curves(str(tmp_path), tokens_per_step=100)
  c.add_losses(np.array([0, 1]), jnp.array([1.0, 2.0]))
  c.add_losses(np.array([0, 1]), jnp.array([3.0, 4.0]))
  c.add_losses(np.array([1]), jnp.array([9.0]))  # trial 0 stopped
  c.train(3, tokens_per_s=50.0)
  c.eval({"trial": 1, "step": 3, "mlm_ce": 2.5, "bayes_ce": 2.0,
          "ce_gap": 0.5, "tv": 0.25, "wall_s": 1.0})
  t0 = curves.read_scalars(curves.trial_logdir(str(tmp_path), 0))
  t1 = curves.read_scalars(curves.trial_logdir(str(tmp_path), 1))
  assert t0 == {"by_step/train_loss": [(3, 2.0)],
                "by_tokens/train_loss": [(300, 2.0)],
                "by_step/tokens_per_s": [(3, 50.0)],
                "by_tokens/tokens_per_s": [(300, 50.0)]}
  assert t1["by_step/train_loss"] == [(3, 5.0)]
  assert t1["by_tokens/ce_gap"] == [(300, 0.5)]
  assert t1["by_step/tv"] == [(3, 0.25)]
  # A killed writer's torn last record ends its file.
  path = os.path.join(curves.trial_logdir(str(tmp_path), 1),
                      os.listdir(curves.trial_logdir(str(tmp_path), 1))[0])
  with open(path, "ab") as f:
    f.write(b"\x40" + b"\0" * 11)  # a header promising 64 bytes
  assert curves.read_scalars(curves.trial_logdir(str(tmp_path), 1)) == t1

  monkeypatch.setattr(curves, "event_pb2", None)
  off = curves.Curves(str(tmp_path / "off"), tokens_per_step=100)
  assert not off.enabled and "tensorboardX is not installed" in off.status
  off.add_losses(np.array([0]), jnp.array([1.0]))
  off.train(1, 1.0)
  off.eval({"trial": 0, "step": 1, "mlm_ce": 1.0, "bayes_ce": 1.0,
            "ce_gap": 0.0, "tv": 0.0})
  assert not os.path.exists(tmp_path / "off")
  with pytest.raises(ImportError, match="^" + re.escape(
      "reading event files needs tensorboardX: pip install "
      "'hmmprompt[tensorboard]'") + "$"):
    curves.read_scalars(str(tmp_path))


def test_event_files_are_tensorboardx_records_both_ways(tmp_path):
  """Two independent codecs: what tensorboardX's own SummaryWriter writes
  (the files TensorBoard reads) read_scalars reads, a rewritten step
  replacing the later points; what Curves writes, re-framed record by
  record with tensorboardX's RecordWriter, is the same bytes, and decodes
  to the events named in the module's docstring."""
  pytest.importorskip("tensorboardX")
  import struct
  from tensorboardX import SummaryWriter
  from tensorboardX import record_writer
  from tensorboardX.proto import event_pb2
  from hmmprompt.pretrain import curves
  theirs = str(tmp_path / "theirs")
  writer = SummaryWriter(theirs)
  for value, step in ((1.0, 1), (2.0, 5), (0.5, 9), (3.0, 3)):
    writer.add_scalar("by_step/tv", value, step)
  writer.close()
  assert curves.read_scalars(theirs) == {"by_step/tv": [(1, 1.0), (3, 3.0)]}

  ours = curves.Curves(str(tmp_path / "ours"), tokens_per_step=7)
  before = time.time()
  ours.add_losses(np.array([2]), jnp.array([0.75]))
  ours.train(4, tokens_per_s=12.5)
  ours.eval({"trial": 2, "step": 4, "mlm_ce": 1.5, "bayes_ce": 1.25,
             "ce_gap": 0.25, "tv": 0.125, "wall_s": 3.0})
  after = time.time()
  logdir = curves.trial_logdir(str(tmp_path / "ours"), 2)
  assert logdir == str(tmp_path / "ours" / "tb" / "trial_2")
  (name,) = os.listdir(logdir)
  # TensorBoard's name, seconds first (files sort by them), then the
  # nanoseconds that order two files of one second.
  prefix, seconds, rest = re.fullmatch(
      r"(events\.out\.tfevents)\.(\d+)\.(.*)", name).groups()
  host, ns, pid = rest.rsplit(".", 2)
  assert (host, int(pid)) == (socket.gethostname(), os.getpid())
  assert int(seconds) == int(ns) // 10**9
  assert int(before) <= int(seconds) <= after
  with open(os.path.join(logdir, name), "rb") as f:
    blob = f.read()
  records, at = [], 0
  while at < len(blob):
    (size,) = struct.unpack("<Q", blob[at:at + 8])
    records.append(blob[at + 12:at + 12 + size])
    at += 12 + size + 4
  assert at == len(blob)
  again = str(tmp_path / "again")
  rw = record_writer.RecordWriter(again)
  for data in records:
    rw.write(data)
  rw.close()
  with open(again, "rb") as f:
    assert f.read() == blob
  events = [event_pb2.Event.FromString(d) for d in records]
  assert events[0].file_version == "brain.Event:2"
  assert events[0].wall_time == int(ns) / 1e9
  assert all(before <= e.wall_time <= after for e in events)
  got = [(e.step, {v.tag: v.simple_value for v in e.summary.value})
         for e in events[1:]]
  train = {"train_loss": 0.75, "tokens_per_s": 12.5}
  evals = {"mlm_ce": 1.5, "bayes_ce": 1.25, "ce_gap": 0.25, "tv": 0.125}
  assert got == [(4, {f"by_step/{k}": v for k, v in train.items()}),
                 (28, {f"by_tokens/{k}": v for k, v in train.items()}),
                 (4, {f"by_step/{k}": v for k, v in evals.items()}),
                 (28, {f"by_tokens/{k}": v for k, v in evals.items()})]

  # A flipped byte in a record's data or in a length's checksum is named.
  path = os.path.join(logdir, name)
  second = 12 + len(records[0]) + 4  # where record 1 starts
  for at in (second + 12 + 3, second + 9):
    bad = bytearray(blob)
    bad[at] ^= 1
    with open(path, "wb") as f:
      f.write(bytes(bad))
    with pytest.raises(ValueError, match="^" + re.escape(
        f"{path}: corrupted record at byte {second}") + "$"):
      curves.read_scalars(logdir)
  # A line without a trial (a one-model run's) is trial 0's.
  ours.eval({"step": 5, "mlm_ce": 1.0, "bayes_ce": 1.0, "ce_gap": 0.0,
             "tv": 0.0})
  assert curves.read_scalars(curves.trial_logdir(
      str(tmp_path / "ours"), 0))["by_step/tv"] == [(5, 0.0)]


def test_curves_say_where_they_go_and_only_process_0_writes(tmp_path,
                                                            monkeypatch):
  pytest.importorskip("tensorboardX")
  from hmmprompt.pretrain import curves
  on = curves.Curves(str(tmp_path / "run"), tokens_per_step=1)
  assert on.enabled and on.status == (
      f"TensorBoard curves: tensorboard --logdir {tmp_path}/run/tb")
  monkeypatch.setattr(curves.jax, "process_index", lambda: 1)
  other = curves.Curves(str(tmp_path / "other"), tokens_per_step=1)
  assert not other.enabled and other.status is None
  other.add_losses(np.array([0]), jnp.array([1.0]))
  other.train(1, 1.0)
  other.eval({"step": 1, "mlm_ce": 1.0, "bayes_ce": 1.0, "ce_gap": 0.0,
              "tv": 0.0})
  assert not os.path.exists(tmp_path / "other")
  monkeypatch.setattr(curves.jax, "process_index", lambda: 0)
  monkeypatch.setattr(curves, "event_pb2", None)
  assert curves.Curves(str(tmp_path), 1).status == (
      "no TensorBoard curves: tensorboardX is not installed (pip install "
      "'hmmprompt[tensorboard]')")


@pytest.mark.parametrize("retain", [(5, 5), (10, 3), (-1, 4), (0, 41),
                                    (0, 2.5), (True,), [0, 10]])
def test_retain_schedule_is_validated_by_name(retain):
  """``retain``: strictly increasing int steps within the run (0, the init,
  included); anything else is refused naming the field and the values."""
  with pytest.raises(ValueError,
                     match=re.escape(f"PretrainConfig.retain must be a tuple "
                                     f"of strictly increasing int steps in "
                                     f"[0, total_steps = 40], got "
                                     f"{retain!r}")):
    dataclasses.replace(TINY, retain=retain)


def test_retain_is_runtime_and_round_trips():
  """A schedule is a runtime field (the run is the same run without it);
  it survives config.json and the ``--config`` parser as a tuple."""
  cfg = dataclasses.replace(TINY, retain=(0, 10, 40))
  assert cfg.identity() == TINY.identity()
  assert pretrain.PretrainConfig.from_json(
      json.loads(json.dumps(cfg.to_json()))) == cfg
  assert config_flags.apply(TINY, {"retain": "0,10,40"}) == cfg
  old = TINY.to_json()
  del old["retain"]  # a config.json written before the field
  assert pretrain.PretrainConfig.from_json(old).retain == ()


def test_fallback_gaps_check_the_earlier_cycle_ends():
  """``fallback_gaps[i]``: a trial above it at the end of cycle ``i``
  falls back there (0: no check); ``fallback_gap`` keeps the last cycle
  end before the cap, ``target_gap`` the cap. Out of the identity at its
  default, a tuple through config.json, and refused by name where it
  cannot apply."""
  base = TINY.with_overrides(cycles=(10, 10, 10, 10), target_gap=0.05,
                             fallback_layers=TINY.model.num_layers + 1,
                             fallback_gap=0.2)
  cfg = base.with_overrides(fallback_gaps=(0.0, 0.4))
  falls = lambda step, gap: cfg.falls_back({"step": step, "ce_gap": gap})
  assert [falls(10, 9.0), falls(20, 0.41), falls(20, 0.39),
          falls(30, 0.21), falls(30, 0.19), falls(40, 0.051),
          falls(40, 0.05), falls(25, 9.0)] == [
              False, True, False, True, False, True, False, False]
  assert base.identity() == TINY.with_overrides(
      cycles=(10, 10, 10, 10), target_gap=0.05,
      fallback_layers=TINY.model.num_layers + 1,
      fallback_gap=0.2).identity()
  assert "fallback_gaps" not in json.dumps(base.identity())
  assert cfg.identity() != base.identity()
  assert pretrain.PretrainConfig.from_json(
      json.loads(json.dumps(cfg.to_json()))) == cfg
  assert config_flags.apply(base, {"fallback_gaps": "0,0.4"}) == cfg
  assert cfg.fallback(1).fallback_gaps == ()
  for bad in (dict(fallback_gap=0.0), dict(fallback_gaps=(0.4, 0.4, 0.4)),
              dict(fallback_gaps=(0.1,))):
    with pytest.raises(ValueError, match="fallback_gaps"):
      cfg.with_overrides(**bad)


def _fallback_line(logs, deeper: int, warm: bool) -> str:
  """The log line announcing trial 1's fallback at the cap (step 40), with
  the gap its own evaluation logged."""
  (gap,) = [s.split()[-3] for s in logs if s.startswith("trial 1 step 40: ")]
  return (f"trial 1: CE gap {gap} at step 40, above that step's fallback "
          f"check (target_gap at the cap, fallback_gap(s) before it); "
          f"pretraining it again with {deeper} layers"
          f"{' from it' if warm else ''}")


@pytest.mark.slow
def test_a_trial_short_of_the_target_at_the_cap_falls_back_to_depth(
    tmp_path, monkeypatch):
  """``fallback_layers``: the trial above the target at the cap trains
  again alone, as trial ``k`` with the deeper model (its line is that
  run's); the stack loads at the deeper depth, the trial that stopped in
  time padded with identity blocks (the same outputs); a rerun trains
  nothing."""
  deeper = TINY.model.num_layers + 1
  cfg = dataclasses.replace(TINY, target_gap=0.5, fallback_layers=deeper)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path / "stack")
  logs = []
  final = pretrain.run_trials(workdir, cfg, stacked, log=logs.append)
  # Trial 0 stops at step 20 (gap 0.29); trial 1 ends the cap above 0.5.
  assert [m["step"] for m in final] == [20, final[1]["step"]]
  assert "layers" not in final[0] and final[1]["layers"] == deeper
  assert final[1]["trial"] == 1  # the stack's trial (the deeper run's 0)
  assert [s for s in logs if s.startswith("trial 1: CE gap")] == [
      _fallback_line(logs, deeper, warm=False)]
  alone = pretrain.run_trials(str(tmp_path / "alone"), cfg.fallback(1),
                              generative.stack([generative.trial(stacked, 1)]),
                              log=lambda s: None)[0]
  drop = lambda d: {a: b for a, b in d.items()
                    if a not in ("wall_s", "trial", "layers")}
  assert drop(final[1]) == drop(alone)
  # Killed inside the fallback run (its step 10, the second step 10 seen),
  # the rerun finds the stack done and resumes the fallback run.
  seen = []

  def crash_in_fallback(step):
    seen.append(step)
    if seen.count(10) == 2:
      raise _Crash

  crashed = str(tmp_path / "crashed")
  with pytest.raises(_Crash):
    pretrain.run_trials(crashed, cfg, stacked, log=lambda s: None,
                        after_step=crash_in_fallback)
  logs = []
  again = pretrain.run_trials(crashed, cfg, stacked, log=logs.append)
  assert "resumed from step 10" in logs
  assert [drop(m) for m in again] == [drop(m) for m in final]

  backbone, params_k, infos = pretrain.load_trials(workdir)
  assert infos[1].metrics["layers"] == deeper
  assert infos[1].metrics["trial"] == 1  # the stack's trial, not 0
  # In memory (a chunk's temporary workdir): no checkpoint written, the
  # same params, infos and metrics files as the checkpointed run's.
  memory = str(tmp_path / "memory")
  saves = []
  monkeypatch.setattr(ckpt_lib.Checkpoints, "save",
                      lambda self, *a, **k: saves.append(a[0]))
  mem_bb, mem_k, mem_infos = pretrain.train_trials(memory, cfg, stacked,
                                                   log=lambda s: None)
  monkeypatch.undo()
  assert saves == [] and mem_bb is backbone
  assert not glob.glob(os.path.join(memory, "**", "checkpoints", "*"),
                       recursive=True)
  jax.tree.map(np.testing.assert_array_equal, mem_k, params_k)
  assert [drop(i.metrics) for i in mem_infos] == [
      drop(i.metrics) for i in infos]
  assert [(i.step, i.config) for i in mem_infos] == [
      (i.step, i.config) for i in infos]
  assert mem_infos[1].metrics["layers"] == deeper
  # Its wall time is both runs', each counted once (as written to disk).
  lines = lambda d: [json.loads(line) for line in open(
      os.path.join(d, "metrics.jsonl"))]
  shallow = [m for m in lines(memory) if m["trial"] == 1][-1]
  deep = lines(pretrain_workdir.fallback_dir(memory, 1))[-1]
  assert mem_infos[1].metrics["wall_s"] == shallow["wall_s"] + deep["wall_s"]
  assert all(generative.same(a.model, b.model)
             for a, b in zip(mem_infos, infos))
  assert generative.same(infos[1].model, generative.trial(stacked, 1))
  assert infos[1].config == cfg.fallback(1)
  assert infos[1].step == alone["step"] and "layers" not in infos[0].metrics
  _, alone_params = pretrain.load_backbone(str(tmp_path / "alone"))[:2]
  equal = lambda a, b: np.testing.assert_array_equal(np.asarray(a),
                                                     np.asarray(b))
  jax.tree.map(lambda a, b: equal(a[1], b), params_k, alone_params)
  # Trial 0 padded: the deeper backbone computes its shallow model's
  # function. The extra block adds exact zeros; the real blocks' float
  # sums may be ordered otherwise in the deeper program (a few ulps).
  shallow_bb, shallow_k, _ = pretrain.load_trials(
      _copy_without_fallbacks(workdir, str(tmp_path / "plain")))
  tokens = generative.sample_tokens(jax.random.PRNGKey(9),
                                    generative.trial(stacked, 0), 12)
  take0 = lambda t: jax.tree.map(lambda x: x[0], t)
  logits = lambda bb, p: jax.jit(lambda p: bb.apply(p, bb.embed(p, tokens)))(
      take0(p))
  want, got = logits(shallow_bb, shallow_k), logits(backbone, params_k)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  _assert_rerun_trains_nothing(workdir, cfg, stacked, final)
  with pytest.raises(ValueError, match="fallback_layers = 1 must be 0 or an "
                     "int above model.num_layers"):
    dataclasses.replace(TINY, target_gap=0.5, fallback_layers=1)


@pytest.mark.slow
def test_a_warm_fallback_starts_from_the_trial_as_it_stopped(tmp_path):
  """``fallback_init="warm"``: the deeper run starts from the shallow
  trial's state at its stop (the same function: its blocks, embeddings
  and output layer, then new blocks whose output projections are zero and
  whose other weights are their own init) with a fresh optimizer; its line
  is trial ``k``'s; a rerun trains nothing."""
  deeper = TINY.model.num_layers + 1
  cfg = dataclasses.replace(TINY, target_gap=0.5, fallback_layers=deeper,
                            fallback_init="warm", retain=(0,))
  assert cfg.fallback(1).fallback_init == "warm"  # in the deeper run's id
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path / "stack")
  logs = []
  final = pretrain.run_trials(workdir, cfg, stacked, log=logs.append)
  assert "layers" not in final[0] and final[1]["layers"] == deeper
  assert [s for s in logs if s.startswith("trial 1: CE gap")] == [
      _fallback_line(logs, deeper, warm=True)]
  # The stack's retained states are not trial 1's tuned model: refused.
  with pytest.raises(ValueError, match="^" + re.escape(
      f"trials [1] of {workdir} fell back to {deeper} layers: load_retained "
      f"reads the stack's own checkpoints only") + "$"):
    pretrain_workdir.load_retained(workdir)
  shallow_bb, shallow_k, _ = pretrain.load_trials(
      _copy_without_fallbacks(workdir, str(tmp_path / "plain")))
  stopped = jax.tree.map(lambda x: x[1], shallow_k)
  deep_bb, start_QxK, steps, _ = pretrain_workdir.load_retained(
      pretrain_workdir.fallback_dir(workdir, 1))
  assert steps == [0]
  start = jax.tree.map(lambda x: x[0, 0], start_QxK)
  grown, old = start["params"], stopped["params"]
  jax.tree.map(np.testing.assert_array_equal,
               {n: grown[n] for n in old}, old)  # the shallow model, exactly
  new = grown[f"block_{deeper - 1}"]
  for name, part in new.items():
    zero = all(not np.any(np.asarray(x)) for x in jax.tree.leaves(part))
    assert zero == (name in ("attn_out", "mlp_out")), name
  tokens = generative.sample_tokens(jax.random.PRNGKey(9),
                                    generative.trial(stacked, 1), 12)
  logits = lambda bb, p: jax.jit(lambda p: bb.apply(p, bb.embed(p, tokens)))(
      p)
  np.testing.assert_allclose(logits(deep_bb, start),
                             logits(shallow_bb, stopped), rtol=1e-5,
                             atol=1e-7)
  with pytest.raises(ValueError, match="not more than the"):
    depth.grow_layers(stopped, stopped)
  _assert_rerun_trains_nothing(workdir, cfg, stacked, final)
  with pytest.raises(ValueError, match="fallback_init must be one of"):
    dataclasses.replace(cfg, fallback_init="hot")


def _assert_rerun_trains_nothing(workdir, cfg, stacked, final):
  """Rerunning a finished ``run_trials`` returns ``final`` without
  building a train step."""

  def boom(*a, **k):
    raise AssertionError("finished work was redone")

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(pretrain_train, "make_train_step", boom)
    assert pretrain.run_trials(workdir, cfg, stacked,
                               log=lambda s: None) == final


def _copy_without_fallbacks(workdir, to):
  """``workdir``'s stack as a run without ``fallback_layers``."""
  shutil.copytree(workdir, to, ignore=shutil.ignore_patterns("fallback-*"))
  path = os.path.join(to, "config.json")
  cfg = json.load(open(path))
  cfg["pretrain"]["fallback_layers"] = 0
  json.dump(cfg, open(path, "w"))
  return to


@pytest.mark.slow
def test_a_trial_far_from_the_target_falls_back_before_the_cap(tmp_path):
  """``fallback_gap``: at the end of the last cycle before the cap, a
  trial above it leaves the stack for its fallback then; one below it
  trains on. A rerun resumes to the same lines."""
  cfg = TINY.with_overrides(cycles=(20, 20), target_gap=0.05,
                            fallback_layers=TINY.model.num_layers + 1,
                            fallback_gap=0.6)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path / "stack")
  final = pretrain.run_trials(workdir, cfg, stacked, log=lambda s: None)
  lines = pretrain_workdir.read_metrics(pretrain_workdir.Paths.of(workdir))
  at20 = {m["trial"]: m["ce_gap"] for m in lines if m["step"] == 20}
  for k, gap in at20.items():
    early = gap > cfg.fallback_gap
    assert max(m["step"] for m in lines if m["trial"] == k) == (
        20 if early else 40), (k, gap)
    if early:
      assert final[k]["layers"] == cfg.fallback_layers
  assert any(g > cfg.fallback_gap for g in at20.values()), at20
  assert any(g <= cfg.fallback_gap for g in at20.values()), at20
  assert pretrain.run_trials(workdir, cfg, stacked,
                             log=lambda s: None) == final
  for bad in (dict(fallback_layers=0), dict(cycles=None, steps=40),
              dict(fallback_gap=0.01)):
    with pytest.raises(ValueError, match="fallback_gap"):
      cfg.with_overrides(**bad)


def _stack_checkpointed_at_0(workdir, cfg, models_K):
  """A run's directory as the loop leaves it after checkpointing step 0
  and before its first metrics line (no training: the refusals below read
  only the directory)."""
  paths = pretrain_workdir.prepare(workdir, cfg, models_K)
  num = generative.num_trials(models_K)
  ckpts = ckpt_lib.Checkpoints(paths.ckpt)
  ckpts.save(0, pretrain_train.init_states(
      jax.random.split(jax.random.PRNGKey(0), num), cfg))
  ckpts.close()
  return paths


def test_the_workdir_layout_is_the_documented_one(tmp_path):
  """The file names the module and the binary document, and the layout
  read_config reports: 1 for a bare config, else the file's own."""
  paths = pretrain_workdir.Paths.of("run")
  assert dataclasses.asdict(paths) == dict(
      config="run/config.json", model="run/hmm.npz", ckpt="run/checkpoints",
      metrics="run/metrics.jsonl", retained="run/retained",
      stopped="run/stopped")
  bare = pretrain_workdir.Paths.of(str(tmp_path))
  with open(bare.config, "w") as f:
    json.dump(TINY.to_json(), f)
  assert pretrain_workdir.read_config(bare) == (1, TINY)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  new = pretrain_workdir.prepare(str(tmp_path / "new"), TINY, stacked)
  assert pretrain_workdir.read_config(new) == (pretrain_workdir.LAYOUT, TINY)
  assert pretrain_workdir.LAYOUT == 3


def test_a_stack_is_refused_where_one_model_or_other_trials_are_expected(
    tmp_path):
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path / "run")
  _stack_checkpointed_at_0(workdir, TINY, stacked)
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{workdir} holds a run of 2 stacked trials, this run has 3 stacked "
      f"trials: use a new workdir (or delete it) to change the trial count")
      + "$"):
    pretrain_workdir.prepare(workdir, TINY, generative.random_models(
        jax.random.PRNGKey(5), 3, "vanilla", 6, 10))
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{workdir} holds 2 stacked trials: load it with load_trials") + "$"):
    pretrain.load_backbone(workdir)
  # Without a metrics line yet, a trial loads with empty metrics.
  _, params_K, infos = pretrain.load_trials(workdir)
  assert [(i.step, i.metrics) for i in infos] == [(0, {}), (0, {})]
  assert {x.shape[0] for x in jax.tree.leaves(params_K)} == {2}


def test_load_retained_names_a_missing_or_empty_retained_folder(tmp_path):
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path / "run")
  paths = _stack_checkpointed_at_0(workdir, TINY, stacked)
  with pytest.raises(FileNotFoundError, match="^" + re.escape(
      f"no retained checkpoints in {workdir} ({paths.retained} missing): "
      f"pretrain with PretrainConfig.retain set") + "$"):
    pretrain_workdir.load_retained(workdir)
  os.makedirs(paths.retained)
  with pytest.raises(FileNotFoundError, match="^" + re.escape(
      f"no retained checkpoints in {paths.retained}: pretrain with "
      f"PretrainConfig.retain set (a runtime field: the steps already "
      f"trained past are not retained by a rerun)") + "$"):
    pretrain_workdir.load_retained(workdir)


def test_a_trial_that_fell_back_without_its_fallback_run_is_named(tmp_path):
  """Trial 1's line at the cap is above the target and no fallback-1/
  exists (a run killed between the stack and its fallback)."""
  cfg = dataclasses.replace(TINY, target_gap=0.5, fallback_layers=3)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path / "run")
  paths = _stack_checkpointed_at_0(workdir, cfg, stacked)
  pretrain_workdir.write_metrics(paths, [
      {"trial": 0, "step": cfg.total_steps, "ce_gap": 0.4},
      {"trial": 1, "step": cfg.total_steps, "ce_gap": 0.6}])
  where = pretrain_workdir.fallback_dir(workdir, 1)
  with pytest.raises(FileNotFoundError, match="^" + re.escape(
      f"trial 1 of {workdir} is above the target gap at the cap and its "
      f"fallback run {where} is missing: run run_trials to train it") + "$"):
    pretrain.load_trials(workdir)


def test_progress_logs_mfu_where_the_peak_is_known(monkeypatch):
  """On a device with a listed peak the log line adds the window's MFU:
  its tokens/s times the model's training FLOPs per token
  (transformer.train_flops_per_token) over the devices' peak; on a CPU
  (no peak) the line has none."""
  from hmmprompt.backbones import transformer
  from hmmprompt.pretrain import curves
  cfg = dataclasses.replace(TINY, steps=100)
  tokens = cfg.batch_size * cfg.corpus.chunk_len
  fpt = transformer.train_flops_per_token(cfg.model, cfg.corpus.chunk_len)
  for peak in (None, 1e-3):
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(curves.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(curves.sharding, "peak_tflops",
                        lambda dtype, peak=peak: peak)
    logs = []
    progress = curves.Progress(cfg, 0, logs.append, trials=2)
    progress.add(jnp.float32(1.0))
    rate = progress.flush(10, 10, "ck")
    assert rate == 2 * tokens * 10 / 2
    mfu = 100 * rate * fpt / (1e-3 * 1e12 * jax.device_count())
    assert (" MFU " in logs[-1]) == (peak is not None)
    if peak is not None:
      assert f"k tokens/s MFU {mfu:.1f}% ETA" in logs[-1], logs[-1]


def test_progress_logs_rate_and_eta_without_compilation(monkeypatch):
  """The log line's tokens/s is the window's (all trials stepping), and
  its ETA extrapolates the time per step since the first window, which
  holds the compilation; a non-finite loss is named by its step."""
  from hmmprompt.pretrain import curves
  clock = iter([100.0, 102.0, 103.0, 105.0])
  monkeypatch.setattr(curves.time, "perf_counter", lambda: next(clock))
  cfg = dataclasses.replace(TINY, steps=100)
  tokens = cfg.batch_size * cfg.corpus.chunk_len
  logs = []
  progress = curves.Progress(cfg, 0, logs.append, trials=2)  # at 100 s
  for loss in (1.0, 3.0):
    progress.add(jnp.float32(loss))
  assert progress.flush(10, 10, "ck") == 2 * tokens * 10 / 2  # at 102 s
  # Two steps a second, 90 steps left.
  assert logs[-1] == (f"step 10/100 loss 2.0000 {2 * tokens * 5 / 1e3:.1f}k "
                      f"tokens/s ETA 18s")
  progress.trials = 1
  progress.add(jnp.float32(0.5))
  assert progress.flush(30, 20, "ck") == tokens * 20 / 1  # at 103 s
  # Since the first window: 20 steps in 1 s; 70 left.
  assert logs[-1] == (f"step 30/100 loss 0.5000 {tokens * 20 / 1e3:.1f}k "
                      f"tokens/s ETA 4s")
  progress.add(jnp.float32(0.5))
  assert progress.flush(50, 30, "ck") == tokens * 20 / 2  # at 105 s
  # Still since the first window: 40 steps in 3 s; 50 left.
  assert logs[-1] == (f"step 50/100 loss 0.5000 {tokens * 10 / 1e3:.1f}k "
                      f"tokens/s ETA 4s")
  # A resumed run's first window counts from its resume step (20 here),
  # one step long.
  clock = iter([200.0, 204.0])
  resumed = curves.Progress(cfg, 20, logs.append)  # at 200 s
  resumed.add(jnp.float32(1.0))
  assert resumed.flush(21, 20, "ck") == tokens / 4  # at 204 s
  assert logs.pop() == (f"step 21/100 loss 1.0000 {tokens / 4 / 1e3:.1f}k "
                        f"tokens/s ETA 316s")  # 4 s a step, 79 left
  for loss in (0.5, np.nan, 0.5):
    progress.add(jnp.float32(loss))
  with pytest.raises(FloatingPointError, match="^" + re.escape(
      "non-finite loss at step 52; stopping. The last good checkpoint "
      "(step 50) is in ck; lower --lr or raise --warmup_steps") + "$"):
    progress.flush(53, 50, "ck")
  assert len(logs) == 3


def test_trial_k_draws_from_its_seed_plus_k():
  from hmmprompt.pretrain import loop
  keys = loop.Keys.of(7, 3)
  for k in range(3):
    want = jax.random.split(jax.random.PRNGKey(7 + k), 4)
    for i, field in enumerate(loop.Keys._fields):
      np.testing.assert_array_equal(getattr(keys, field)[k], want[i])
  assert loop.Keys._fields == ("init", "data", "corpus", "val")
  np.testing.assert_array_equal(loop.Keys.of(8).init[0], keys.init[1])
  assert loop.Keys.of(8).init.shape == (1, 2)  # one run by default


@pytest.mark.slow
def test_a_crash_between_a_checkpoint_and_its_evaluation_redoes_it(
    tmp_path, trained, model, monkeypatch):
  """Killed inside step 20's evaluation: its checkpoint comes after it, so
  the newest is step 10's. A checkpoint of all K written before its
  evaluation (layout 2's order and format; here step 20's retained copy,
  saved before the evaluation) resumes from 20, evaluates it first, and
  ends with the uninterrupted run's lines."""
  from hmmprompt.pretrain import loop
  real = loop.evaluate_lib.evaluate_group

  def crash(*args, **kwargs):
    raise _Crash

  monkeypatch.setattr(loop.evaluate_lib, "evaluate_group", crash)
  workdir = str(tmp_path)
  with pytest.raises(_Crash):
    pretrain.run(workdir, dataclasses.replace(TINY, retain=(20,)), model,
                 log=lambda s: None)
  paths = pretrain_workdir.Paths.of(workdir)
  assert pretrain_workdir.read_metrics(paths) == []
  ckpts = ckpt_lib.Checkpoints(paths.ckpt)
  assert ckpts.all_steps() == [10]
  ckpts.close()
  shutil.copytree(os.path.join(paths.retained, "20"),
                  os.path.join(paths.ckpt, "20"))
  monkeypatch.setattr(loop.evaluate_lib, "evaluate_group", real)
  logs = []
  final = pretrain.run(workdir, TINY, model, log=logs.append)
  assert logs[0] == "resumed from step 20"
  # Step 20's evaluation comes before any training step is logged.
  first = [l for l in logs if l.startswith("step ")][0]
  assert first.startswith("step 20: mlm_ce ")
  drop = lambda m: {a: b for a, b in m.items() if a != "wall_s"}
  whole = [json.loads(l) for l in open(os.path.join(trained[0],
                                                    "metrics.jsonl"))]
  got = pretrain_workdir.read_metrics(paths)
  assert [drop(m) for m in got] == [drop(m) for m in whole]
  assert drop(final) == drop(trained[1])


@pytest.mark.parametrize("trials_per_vmap", [1, 2])
def test_a_group_is_evaluated_in_one_program_as_each_trial_alone(
    monkeypatch, trials_per_vmap):
  """Three trials' evaluations: one dispatch per slice of ``eval_batch``
  sequences for the group, not one per trial, and each trial's metrics
  those of :func:`evaluation.evaluate` alone: bit for bit one trial after
  another (the CPU presets' ``trials_per_vmap`` 1, so no committed line
  moves), and in vmapped pairs to float32 rounding (the batched matmuls
  sum in another order: a few eps of each sum, eps = 1.2e-7, times its
  ~100 terms of hidden width and vocabulary, relative)."""
  from hmmprompt.pretrain import evaluation
  cfg = dataclasses.replace(TINY, trials_per_vmap=trials_per_vmap,
                            eval_batch=TINY.corpus.val_seqs // 2)
  models = generative.random_models(jax.random.PRNGKey(5), 3, "vanilla", 6,
                                    10)
  keys = pretrain_loop.Keys.of(cfg.seed, 3)
  params = pretrain_train.init_states(keys.init, cfg).params
  vals = [evaluation.validation_set(keys.val[k], generative.trial(models, k),
                                    cfg) for k in range(3)]
  alone = [evaluation.evaluate(jax.tree.map(lambda x, k=k: x[k], params),
                               cfg, vals[k]) for k in range(3)]
  calls = []
  real = evaluation._group_sums
  monkeypatch.setattr(evaluation, "_group_sums",
                      lambda *a: calls.append(1) or real(*a))
  group = evaluation.evaluate_group(
      params, cfg, jax.tree.map(lambda *xs: jnp.stack(xs), *vals))
  slices = -(-cfg.corpus.val_seqs // cfg.eval_batch)
  assert slices == 2 and len(calls) == slices
  if trials_per_vmap == 1:
    assert group == alone
  else:
    for a, g in zip(alone, group):
      assert a["eval_positions"] == g["eval_positions"]
      for name in ("mlm_ce", "bayes_ce", "tv"):
        np.testing.assert_allclose(g[name], a[name], rtol=100 * 1.2e-7 * 4)


@pytest.mark.slow
def test_a_fixed_corpus_stack_trains_each_trial_on_its_own_corpus(tmp_path):
  """The paper's corpus kind (``fresh=False``: a fixed corpus per trial,
  read in epochs) through the loop, two trials stacked: each trial's
  evaluation is logged under its name and differs from the other's."""
  cfg = TINY.with_overrides(
      corpus=dataclasses.replace(TINY.corpus, fresh=False, num_seqs=4,
                                 seq_len=2 * TINY.corpus.chunk_len),
      steps=10, eval_every=10, ckpt_every=10, log_every=10, target_gap=10.0)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  logs = []
  final = pretrain.run_trials(str(tmp_path), cfg, stacked, log=logs.append)
  assert [(m["trial"], m["step"]) for m in final] == [(0, 10), (1, 10)]
  assert all(np.isfinite(m["mlm_ce"]) for m in final)
  assert final[0]["mlm_ce"] != final[1]["mlm_ce"]
  for k, m in enumerate(final):
    assert any(l.startswith(f"trial {k} step 10: mlm_ce ") for l in logs)
    assert (f"trial {k} CE gap {m['ce_gap']:.4f} <= target 10.0 at step "
            f"10: stopping it") in logs


def test_a_resumed_runs_wall_time_adds_the_killed_runs(tmp_path, model,
                                                       monkeypatch):
  """``wall_s`` is the training time summed over the runs: a rerun starts
  from its checkpoint's line's (set to 1000 s here) and adds its own."""
  from hmmprompt.pretrain import loop
  workdir = str(tmp_path)
  # The first run on a stopped clock: a fresh run's wall time starts at 0.
  with monkeypatch.context() as patch:
    patch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: 7.0))
    with pytest.raises(_Crash):
      pretrain.run(workdir, TINY, model, log=lambda s: None,
                   after_step=_crash_after(20))
  paths = pretrain_workdir.Paths.of(workdir)
  (line,) = pretrain_workdir.read_metrics(paths)
  assert line["wall_s"] == 0.0
  assert not os.path.exists(paths.retained)  # nothing to retain: no folder
  pretrain_workdir.write_metrics(paths, [{**line, "wall_s": 1000.0}])
  t0 = time.perf_counter()
  final = pretrain.run(workdir, TINY, model, log=lambda s: None)
  assert 1000.0 < final["wall_s"] <= 1000.0 + time.perf_counter() - t0


def test_evaluations_fall_on_every_multiple_cycle_end_and_the_last_step():
  """``_is_eval``: a multiple of ``eval_every``, the last step, or the end
  of a cycle (where an early stop may happen), whichever; ``_reached``: a
  gap at the target counts."""
  from hmmprompt.pretrain import loop
  cfg = dataclasses.replace(TINY, steps=43, cycles=(25, 18), eval_every=10,
                            target_gap=0.5)
  assert cfg.cycle_ends == (25, 43)
  assert [d for d in range(1, 44) if loop._is_eval(cfg, d)] == [
      10, 20, 25, 30, 40, 43]
  assert [d for d in range(1, 44) if loop._may_stop(cfg, d)] == [25, 43]
  assert loop._reached(cfg, {"ce_gap": 0.5})
  assert not loop._reached(cfg, {"ce_gap": float(np.nextafter(0.5, 1.0))})
  assert not loop._reached(dataclasses.replace(cfg, target_gap=None),
                           {"ce_gap": 0.0})


def test_run_trials_names_an_unstacked_model(tmp_path, model):
  with pytest.raises(ValueError, match="^" + re.escape(
      "run_trials needs [K] stacked models (generative.random_models or "
      "generative.stack); use run for one model") + "$"):
    pretrain.run_trials(str(tmp_path), TINY, model, log=lambda s: None)
  assert not os.listdir(tmp_path)  # refused before writing anything


@pytest.mark.slow  # 2.8 s; the fast tier checks retain's schedule alone
def test_a_run_resumed_with_retain_keeps_every_step_from_its_resume(
    tmp_path, model):
  """``retain`` is a runtime field: a run started without it and resumed
  with it retains its resume step and every later one (however many:
  ``retained/`` rotates nothing), and names the steps it trained past."""
  workdir = str(tmp_path)
  with pytest.raises(_Crash):
    pretrain.run(workdir, TINY, model, log=lambda s: None,
                 after_step=_crash_after(10))
  logs = []
  pretrain.run(workdir, dataclasses.replace(
      TINY, retain=(0, 5, 10, 15, 25, 30, 35)), model, log=logs.append)
  assert logs[:2] == [
      "resumed from step 10",
      "retain: steps [0, 5] were trained past without being retained "
      "(resumed from step 10); a new workdir retains them"]
  assert pretrain_workdir.load_retained(workdir)[2] == [10, 15, 25, 30, 35]


# Full suite (3.6 s); the fast tier resumes a stack in
# test_a_crash_between_a_checkpoint_and_its_evaluation_redoes_it.
@pytest.mark.slow
def test_a_stopped_trial_keeps_its_state_while_the_others_train(
    tmp_path, monkeypatch):
  """Trial 0 stops at its first evaluation (step 20) while trial 1 trains
  on, with exact targets (each trial's own HMM in the step): the stack's
  checkpoints hold trial 0 as it stopped; the progress line comes every
  ``log_every`` steps."""
  from hmmprompt.pretrain import loop
  monkeypatch.setattr(loop, "_reached",
                      lambda cfg, m: m.get("trial") == 0)
  cfg = dataclasses.replace(TINY, targets="exact", retain=(20, 40))
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  workdir = str(tmp_path)
  logs = []
  final = pretrain.run_trials(workdir, cfg, stacked, log=logs.append)
  assert [(m["trial"], m["step"]) for m in final] == [(0, 20), (1, 40)]
  assert [int(s.split()[1].split("/")[0]) for s in logs
          if re.match(r"step \d+/40 loss ", s)] == [10, 20, 30, 40]
  params_QxK = pretrain_workdir.load_retained(workdir)[1]
  for leaf in jax.tree.leaves(params_QxK):
    np.testing.assert_array_equal(leaf[1, 0], leaf[0, 0])  # as it stopped
  assert not all(np.array_equal(leaf[1, 1], leaf[0, 1])
                 for leaf in jax.tree.leaves(params_QxK))
  # And the last checkpoint (step 40): trial 0 at 20, trial 1 at 40.
  params_K = pretrain.load_trials(workdir)[1]
  for leaf, at in zip(jax.tree.leaves(params_K), jax.tree.leaves(params_QxK)):
    np.testing.assert_array_equal(leaf, at[1])
  # Trial 0 was written once, as it stopped; the checkpoints after its
  # stop hold trial 1 alone (step 20's, which held both, rotated out).
  paths = pretrain_workdir.Paths.of(workdir)
  rows = lambda d, s: [int(k) for k in ckpt_lib.Checkpoints(
      d, keep=None).restore(None, s)["trials"]]
  ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=None)
  assert ckpts.all_steps() == [30, 40]
  assert [ckpts.item_tree(s)["trials"].shape for s in (30, 40)] == [(1,)] * 2
  ckpts.close()
  assert rows(paths.ckpt, 40) == [1] and rows(paths.stopped, 20) == [0]
  # A workdir that lost stopped/ names the trial it cannot load.
  shutil.rmtree(paths.stopped)
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"trials [0] are in neither the checkpoint of step 40 in {paths.ckpt} "
      f"nor in stopped/ beside it: the workdir lost files; pretrain in a "
      f"new workdir")):
    pretrain.load_trials(workdir)


@pytest.mark.slow
def test_a_run_killed_after_a_trial_stopped_resumes_from_stopped(
    tmp_path, monkeypatch):
  """Killed after step 30, when trial 0 (stopped at 20) is in ``stopped/``
  alone and the checkpoints hold trial 1, a rerun ends as the
  uninterrupted run, states included."""
  from hmmprompt.pretrain import loop
  monkeypatch.setattr(loop, "_reached",
                      lambda cfg, m: m.get("trial") == 0)
  cfg = dataclasses.replace(TINY, targets="exact")
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  whole = str(tmp_path / "whole")
  final = pretrain.run_trials(whole, cfg, stacked, log=lambda s: None)
  cut = str(tmp_path / "cut")
  with pytest.raises(_Crash):
    pretrain.run_trials(cut, cfg, stacked, log=lambda s: None,
                        after_step=_crash_after(30))
  again = pretrain.run_trials(cut, cfg, stacked, log=lambda s: None)
  drop = lambda m: {a: b for a, b in m.items() if a != "wall_s"}
  assert [drop(m) for m in again] == [drop(m) for m in final]
  jax.tree.map(np.testing.assert_array_equal, pretrain.load_trials(cut)[1],
               pretrain.load_trials(whole)[1])


_EXACT = TINY.with_overrides(targets="exact")


@pytest.mark.parametrize("fresh", [True, False])
def test_targets_drawn_ahead_are_each_steps_own(fresh):
  """``exact_window``: a window of 3 steps (6-8) drawn in one call holds
  each step's batch as the step draws it (each trial's ``batch_at``), bit
  for bit, and its exact targets as the step computes them, to the
  kernels' rounding: another program's fusion reassociates the scan's sums
  (each target within ``H log2(T) eps``, as tests/test_hmm.py derives for
  two kernels)."""
  cfg = _EXACT if fresh else _EXACT.with_overrides(corpus=dataclasses.replace(
      TINY.corpus, fresh=False, num_seqs=4, seq_len=2 * TINY.corpus.chunk_len))
  models = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6, 10)
  hmms = jax.vmap(generative.as_hmm)(models)
  keys = pretrain_loop.Keys.of(0, 2)
  chunks = None if fresh else jnp.stack([
      corpus.build_chunks(keys.corpus[k], generative.trial(models, k),
                          cfg.corpus) for k in range(2)])
  mesh = sharding.data_mesh()
  window = pretrain_batches.window_fn(cfg, 3, fresh, mesh)(
      keys.data, 6, models, chunks, hmms)
  draw = pretrain_batches.batch_fn(cfg.corpus, cfg.batch_size, 10, fresh, False,
                                 mesh)
  targets = jax.jit(jax.vmap(functools.partial(pretrain_train.loss_targets,
                                               cfg)))
  tol = (hmms.transition.shape[-1] * np.log2(cfg.corpus.chunk_len)
         * np.finfo(np.float32).eps)
  # Trial k's batch is corpus.batch_at's with trial k's key, model, chunks.
  one = jax.jit(functools.partial(corpus.batch_at, cfg=cfg.corpus,
                                  batch_size=cfg.batch_size, vocab_size=10))
  for i in range(3):
    inputs, tokens, weights = draw(keys.data, 6 + i, models, chunks)
    for k in range(2):
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[k], b),
                   (inputs, tokens, weights),
                   one(keys.data[k], 6 + i, generative.trial(models, k),
                       None if fresh else chunks[k]))
    ahead = pretrain_batches.step_of(window, i)
    np.testing.assert_array_equal(ahead[0], inputs)
    np.testing.assert_array_equal(ahead[2], weights)
    assert ahead[1].shape == tokens.shape + (10,)
    np.testing.assert_allclose(ahead[1], targets(hmms, inputs, tokens,
                                                 weights), rtol=0, atol=tol)


def test_exact_window_is_one_on_a_cpu_and_refused_below_zero(monkeypatch):
  """0 picks by backend: the targets inside each step on a CPU (the
  committed results' way), a window of 16 on accelerators; sampled targets
  have none to draw ahead."""
  assert pretrain_train.exact_window(_EXACT) == (
      1 if jax.default_backend() == "cpu" else 16)
  with monkeypatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert pretrain_train.exact_window(_EXACT) == 16
  assert pretrain_train.exact_window(_EXACT.with_overrides(
      exact_window=5)) == 5
  assert pretrain_train.exact_window(TINY.with_overrides(
      exact_window=5)) == 1
  with pytest.raises(ValueError, match=r"^PretrainConfig.exact_window must "
                     r"be an int >= 0 \(0: by backend\), got -1$"):
    _EXACT.with_overrides(exact_window=-1)


def test_loss_targets_pass_targets_through_and_resolve_the_kernel(
    monkeypatch):
  """Targets drawn ahead (``[B, T, V]``) come back as they are, with no
  second scan in the step, as do sampled targets' tokens; exact targets run
  ``exact_method``'s kernel, ``auto`` resolved on the sequence length (on
  an accelerator, the associative scan from its threshold on)."""
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(0), 4, 10)
  inputs = jnp.zeros((2, 6), jnp.int32)
  weights = jnp.ones((2, 6), jnp.float32)
  ahead = jnp.full((2, 6, 10), 0.1)
  assert pretrain_train.loss_targets(_EXACT, hmm, inputs, ahead,
                                     weights) is ahead
  assert pretrain_train.loss_targets(TINY, hmm, inputs, inputs,
                                     weights) is inputs
  seen = []
  real = corpus.exact_targets
  monkeypatch.setattr(corpus, "exact_targets", lambda *a, method: (
      seen.append(method), real(*a, method=method))[1])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(hmm_lib, "_AUTO_PARALLEL_FROM", 6)
  for method, length, kernel in (("blocked", 6, "blocked"),
                                 ("auto", 6, "parallel"),
                                 ("auto", 5, "sequential")):
    seen.clear()
    cfg = _EXACT.with_overrides(exact_method=method)
    jax.eval_shape(functools.partial(pretrain_train.loss_targets, cfg), hmm,
                   inputs[:, :length], inputs[:, :length],
                   weights[:, :length])
    assert seen == [kernel], (method, length)


@pytest.mark.slow  # three compiles, up to ~4 CPU-s cold (the fast tier's minute)
def test_a_step_from_targets_ahead_compiles_once_for_every_hmm_size():
  """Targets drawn ahead (``exact_window`` > 1) leave the step no HMM to
  read, so it is not given one: HMMs of 3 and 5 states share one compiled
  step (on the H100 a stack with a new ``|H|`` spent ~30 s of its 113 on
  compiles, one with the step in hand ~2 s), and its loss is the MLM loss
  on the targets it was given. A state loss still reads the HMMs there:
  refused without them."""
  cfg = _EXACT.with_overrides(exact_window=5)  # a step program of its own
  mesh = sharding.data_mesh()
  step = pretrain_train.make_train_step(cfg, mesh)
  rng = np.random.default_rng(0)
  shape = (1, cfg.batch_size, cfg.corpus.chunk_len)
  inputs = jnp.asarray(rng.integers(0, 10, shape), jnp.int32)
  weights = jnp.asarray(rng.random(shape) < 0.5, jnp.float32)
  targets = jnp.asarray(rng.dirichlet(np.ones(10), shape), jnp.float32)
  loss_of = jax.jit(pretrain_train.mlm_loss, static_argnums=1)
  # The same float32 forward in two programs: each logit's dot products
  # (over d_model) and the mean over the B T positions may be reassociated.
  rtol = (np.log2(cfg.model.d_model) + np.log2(inputs.size)) * np.finfo(
      np.float32).eps
  for h in (3, 5):
    hmms = jax.tree.map(lambda x: x[None], hmm_lib.random_hmm(
        jax.random.PRNGKey(h), h, 10))
    states = pretrain.init_states(jax.random.PRNGKey(h)[None], _EXACT)
    # Before the step, which donates the states.
    want = loss_of(jax.tree.map(lambda x: x[0], states.params), cfg.model,
                   inputs[0], targets[0], weights[0])
    _, loss = step(states, inputs, targets, weights, hmms)
    np.testing.assert_allclose(loss[0], want, rtol=rtol)
  assert pretrain_train._jitted_step(cfg, mesh)._cache_size() == 1
  readout = cfg.with_overrides(state_loss=1.0, model=dataclasses.replace(
      cfg.model, state_readout=3))
  with pytest.raises(ValueError, match=r"^PretrainConfig.state_loss needs "
                     r"the generating HMMs: pass hmms="):
    pretrain_train.make_train_step(readout, mesh)(
        None, inputs, targets, weights)  # refused before the states are read


@pytest.mark.slow  # pretraining loops (the fast tier's minute)
def test_a_run_drawing_targets_ahead_resumes_as_uninterrupted(
    tmp_path, monkeypatch):
  """Windows of 3 steps start at multiples of 3, so a run killed after its
  step-10 checkpoint resumes inside the window 9-11 and ends as the
  uninterrupted run, bit for bit; both agree with targets computed in each
  step to float rounding (the targets' last bits, amplified by Adam on
  near-zero gradients as in the trials_per_vmap test above)."""
  cfg = _EXACT.with_overrides(exact_window=3)
  stacked = generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6,
                                     10)
  whole = pretrain.run_trials(str(tmp_path / "whole"), cfg, stacked,
                              log=lambda s: None)
  resumed = str(tmp_path / "resumed")
  with pytest.raises(_Crash):
    pretrain.run_trials(resumed, cfg, stacked, log=lambda s: None,
                        after_step=_crash_after(12))
  taken = []
  real = pretrain_batches.step_of
  monkeypatch.setattr(pretrain_batches, "step_of",
                      lambda w, i: taken.append(i) or real(w, i))
  drop = lambda lines: [{k: v for k, v in m.items() if k != "wall_s"}
                        for m in lines]
  assert drop(pretrain.run_trials(resumed, cfg, stacked,
                                  log=lambda s: None)) == drop(whole)
  jax.tree.map(np.testing.assert_array_equal, pretrain.load_trials(resumed)[1],
               pretrain.load_trials(str(tmp_path / "whole"))[1])
  # Steps 10 and 11 from the window 9-11, then 12 from the next.
  assert taken[:3] == [1, 2, 0]
  in_step = pretrain.run_trials(str(tmp_path / "in_step"), _EXACT, stacked,
                                log=lambda s: None)
  for a, b in zip(whole, in_step):
    assert (a["trial"], a["step"]) == (b["trial"], b["step"])
    assert a["ce_gap"] == pytest.approx(b["ce_gap"], rel=1e-3, abs=1e-4)
