"""The pretraining binary end to end (subprocesses): crash-resume, flags.
Data parallelism over devices and processes: test_multiprocess.py."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np

from hmmprompt import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


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
  out = _run_binary(str(tmp_path), "--config.trials=0")
  assert out.returncode != 0 and "trials must be an int >= 1" in out.stderr
  assert "Traceback" not in out.stderr
