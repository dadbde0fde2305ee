"""Every `python -m experiments.<binary> FLAGS` the README gives parses (its
flags exist and its config resolves: the binary's --print_config, which
runs nothing), and --print_config shows the chosen preset's values."""

import os
import re

import binaries  # tests/integration/binaries.py

ROOT = binaries.ROOT
# The binaries that take --config.* flags (and so --print_config).
_CONFIGURED = {"figure3": "experiments.figure3.__main__",
               "pretraining_curve": "experiments.pretraining_curve.__main__",
               "in_chunks": "experiments.in_chunks",
               "icl": "experiments.icl",
               "pretrain": "experiments.pretrain"}


def _readme_commands() -> list[tuple[str, list[str]]]:
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  out = []
  for m in re.finditer(r"python -m experiments\.(\w+)((?:\s+--[^\s`#]+)*)",
                       text):
    out.append((m.group(1), m.group(2).split()))
  return out


def test_the_readmes_commands_parse_and_print_config_shows_overrides():
  commands = _readme_commands()
  assert {name for name, _ in commands} >= {"figure3", "tour",
                                            "pretraining_curve"}
  runs = [(_CONFIGURED[name], args + ["--print_config"])
          for name, args in commands if name in _CONFIGURED]
  tiny = ["--preset=tiny", "--config.trials=3", "--print_config"]
  *ends, end = binaries.run_binaries(
      runs + [("experiments.figure3.__main__", tiny)])
  for (module, args), e in zip(runs, ends):
    assert e["returncode"] == 0, (module, args, e["stderr"][-2000:])
    assert re.search(r"^(trials|seeds) = \d+$", e["stdout"], re.M), (
        module, args)
  # --print_config shows the chosen preset's values with the overrides.
  assert end["returncode"] == 0, end["stderr"]
  lines = end["stdout"].splitlines()
  assert "trials = 3" in lines and "left_sizes = (4, 12)" in lines
  assert "task.seq_len = 16" in lines  # tiny's, not the default preset's
  assert all(" = " in line for line in lines)
