import os

# A persistent XLA compilation cache shared by this process and the
# subprocesses the integration tests start (they inherit the environment):
# the binaries compile the same programs as each other and as the in-process
# tests, so each is compiled once per run (cold) and reused on reruns.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_ROOT, ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The suite is compile-bound (small shapes, many programs), so it trades
# run time for compile time: LLVM's backend optimisations off (fast tier
# 165 s -> 109 s on 2 cores), and XLA:CPU's older fusion emitters, which
# compile ~3x faster than the MLIR ones that jax 0.10's XLA uses by default
# (a tuning program 0.9 -> 0.3 s, an eager op ~30% less). Every comparison
# in the tests is between runs under the same flags (subprocesses inherit
# them) or against references with tolerances.
for _flag in ("--xla_backend_optimization_level=0",
              "--xla_cpu_use_fusion_emitters=false"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                               _flag).strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import host_memory

# As the binaries do: XLA:CPU's per-step temporaries are then reused, not
# faulted in afresh (tests/test_host_memory.py).
host_memory.retain_freed_memory()


def random_dense_hmm(seed, num_states, vocab_size, zero_frac=0.0):
  """A generic (not near-deterministic) HMM with optional exact zeros."""
  rng = np.random.default_rng(seed)

  def rows(shape):
    x = rng.gamma(1.0, size=shape)
    if zero_frac:
      x *= rng.random(shape) >= zero_frac
      x[..., 0] += (x.sum(-1) == 0)  # keep every row a distribution
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)

  return hmm_lib.HMM(rows((num_states,)), rows((num_states, num_states)),
                     rows((num_states, vocab_size)))


@pytest.fixture(scope="session")
def tiny_hmm():
  return random_dense_hmm(0, 3, 4)


@pytest.fixture(scope="session")
def paper_hmm():
  """Appendix D's near-deterministic generator, |H| = 30, |X| = 10."""
  return hmm_lib.random_hmm(jax.random.PRNGKey(7), 30, 10)


_INTEGRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "integration")


def pytest_collection_modifyitems(config, items):
  """Everything under tests/integration/ (subprocesses, the notebook,
  end-to-end sweeps) is ``slow``: ``-m "not slow"`` is the fast tier."""
  del config
  for item in items:
    if str(item.path).startswith(_INTEGRATION):
      item.add_marker(pytest.mark.slow)
