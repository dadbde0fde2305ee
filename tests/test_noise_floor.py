"""hmmprompt.figure3.noise: tuning replicates, the perturbed backbone and
the floor the reports quote."""

import dataclasses
import os
import shlex

import jax
import numpy as np
import pytest

import zygote  # tests/zygote.py
from hmmprompt import files
from hmmprompt import generative
from hmmprompt.backbones import exact
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep

SETUP = configs.get_setup("tiny", features=("raw",), left_sizes=(12,))


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  """The tiny left panel on the exact backbone, then 3 tuning seeds and the
  perturbed backbone of its 2 draws."""
  workdir = str(tmp_path_factory.mktemp("noise"))
  sweep.run_sweep(SETUP, workdir, "left", "exact")
  noise.run(SETUP, workdir, "exact", [12], trials=2, replicates=3,
            log=lambda s: None)
  return workdir


@pytest.mark.slow  # a sweep and its replicates (the fixture)
def test_replicate_zero_is_the_sweeps_line_and_the_others_are_new_seeds(
    swept):
  """Replicate 0 tunes with the sweep's own key: its line equals the
  sweep's (the same program up to more lanes: float rounding at most);
  replicates 1 and 2 are other seeds (other final losses); a rerun
  appends nothing."""
  reps = files.read_lines(noise.path(swept), noise.ReplicateLine)
  ours = {(r.trial, r.method): r for r in schema.read_results(swept)}
  assert len(reps) == 2 * 2 * (3 + 1)  # draws x arms x (seeds + perturbed)
  for r in reps:
    line = ours[r.trial, f"{r.method}_linear"]
    if r.replicate == 0:
      assert r.test_accuracy == line.test_accuracy
      assert r.final_loss == pytest.approx(line.final_loss, rel=1e-5)
    elif r.replicate > 0:
      assert r.final_loss != pytest.approx(line.final_loss, rel=1e-5)
  noise.run(SETUP, swept, "exact", [12], trials=2, replicates=3,
            log=lambda s: None)
  assert len(files.read_lines(noise.path(swept), noise.ReplicateLine)) == len(
      reps)


def test_the_perturbed_exact_backbone_stays_a_distribution_near_the_first():
  models = generative.random_models(jax.random.PRNGKey(0), 2, "vanilla", 5, 8)
  _, hmms = exact.make_stacked(models)
  # Zeros where the product-state HMM has none: set some (tree.map builds
  # the HMM unchecked, so it may pass through a row not summing to 1).
  hmms = jax.tree.map(lambda x: x / x.sum(-1, keepdims=True), jax.tree.map(
      lambda x: x.at[:, 0, 1].set(0.0) if x.ndim == 3 else x, hmms))
  shaken = noise.perturb(jax.random.PRNGKey(1), hmms, 1e-6)
  for a, b in zip(jax.tree.leaves(hmms), jax.tree.leaves(shaken)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(b.sum(-1), 1.0, atol=1e-6)
    assert np.all((a == 0) == (b == 0))
    # 1e-6 N(0,1) per element: below 6 sd, plus the row's renormalisation
    # and float32's rounding of 1 + 1e-6 x (6e-8).
    np.testing.assert_allclose(b, a, rtol=1.5e-5)
    assert np.any(a != b)
  assert noise.perturb(jax.random.PRNGKey(1), hmms, 0.0) is hmms


def _line(trial, method, replicate, acc, backbone="exact", size=4):
  return noise.ReplicateLine(backbone, size, trial, 0, method, replicate,
                             "fp", acc, 0.0)


def test_summary_spreads_and_floor_by_hand():
  """Two draws of 3 seeds: the pooled seed sd is the root of the mean of
  the draws' sample variances; the draw sd is over the seed-0 lines."""
  accs = {0: [0.70, 0.74, 0.72], 1: [0.90, 0.90, 0.96]}
  lines = [_line(k, m, r, a) for m in ("head", "prompt")
           for k, seeds in accs.items() for r, a in enumerate(seeds)]
  lines += [_line(0, "head", noise.PERTURBED, 0.75),
            _line(1, "head", noise.PERTURBED, 0.90)]
  s = noise.summarize(lines)[("exact", 4, "head")]
  var0 = np.var([70, 74, 72], ddof=1)
  var1 = np.var([90, 90, 96], ddof=1)
  assert s["seed_sd"] == pytest.approx(np.sqrt((var0 + var1) / 2))
  assert s["draw_sd"] == pytest.approx(np.std([70, 90], ddof=1))
  assert s["seed_range"] == pytest.approx(6.0)
  assert s["perturbed"] == pytest.approx(5.0)
  assert (s["draws"], s["seeds"]) == (2, 3)
  assert np.isnan(noise.summarize(lines)[("exact", 4, "prompt")]["perturbed"])
  floor = noise.arm_floor(noise.summarize(lines))
  assert noise.difference_floor(floor, "exact") == pytest.approx(
      2 * np.sqrt(2) * s["seed_sd"])
  assert noise.difference_floor(floor, "transformer") is None


def _result(method, acc, trial=0, gap=None, backbone="exact"):
  return schema.ResultLine(
      backbone=backbone, panel="left", hmm="vanilla", num_states=4,
      memory_size=0, trial=trial, task=0, method=method, features="raw",
      setup="fp", hmm_fingerprint="h", size=4, test_accuracy=acc,
      val_accuracy=acc, train_accuracy=acc, final_loss=0.1, steps=1,
      seconds=0.0, task_redraws=0, assumptions={}, tune_config={},
      task_config={}, pretrain_ce_gap=gap)


def test_adam_against_the_optimum_and_lines_beside_committed_ones():
  lines = [_result("head_linear", 0.74, 0), _result("head_linear_lbfgs", 1.0, 0),
           _result("prompt_linear", 1.0, 0),
           _result("head_linear", 0.99, 1), _result("head_linear_lbfgs", 0.995, 1),
           _result("prompt_linear", 0.99, 1)]
  (row,) = noise.adam_vs_optimum(lines)
  # 26 and 0.5 points short: one line more than a point below.
  assert row[3:] == (2, 1, "13.2", "26.0", "+13.0", "-0.2")
  committed = [_result("head_linear", 0.999, 0, gap=0.0087, backbone="t"),
               _result("head_linear", 0.9, 1, gap=0.01, backbone="t")]
  mine = [_result("head_linear", 0.739, 0, gap=0.0038, backbone="t"),
          _result("head_linear", 0.9, 1, gap=0.011, backbone="t")]
  assert noise.reproduction(mine, committed) == [
      ("t", "head_linear", 4, 2, 1, "26.0", "0.0049")]


def test_too_few_trials_or_replicates_are_refused_by_name(tmp_path):
  with pytest.raises(ValueError, match="--trials and --replicates >= 2"):
    noise.run(SETUP, str(tmp_path), "exact", [12], trials=2, replicates=1)
  with pytest.raises(ValueError, match="--trials <= the setup's 2; got "
                     "--trials=3 --replicates=2"):
    noise.run(SETUP, str(tmp_path), "exact", [12], trials=3, replicates=2)


def _tiny_workdir(tmp_path) -> tuple[str, list]:
  """A tiny adaptation run's workdir (its stamp, run with two --config
  overrides) and lines of its arms on both panels and backbones."""
  workdir = str(tmp_path / "tiny run")  # a space: the command quotes it
  setup = configs.get_setup("tiny", {"arms": "head,prompt-3,lora-2",
                                     "tune.lr": "0.02", "pretrain.lr": "0.005"})
  sweep.check_workdir(workdir, setup)  # writes DIR/sweep.json
  tc = {"prompt_len": 3, "lora_r": 2}
  lines = [dataclasses.replace(_result(m, 0.9, k), backbone=b, size=size,
                               tune_config=tc, setup=setup.fingerprint(b))
           for b, ms in (("exact", ("head_linear", "prompt_linear_p3")),
                         ("transformer", ("head_linear", "prompt_linear_p3",
                                          "lora_linear_r2")))
           for m in ms for size in (4, 12) for k in range(2)]
  lines.append(dataclasses.replace(
      _result("prefix_attention_p5", 0.9), panel="right", size=8,
      tune_config=tc, setup=setup.fingerprint("transformer")))
  files.append_lines(schema.results_path(workdir), lines)
  return workdir, lines


def test_the_reports_noise_floor_command_is_the_workdirs_own(tmp_path):
  """Where no floor is measured, figure3.md names the command that
  measures it: the workdir (the binary reads its setup there) and its
  left panel's backbones, sizes, draws and arms (the right panel's left
  out), each arm an arm of its setup."""
  from hmmprompt.figure3 import reporting
  workdir, lines = _tiny_workdir(tmp_path)
  command = reporting.noise_floor_command(workdir, lines)
  assert f"`{command}`" in reporting.floor_note({}, command)
  argv = shlex.split(command)
  assert argv[:3] == ["python", "-m", "experiments.noise_floor"]
  given = dict(a.removeprefix("--").split("=", 1) for a in argv[3:])
  assert given == {"workdir": workdir, "backbone": "exact,transformer",
                   "sizes": "4,12", "trials": "2",
                   "arms": "head,lora-2,prompt-3"}
  for spec in given["arms"].split(","):
    configs.parse_arm(spec, configs.get_setup("tiny").tune)


@pytest.mark.integration
@pytest.mark.slow  # two starts of the binary
def test_the_binary_takes_the_workdirs_setup_and_names_it_on_a_mismatch(
    tmp_path):
  """The printed command passes every check before work with the setup
  the binary reads from the workdir (here it stops at ``--replicates=1``,
  after the workdir's stamp accepted it: the tiny preset and the run's two
  --config overrides); another --preset or --config is refused naming the
  workdir's own flags."""
  from hmmprompt.figure3 import reporting
  workdir, lines = _tiny_workdir(tmp_path)
  command = reporting.noise_floor_command(workdir, lines)
  run = lambda argv: zygote.run(argv, dict(os.environ, JAX_PLATFORMS="cpu"))
  printed = run(shlex.split(command)[1:] + ["--replicates=1"])
  assert printed.returncode == 2 and printed.stderr.strip().splitlines() == [
      "error: a noise floor needs --trials and --replicates >= 2, --trials <= "
      "the setup's 2; got --trials=2 --replicates=1"], printed.stderr[-3000:]
  own = "--preset=tiny --config.pretrain.lr=0.005 --config.tune.lr=0.02"
  # An explicit --preset (the workdir ran with pretrain.lr 0.005) and a
  # --config both differ: one start of the binary names both.
  end = run(["-m", "experiments.noise_floor", f"--workdir={workdir}",
             "--preset=tiny", "--config.tune.lr=0.03"])
  assert end.returncode == 2, end.stderr[-3000:]
  [refusal] = end.stderr.strip().splitlines()
  assert refusal.startswith(f"error: {workdir} holds results of another "
                            f"setup ("), refusal
  for differs in ("pretrain.lr: 0.005 -> 0.003", "tune.lr: 0.02 -> 0.03"):
    assert differs in refusal and refusal.endswith(
        f"): drop --preset and --config.* to measure it with its own ({own})")
