import importlib.metadata
import os
import re
import subprocess

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
# 165 s -> 109 s on 2 cores), and XLA:CPU's older fusion emitters
# (FAST_COMPILE), which compile ~3x faster than the MLIR ones jax 0.10's
# XLA uses by default (a tuning program 0.9 -> 0.3 s, an eager op ~30%
# less; the whole suite 5 min 52 s -> 3 min 38 s from a fresh clone).
# Comparisons in the tests are between runs under the same flags
# (subprocesses inherit them) or against references with tolerances, but
# for the ``default_compiler`` tests: bit-for-bit claims of the library
# that hold under XLA's default compiler, which the older emitters do not
# keep (a stacked trial and its separate run differ in the last bits), and
# the README tour's printed numbers, made by users' compiler. Those run in
# a pytest subprocess under XLA's defaults, none of these flags
# (pytest_pyfunc_call below); warm, their optimised code also runs faster
# (the tour's test 58 -> 33-37 CPU-s warm: it pretrains and tunes for
# most of its time). And each program's LLVM code in one module rather
# than split for parallel codegen, which on 2 busy cores only adds
# per-module work (test_transformer + test_tasks cold, one process: user
# 80.3 -> 73.5 s, mean of 4 and 3 interleaved runs, 2026-11-25). Under
# the older emitters at level 0 the split moves last bits, as the other
# flags do; every comparison is under one set of flags, as above.
# The flags were measured with jaxlib 0.10, and a later XLA dropped the
# first: jaxlib 0.11.2 (the accelerator image, 2026-11-26) aborts the
# whole run on it as an unknown flag. So they are set only for 0.10.x;
# elsewhere the suite runs under XLA's defaults, slower to compile.
FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"
_SUITE_FLAGS = ("--xla_backend_optimization_level=0",
                "--xla_cpu_parallel_codegen_split_count=1", FAST_COMPILE)
_DEFAULT_COMPILER = "HMMPROMPT_TEST_DEFAULT_COMPILER"  # set in that subprocess
_FLAGS_KNOWN = importlib.metadata.version("jaxlib").startswith("0.10.")
for _flag in _SUITE_FLAGS if (_FLAGS_KNOWN and
                              not os.environ.get(_DEFAULT_COMPILER)) else ():
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                               _flag).strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import glibc
import zygote  # tests/zygote.py

# --cpu-profile=DIR: each test's CPU seconds (tests/cpu_profile.py).
pytest_plugins = ["cpu_profile"]

# As the binaries do: XLA:CPU's per-step temporaries are then reused, not
# faulted in afresh (tests/test_glibc.py).
glibc.retain_freed_memory()


# The committed Figure 3 protocol that tests rebuild and redraw.
CPU_PAPER = os.path.join(_ROOT, "docs", "results", "figure3-cpu-paper")


def without_fma() -> bool:
  """Whether ``XLA_FLAGS`` caps the ISA below FMA (``SSE*`` or ``AVX``):
  Appendix D's draws round differently there, so the committed HMMs
  (drawn with FMA) are not drawn again bit for bit (docs/performance.md,
  "On any CPU")."""
  return bool(re.search(r"--xla_cpu_max_isa=(SSE|AVX(?!2|512))",
                        os.environ.get("XLA_FLAGS", "")))


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


@pytest.fixture
def kernels_run(monkeypatch):
  """The ``method`` of each :func:`hmm.smooth_by` call from here on, in
  order (``None``: not given); calls happen when a function is traced, so
  ``jax.eval_shape`` shows a jitted path's kernels without compiling it.
  The values can agree to float rounding whichever kernel ran: this tells
  which did."""
  seen = []
  real = hmm_lib.smooth_by

  def spy(hmm, evidence_TxH, *method):
    seen.append(method[0] if method else None)
    return real(hmm, evidence_TxH, *method)

  monkeypatch.setattr(hmm_lib, "smooth_by", spy)
  return seen


@pytest.fixture
def small_disk(tmp_path):
  """``mount(*options)``: a tmpfs at a fresh directory (``"size=128k"``; a
  second call ``"remount", "size=..."``), a full disk on demand; unmounted
  after the test. Mounting needs root: elsewhere the test is skipped."""
  disk = tmp_path / "disk"
  disk.mkdir()

  def mount(*options: str):
    if subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options),
                       "tmpfs", str(disk)], capture_output=True,
                      check=False).returncode:
      pytest.skip("mounting a tmpfs needs root")
    return disk
  yield mount
  subprocess.run(["umount", str(disk)], capture_output=True, check=False)


@pytest.fixture(scope="session")
def paper_hmm():
  """Appendix D's near-deterministic generator, |H| = 30, |X| = 10."""
  return hmm_lib.random_hmm(jax.random.PRNGKey(7), 30, 10)


_INTEGRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            "integration")


def pytest_collection_modifyitems(config, items):
  """Everything under tests/integration/ (subprocesses, the notebook,
  end-to-end sweeps) and every ``default_compiler`` test (a pytest
  subprocess) is ``integration`` and ``slow``. ``-m "not slow"`` is the
  fast tier, the one-minute check: it also leaves out the in-process tests
  marked ``slow`` by hand (pretraining loops, many-program comparisons).
  ``-m "not integration"`` is mutmut's oracle: every in-process test."""
  del config
  for item in items:
    if (str(item.path).startswith(_INTEGRATION)
        or item.get_closest_marker("default_compiler") is not None):
      item.add_marker(pytest.mark.integration)
      item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """A ``default_compiler`` test runs in a pytest subprocess (a zygote's
  child, tests/zygote.py) whose XLA runs under its defaults (none of the
  suite's flags above); it passes or fails there, with that run's
  output."""
  if (pyfuncitem.get_closest_marker("default_compiler") is None
      or os.environ.get(_DEFAULT_COMPILER)):
    return None
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if f not in _SUITE_FLAGS]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), **{_DEFAULT_COMPILER: "1"})
  proc = zygote.run(["-m", "pytest", "-q", "-p", "no:cacheprovider",
                     pyfuncitem.nodeid], env, timeout=600)
  if proc.returncode != 0:
    pytest.fail(f"under XLA's default compiler (a subprocess):\n"
                f"{proc.stdout[-6000:]}{proc.stderr[-2000:]}", pytrace=False)
  return True
