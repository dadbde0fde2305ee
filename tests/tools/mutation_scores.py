r"""Mutation scores per module, from mutmut's results (docs/mutation.md).

  ./launch.sh mutants tuning heads tasks     # runs mutmut, then this
  python tests/tools/mutation_scores.py [--modules=tuning,heads]

A module's score is detected / checked: a mutant is detected when a test
failed (killed) or the run crashed or ran past mutmut's time limit
(``timeout``: the mutant broke the program). Survivors are listed, for the
docs' table of equivalent mutants and of the tests still to write.
"""

from __future__ import annotations

import collections
import subprocess
import sys

from absl import app
from absl import flags

_MODULES = flags.DEFINE_list("modules", None,
                             "modules under hmmprompt/ (default: all run)")
_SURVIVORS = flags.DEFINE_bool("survivors", True, "list the survivors")

_DETECTED = ("killed", "timeout", "segfault", "suspicious",
             "caught by type check")


def module_of(mutant: str) -> str:
  """``hmmprompt.tuning.loop.x_run__mutmut_3`` -> ``tuning.loop``."""
  dotted = mutant.split(".x", 1)[0]
  return dotted.removeprefix("hmmprompt.")


def read_results() -> list[tuple[str, str]]:
  """``(mutant, status)`` of every mutant mutmut generated."""
  out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all",
                        "true"], capture_output=True, text=True, check=True)
  rows = []
  for line in out.stdout.splitlines():
    name, sep, status = line.strip().rpartition(": ")
    if sep:
      rows.append((name, status))
  return rows


def main(argv):
  del argv
  wanted = _MODULES.value
  counts = collections.defaultdict(collections.Counter)
  survivors = collections.defaultdict(list)
  for name, status in read_results():
    module = module_of(name)
    if wanted and not any(module == m or module.startswith(m + ".")
                          for m in wanted):
      continue
    counts[module][status] += 1
    if status == "survived":
      survivors[module].append(name)
  print("| module | mutants | checked | detected | survived | no tests | "
        "score |")
  print("|---|---|---|---|---|---|---|")
  for module in sorted(counts):
    c = counts[module]
    checked = sum(c.values()) - c["not checked"] - c["skipped"]
    detected = sum(c[s] for s in _DETECTED)
    score = f"{100 * detected / checked:.1f}%" if checked else "-"
    print(f"| {module} | {sum(c.values())} | {checked} | {detected} | "
          f"{c['survived']} | {c['no tests']} | {score} |")
  if _SURVIVORS.value:
    for module in sorted(survivors):
      print(f"\n{module}: " + " ".join(
          n.rsplit(".", 1)[-1] for n in survivors[module]))


if __name__ == "__main__":
  app.run(main)
