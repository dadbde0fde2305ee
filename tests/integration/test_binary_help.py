"""A binary's ``--help`` is short and starts with the flags a user sets;
``--helpfull`` lists every ``--config.<path>``; and a CPU run logs no line
that looks like an error (JAX's probe for libtpu)."""

import re
import subprocess
import sys

import pytest

import binaries  # tests/integration/binaries.py

ROOT = binaries.ROOT
# Every binary that defines --config.* flags (experiments.cli.define_config).
_CONFIGURED = ["experiments.figure3", "experiments.pretrain",
               "experiments.pretraining_curve", "experiments.in_chunks",
               "experiments.icl"]


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], capture_output=True,
                        text=True, timeout=120, cwd=ROOT)


def test_help_is_short_and_helpfull_lists_every_config_path():
  """Before: figure3's --help was 213 lines, nearly all --config.pretrain.*
  (adopted as key flags of the main module with experiments.cli's)."""
  runs = binaries.run_binaries([(module, [flag]) for module in _CONFIGURED
                                for flag in ("--help", "--helpfull")])
  for module, short, helpfull in zip(_CONFIGURED, runs[::2], runs[1::2]):
    assert short["returncode"] == 0, (module, short["stderr"])  # not absl's 1
    shown = short["stdout"]
    listed = re.findall(r"^  (--\S+?):", shown, re.M)
    assert {"--preset", "--workdir"} <= set(listed), shown
    assert not [f for f in listed if f.startswith("--config.")], shown
    usage = shown.split("flags:")[0]
    assert "--helpfull" in usage, shown  # the usage says so
    if module.endswith("figure3"):  # it names the flags a user sets
      for flag in ("--preset", "--panel", "--backbone", "--workdir",
                   "--workers", "--config.trials", "--config.left_sizes",
                   "--config.memory_sizes", "--print_config"):
        assert flag in usage, flag
    assert len(shown.splitlines()) < (60 if module.endswith("figure3")
                                      else 80), shown
    assert helpfull["returncode"] == 0, (module, helpfull["stderr"])
    full = helpfull["stdout"]
    assert re.search(r"^  --config\.pretrain\.\S+:", full, re.M), full[-2000:]
    assert len(full.splitlines()) > 2 * len(shown.splitlines()), module


_PROBE = "import jax; from absl import app; {}app.run(lambda _: print(jax.devices()))"


def test_a_cpu_run_does_not_log_jaxs_libtpu_probe():
  """The binaries (every one imports the ``experiments`` package) drop the
  line; without the package, an absl program on this machine shows it
  wherever JAX probes for a libtpu that is not installed."""
  ours = _run("-c", _PROBE.format("import experiments; "))
  assert ours.returncode == 0, ours.stderr
  assert "Unable to initialize backend" not in ours.stderr, ours.stderr
  plain = _run("-c", _PROBE.format(""))
  if "libtpu.so" not in plain.stderr:
    pytest.skip("JAX logs no libtpu probe here (a TPU, or no TPU plugin)")
  assert "Unable to initialize backend 'tpu'" in plain.stderr
