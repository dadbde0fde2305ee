"""Accuracy against pretraining quality: retained checkpoints, tuning them
stacked, and the curve binary's lines, resume and refusals
(experiments/pretraining_curve/)."""

import dataclasses
import os
import re

import jax
import numpy as np
import pytest

import zygote  # tests/zygote.py
from hmmprompt import pretraining_curve as curve
from hmmprompt.pretraining_curve import report as curve_report
from hmmprompt import protocol
from hmmprompt import generative
from hmmprompt import pretrain
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.pretrain import train as pretrain_train

# tiny: 40 steps, checkpoints every 10 (keep 2), evaluations at 20 and 40.
RETAINED = dataclasses.replace(pretrain.preset_config("tiny"),
                               retain=(0, 5, 15, 40))
# Vanilla only (the memory model's attention-head path is the tuning
# driver's, tested in tests/test_tuning.py): half the programs to compile.
SETUP = dataclasses.replace(curve.get_setup("tiny"), memory_sizes=())


class _Crash(Exception):
  """Stands for a killed process."""


def _models():
  return generative.random_models(jax.random.PRNGKey(5), 2, "vanilla", 6, 10)


@pytest.fixture(scope="module")
def retained_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("retained"))
  pretrain.run_trials(workdir, RETAINED, _models(), log=lambda s: None)
  return workdir


@pytest.fixture(scope="module")
def tiny_curve(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("curve"))
  return workdir, curve.run_curve(SETUP, workdir)


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_retention_keeps_the_schedule_beside_the_rotation(retained_run,
                                                          tmp_path):
  """The scheduled steps (the init included) are kept whatever ``keep``
  says, the rotation is untouched, the stack loads ``[Q, K]`` and its
  evaluation at an evaluation step is the loop's line. A run killed just
  after a retained save (before the next rotating checkpoint) resumes to
  the same retained states; a step trained past unretained is named."""
  workdir = retained_run
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")),
                key=int) == ["30", "40"]
  assert sorted(os.listdir(os.path.join(workdir, "retained")),
                key=int) == ["0", "5", "15", "40"]
  _, params_QxK, steps, infos = pretrain.load_retained(workdir)
  assert steps == [0, 5, 15, 40]
  assert [i["steps"] for i in infos] == [[0, 5, 15, 40]] * 2
  assert {x.shape[:2] for x in jax.tree.leaves(params_QxK)} == {(4, 2)}
  init = pretrain.init_states(pretrain.Keys.of(RETAINED.seed, 2).init,
                              RETAINED)
  _assert_trees_equal(jax.tree.map(lambda x: x[0], params_QxK), init.params)
  metrics = pretrain.evaluate_checkpoints(RETAINED, _models(), params_QxK)
  lines = pretrain.workdir.read_metrics(pretrain.workdir.Paths.of(workdir))
  for line in lines:
    if line["step"] == 40:
      got = metrics[3][line["trial"]]
      assert got == {k: v for k, v in line.items()
                     if k not in ("trial", "step", "wall_s")}

  crashed = str(tmp_path / "crashed")

  def crash(step):
    if step == 15:
      raise _Crash

  with pytest.raises(_Crash):
    pretrain.run_trials(crashed, RETAINED, _models(), log=lambda s: None,
                        after_step=crash)
  assert sorted(os.listdir(os.path.join(crashed, "retained")),
                key=int) == ["0", "5", "15"]
  pretrain.run_trials(crashed, RETAINED, _models(), log=lambda s: None)
  _assert_trees_equal(pretrain.load_retained(crashed)[1], params_QxK)

  logs = []
  later = dataclasses.replace(RETAINED, retain=(0, 25, 40))
  pretrain.run_trials(workdir, later, _models(), log=logs.append)
  assert any("steps [25] were trained past" in line for line in logs), logs
  plain = str(tmp_path / "plain")
  pretrain.run_trials(plain, dataclasses.replace(RETAINED, retain=(),
                                                 steps=10),
                      _models(), log=lambda s: None)
  assert not os.path.exists(os.path.join(plain, "retained"))
  with pytest.raises(FileNotFoundError, match="no retained checkpoints in "
                     f"{plain}"):
    pretrain.load_retained(plain)


def test_checkpoints_tuned_together_equal_each_tuned_alone(retained_run):
  """All Q x K checkpoints x trials in one program (lanes ``[Q * K]``, lane
  ``q * K + k``) give each checkpoint what tuning its K trials alone
  gives (same keys, same tasks)."""
  backbone, params_QxK, steps, _ = pretrain.load_retained(retained_run)
  models_K = _models()
  task_cfg = tasks.TaskConfig(num_train=64, num_val=16, num_test=32,
                              seq_len=12)
  task_K = tasks.make_tasks(jax.random.split(jax.random.PRNGKey(1), 2),
                            models_K, task_cfg)
  cfg = tuning.TuneConfig(method="prompt", epochs=1, prompt_len=2)
  data_K = [tuning.data_from_task(t, cfg) for t in task_K]
  keys_K = list(jax.random.split(jax.random.PRNGKey(2), 2))
  num_q, num_k = len(steps), 2
  flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), params_QxK)
  together, _ = tuning.tune_trials(
      [[keys_K[k]] for _ in range(num_q) for k in range(num_k)], backbone,
      flat, [[data_K[k]] for _ in range(num_q) for k in range(num_k)], cfg,
      lane_group=1)
  for q in range(num_q):
    alone, _ = tuning.tune_trials(
        [[keys_K[k]] for k in range(num_k)], backbone,
        jax.tree.map(lambda x, q=q: x[q], params_QxK),
        [[data_K[k]] for k in range(num_k)], cfg, lane_group=1)
    rows = slice(q * num_k, (q + 1) * num_k)
    for field in ("train_accuracy", "val_accuracy", "test_accuracy",
                  "final_loss"):
      np.testing.assert_allclose(getattr(together, field)[rows],
                                 getattr(alone, field), rtol=1e-5,
                                 atol=1e-6, err_msg=f"{field} at q={q}")


def test_curve_writes_every_line_and_a_rerun_computes_nothing(
    tiny_curve, monkeypatch):
  workdir, lines = tiny_curve
  keys = {r.key() for r in lines}
  assert len(keys) == len(lines)
  fp = SETUP.fingerprint()
  want = set()
  for mid in SETUP.model_ids():
    head = "attention" if mid.hmm == "memory" else "linear"
    for method in (f"head_{head}", f"prompt_{head}"):
      for k in range(SETUP.trials):
        want.add((mid.tag, k, "exact", None, method, fp))
        want |= {(mid.tag, k, "transformer", s, method, fp)
                 for s in SETUP.pretrain.retain}
  # 1 model x 2 methods x 2 trials x (3 checkpoints + the exact limit).
  assert keys == want and len(want) == 1 * 2 * 2 * (3 + 1)
  # A checkpoint at an evaluation step carries the loop's own measurement.
  metrics = pretrain.workdir.read_metrics(pretrain.workdir.Paths.of(
      protocol.pretrain_dir(workdir, SETUP, protocol.vanilla(4))))
  at40 = {m["trial"]: m for m in metrics if m["step"] == 40}
  for r in lines:
    assert 0.0 <= r.test_accuracy <= 1.0
    if r.backbone == "transformer" and r.model == "vanilla-h4" and (
        r.step == 40):
      assert r.ce_gap == pytest.approx(at40[r.trial]["ce_gap"], abs=1e-12)
      assert r.tv == pytest.approx(at40[r.trial]["tv"], abs=1e-12)
  curve_report.write_curve_report(workdir)
  with open(os.path.join(workdir, "curve.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  table = open(os.path.join(workdir, "curve.md")).read()
  assert "## vanilla-h4" in table and "| exact | 0 | 0 |" in table

  before = open(curve.lines_path(workdir)).read()

  def boom(*a, **k):
    raise AssertionError("a finished group was recomputed")

  monkeypatch.setattr(protocol.tuning, "tune_trials", boom)
  monkeypatch.setattr(protocol.pretrain_lib, "run_trials", boom)
  curve.run_curve(SETUP, workdir)
  assert open(curve.lines_path(workdir)).read() == before


def test_interrupted_curve_resumes_without_loss_or_duplicates(
    tiny_curve, tmp_path, monkeypatch):
  """Killed after its first group's lines are written, a rerun tunes only
  the other groups (pretraining is reused, not redone) and ends with the
  uninterrupted run's lines, once each."""
  _, full = tiny_curve
  setup = dataclasses.replace(SETUP, memory_sizes=())
  assert setup.fingerprint() == SETUP.fingerprint()
  workdir = str(tmp_path)
  real, calls = tuning.tune_trials, []

  def dies_second(*a, **k):
    calls.append(a[4].method)
    if len(calls) == 2:
      raise _Crash
    return real(*a, **k)

  monkeypatch.setattr(protocol.tuning, "tune_trials", dies_second)
  with pytest.raises(_Crash):
    curve.run_curve(setup, workdir)
  first = curve.read_curve_lines(workdir)
  assert len(first) == 3 * 2  # head, transformer: 3 checkpoints x 2 trials

  def no_training(*a, **k):
    raise AssertionError("pretraining ran again")

  calls.clear()
  monkeypatch.setattr(protocol.tuning, "tune_trials",
                      lambda *a, **k: calls.append(a[4].method) or real(
                          *a, **k))
  monkeypatch.setattr(pretrain_train, "make_train_step", no_training)
  lines = curve.run_curve(setup, workdir)
  assert calls == ["head", "prompt", "prompt"]
  assert len({r.key() for r in lines}) == len(lines) == 16
  strip = lambda r: {**dataclasses.asdict(r), "seconds": None}
  want = {r.key(): strip(r) for r in full if r.model == "vanilla-h4"}
  for r in lines:
    assert strip(r) == pytest.approx(want[r.key()])


def test_another_setup_and_a_bad_schedule_are_refused_by_name(tiny_curve):
  """The binary refuses a workdir of another setup before any work, naming
  what differs (the schedule too: it decides which checkpoints exist);
  a schedule beyond the run is refused naming the field."""
  workdir, _ = tiny_curve
  proc = zygote.run(["-m", "experiments.pretraining_curve", "--preset=tiny",
                     f"--workdir={workdir}", "--config.task.num_train=32"],
                    timeout=120)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr
  assert "task.num_train: 64 -> 32" in proc.stderr
  with pytest.raises(ValueError, match=re.escape(
      "retain: [0, 10, 40] -> [0, 10]")):
    curve.check_workdir(workdir, curve.get_setup(
        "tiny", {"pretrain.retain": "0,10"}))
  with pytest.raises(ValueError, match=re.escape(
      "PretrainConfig.retain must be a tuple of strictly increasing int "
      "steps in [0, total_steps = 40], got (0, 50)")):
    curve.get_setup("tiny", {"pretrain.retain": "0,50"})
