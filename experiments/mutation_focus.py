r"""Mutants of one module against a named set of tests (docs/mutation.md).

  ./launch.sh mutants corpus    # once: mutmut generates mutants/ and runs
  python -m experiments.mutation_focus --module=corpus \
      --tests=tests/test_corpus.py,tests/test_bayes_gap.py

mutmut runs each mutant against every test that covers the mutated
function, so a function that all of pretraining calls (``mask_tokens``,
``forward_backward``) costs 30-60 s a mutant. This runs the module's
unchecked mutants (``--rerun_survivors``: and its survivors) against the tests
named instead, each in a fresh
process (``MUTANT_UNDER_TEST``, mutmut's own switch), two at a time, and
records each verdict in mutmut's ``mutants/<module>.py.meta`` after it
lands, so ``mutation_scores`` counts it and a rerun resumes. The named
tests are a subset of mutmut's oracle, so a mutant they detect is detected;
a survivor here may still be killed by a test outside the set: rerun it
with ``mutmut run <name>`` before calling it a gap.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

from absl import app
from absl import flags

_MODULE = flags.DEFINE_string("module", None, "module under hmmprompt/, "
                              "e.g. corpus or pretrain.loop", required=True)
_TESTS = flags.DEFINE_list("tests", None, "pytest node ids or files",
                           required=True)
_WORKERS = flags.DEFINE_integer("workers", 2, "mutants run at once")
_SURVIVORS = flags.DEFINE_bool(
    "rerun_survivors", False, "run the survivors too (not only the unchecked): a "
    "second, wider set of tests after a fast first pass")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "per mutant")

_MUTANTS_DIR = "mutants"
# pytest's exit codes: 1 a test failed; 2-4 collection errors, internal
# errors or a crash on import, which mutmut scores as detected too (3).
_KILLED, _CRASHED, _SURVIVED = 1, 3, 0


def meta_path(module: str) -> str:
  return os.path.join(_MUTANTS_DIR, "hmmprompt",
                      module.replace(".", os.sep) + ".py.meta")


def _run_one(name: str, tests: list[str]) -> int:
  env = dict(os.environ, MUTANT_UNDER_TEST=name)
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
       "-m", "not integration", *tests], cwd=_MUTANTS_DIR, env=env,
      capture_output=True, text=True, timeout=_TIMEOUT.value, check=False)
  if proc.returncode == 5:
    raise ValueError(f"--tests selected no tests: {tests}")
  return {0: _SURVIVED, 1: _KILLED}.get(proc.returncode, _CRASHED)


def main(argv):
  del argv
  path = meta_path(_MODULE.value)
  if not os.path.exists(path):
    raise app.UsageError(f"no mutants at {path}: run ./launch.sh mutants "
                         f"{_MODULE.value} first (and stop it)")
  missing = [t for t in _TESTS.value if not os.path.exists(t.split("::")[0])]
  if missing:
    raise app.UsageError(f"--tests not found: {missing}")
  # mutmut copies tests/ when it runs; tests written since count too.
  shutil.copytree("tests", os.path.join(_MUTANTS_DIR, "tests"),
                  dirs_exist_ok=True)
  with open(path) as f:
    todo = sorted(k for k, v in json.load(f)["exit_code_by_key"].items()
                  if v is None or (_SURVIVORS.value and v == _SURVIVED))
  print(f"{len(todo)} mutants of {_MODULE.value} to run", flush=True)
  with concurrent.futures.ThreadPoolExecutor(_WORKERS.value) as pool:
    for name, code in zip(todo, pool.map(
        lambda n: _run_one(n, _TESTS.value), todo)):
      # Re-read: the file is rewritten after every verdict.
      with open(path) as f:
        meta = json.load(f)
      meta["exit_code_by_key"][name] = code
      with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
      os.replace(path + ".tmp", path)
      print(f"{'survived' if code == _SURVIVED else 'detected'} {name}",
            flush=True)


if __name__ == "__main__":
  app.run(main)
