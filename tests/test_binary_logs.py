"""What the binaries log: JAX's probe for a TPU that is not there is not a
line of theirs (experiments/__init__.py; the binaries' own runs are checked
in tests/integration/test_binary_help.py and test_figure3_sweep.py); what
the pretraining binary prints as its result."""

import logging
import os
import re
import subprocess
import sys

import pytest

import experiments  # noqa: F401  (every binary imports it first)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = ("Unable to initialize backend 'tpu': INTERNAL: Failed to open "
          "libtpu.so: libtpu.so: cannot open shared object file: No such "
          "file or directory")


def _passes(msg: str) -> bool:
  logger = logging.getLogger("jax._src.xla_bridge")
  return bool(logger.filter(logger.makeRecord(
      logger.name, logging.INFO, __file__, 1, msg, (), None)))


def test_jaxs_libtpu_probe_is_dropped_and_nothing_else():
  assert not _passes(_PROBE)
  # A TPU whose libtpu loads but fails, another backend that fails, and
  # the rest of JAX's lines are still logged.
  for kept in ("Unable to initialize backend 'tpu': ABORTED: The TPU is "
               "already in use by process 123",
               "Unable to initialize backend 'cuda': no CUDA-capable device "
               "is detected",
               "Remote TPU is not linked into jax; skipping remote TPU."):
    assert _passes(kept), kept


@pytest.mark.integration
@pytest.mark.slow  # two runs of the binary (~25 s)
def test_pretrain_prints_each_trials_final_metrics_once(tmp_path):
  """experiments.pretrain's result: a line per trial, its numbers as
  numbers (not a dict's repr with ``np.float64(...)``), once; a rerun of
  the finished run prints the same lines and evaluates (logs) nothing."""
  def run():
    done = subprocess.run(
        [sys.executable, "-m", "experiments.pretrain", "--preset=tiny",
         f"--workdir={tmp_path}", "--config.trials=2",
         "--config.pretrain.steps=20"], cwd=_ROOT, capture_output=True,
        text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
  first, again = run(), run()
  printed = [l for l in first.stdout.splitlines() if l.startswith("trial")]
  assert len(printed) == 2, first.stdout
  for k, line in enumerate(printed):
    assert re.fullmatch(rf"trial {k}: step 20, ce_gap \d+\.\d{{4}}, tv "
                        r"\d\.\d{4}, mlm_ce \d+\.\d{4}, bayes_ce \d+\.\d{4}, "
                        r"\d+ s of training", line), line
  assert "float64" not in first.stdout + again.stdout
  assert [l for l in again.stdout.splitlines() if l.startswith("trial")] == (
      printed)
  assert "mlm_ce" not in again.stderr, again.stderr[-3000:]
