"""What the binaries log: JAX's probe for a TPU that is not there is not a
line of theirs (experiments/__init__.py; the binaries' own runs are checked
in tests/integration/test_binary_help.py and test_figure3_sweep.py; what
the pretraining binary prints as its result: test_pretrain_binary.py)."""

import logging
import os


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
