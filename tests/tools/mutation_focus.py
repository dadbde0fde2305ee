r"""Mutants of one module against a named set of tests (docs/mutation.md).

  ./launch.sh mutants corpus    # once: mutmut generates mutants/ and runs
  python tests/tools/mutation_focus.py --module=corpus \
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

``--in_process``: a screening pass, for modules whose mutants mostly die
in the first test, where a fresh process per mutant costs more than its
tests (importing jax, flax and orbax; docs/mutation.md has the timings).
Each worker imports once and runs ``pytest.main`` for one mutant after
another, switching mutants as mutmut's trampolines do, at call time, and
clears jax's traces and the library's ``functools`` caches before each.
What else ran before a mutant stays imported and cached: a test module's
constants (``TINY = preset_config("tiny")``) and closures built at import
keep the code they were built with, so a mutant seen only there survives
here; rerun the
survivors in fresh processes (``--rerun_survivors``, without
``--in_process``) before listing them. A kill is a test failing under the
mutant; each worker runs the tests without a mutant before its first and
after its last, and stops if they fail, as a cache that a mutant left
behind would make them.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import queue
import subprocess
import sys
import threading

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
_FUNCTIONS = flags.DEFINE_list(
    "functions", None, "only the mutants of these functions or methods "
    "(e.g. forward_backward_parallel,_combine or Schedule.mine): a pass "
    "over what changed")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 600, "per mutant")
_SERVE = flags.DEFINE_bool("serve", False, "internal: an --in_process "
                           "worker")
_IN_PROCESS = flags.DEFINE_bool(
    "in_process", False, "screen: each worker runs its mutants in one "
    "process (survivors to be confirmed in fresh processes)")

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
      [sys.executable, "-m", "pytest", *_pytest_args(tests)],
      cwd=_MUTANTS_DIR, env=env,
      capture_output=True, text=True, timeout=_TIMEOUT.value, check=False)
  if proc.returncode == 5:
    raise ValueError(f"--tests selected no tests: {tests}")
  return {0: _SURVIVED, 1: _KILLED}.get(proc.returncode, _CRASHED)


def _regenerate() -> None:
  """Makes the mutants of sources edited since mutmut's last run afresh
  (mutmut's own generation, without its stats run: seconds, not minutes)
  and forgets the verdicts of every function whose code changed, as
  ``mutmut run`` does; a test written against an edited source then runs
  against it."""
  import mutmut.__main__ as mutmut_main  # pylint: disable=g-import-not-at-top
  metas = glob.glob(os.path.join(_MUTANTS_DIR, "**", "*.py.meta"),
                    recursive=True)
  before = {}
  for path in metas:
    with open(path) as f:
      before[path] = json.load(f)["hash_by_function_name"]
  mutmut_main.set_mutant_under_test("mutant_generation")
  mutmut_main.copy_src_dir()
  mutmut_main.copy_also_copy_files()
  mutmut_main.setup_source_paths()
  mutmut_main.create_mutants(_WORKERS.value)
  mutmut_main.set_mutant_under_test(None)
  os.environ.pop("MUTANT_UNDER_TEST", None)
  for path, old in before.items():
    with open(path) as f:
      meta = json.load(f)
    new = meta["hash_by_function_name"]
    changed = {fn for fn in new if old.get(fn) != new[fn]}
    if not changed:
      continue
    for key in meta["exit_code_by_key"]:
      if key.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0] in changed:
        meta["exit_code_by_key"][key] = None
    _write_json(path, meta)
    print(f"{path}: made afresh for {len(changed)} edited function(s)",
          flush=True)


def _write_json(path: str, obj) -> None:
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)


def _pytest_args(tests: list[str]) -> list[str]:
  return ["-x", "-q", "-p", "no:cacheprovider", "-m", "not integration",
          *tests]


def _serve(tests: list[str]) -> None:
  """A worker of ``--in_process``: reads mutant names from stdin, writes
  ``<code> <name>`` lines (pytest's exit code) to stdout; pytest's own
  output goes to stderr."""
  # As `python -m pytest` in mutants/: its copies (hmmprompt, experiments)
  # come first, not this script's folder.
  sys.path[0] = os.getcwd()
  import pytest  # pylint: disable=g-import-not-at-top
  out = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)

  import jax  # pylint: disable=g-import-not-at-top

  def run(name: str) -> int:
    os.environ["MUTANT_UNDER_TEST"] = name
    # A jitted function keeps the trace of its first call: without this, an
    # entry point jitted at import (validation.entry_point) or a test
    # module's jax.jit(kernel) ran the clean code under every mutant. The
    # library's functools caches hold functions built by the code of their
    # first call (pretrain.batches.window_fn's draw).
    jax.clear_caches()
    for module in list(sys.modules.values()):
      if getattr(module, "__name__", "").startswith("hmmprompt"):
        for value in list(vars(module).values()):
          if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    return int(pytest.main(_pytest_args(tests)))

  clean = lambda: run("")
  if clean() != 0:
    raise SystemExit("the tests fail without a mutant")
  print("ready", file=out, flush=True)
  # One name at a time, each sent after the last verdict: readline, since
  # iterating over stdin could wait for more than one line.
  for line in iter(sys.stdin.readline, ""):
    if name := line.strip():
      print(run(name), name, file=out, flush=True)
  if clean() != 0:
    raise SystemExit("the tests fail without a mutant after the mutants: a "
                     "mutant left a cache behind; rerun without --in_process")


def _in_process(todo: list[str], tests: list[str]):
  """Yields ``(name, verdict)`` as the ``--in_process`` workers report."""
  verdicts: queue.Queue = queue.Queue()
  # A shared queue, not fixed shares: a mutant that survives runs every
  # test (minutes), one that dies may stop at the first; fixed shares left
  # one worker idle while the other had half its list to go.
  names: queue.SimpleQueue = queue.SimpleQueue()
  for name in todo:
    names.put(name)

  def work() -> None:
    try:
      proc = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), "--serve",
           "--module=-", "--tests=" + ",".join(tests)], cwd=_MUTANTS_DIR,
          text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=subprocess.DEVNULL)
      for line in iter(proc.stdout.readline, ""):
        if line.split() != ["ready"]:
          code, name = line.split()
          verdicts.put((name, {0: _SURVIVED, 1: _KILLED}.get(int(code),
                                                             _CRASHED)))
        try:
          proc.stdin.write(names.get_nowait() + "\n")
          proc.stdin.flush()
        except queue.Empty:
          proc.stdin.close()
      verdicts.put(proc.wait())
    except Exception as e:  # pylint: disable=broad-except
      verdicts.put(e)

  running = min(_WORKERS.value, len(todo))
  for _ in range(running):
    threading.Thread(target=work, daemon=True).start()
  while running:
    item = verdicts.get()
    if isinstance(item, tuple):
      yield item
      continue
    running -= 1
    if item != 0:
      raise RuntimeError(f"an --in_process worker failed ({item!r}): its "
                         "clean run failed; rerun without --in_process")


def main(argv):
  del argv
  if _SERVE.value:
    return _serve(_TESTS.value)
  missing = [t for t in _TESTS.value if not os.path.exists(t.split("::")[0])]
  if missing:
    raise app.UsageError(f"--tests not found: {missing}")
  # Tests and sources edited since mutmut ran count too; a first run makes
  # mutants/ here (mutmut's generation alone, without its stats run).
  _regenerate()
  path = meta_path(_MODULE.value)
  if not os.path.exists(path):
    raise app.UsageError(f"no mutants at {path}: is hmmprompt/"
                         f"{_MODULE.value.replace('.', '/')}.py a module?")
  with open(path) as f:
    meta = json.load(f)
  todo = sorted(k for k, v in meta["exit_code_by_key"].items()
                if v is None or (_SURVIVORS.value and v == _SURVIVED))
  if _FUNCTIONS.value is not None:
    # mutmut's names: hmmprompt.smoothing.x__combine__mutmut_3 for _combine,
    # hmmprompt.scheduling.xǁScheduleǁmine__mutmut_2 for Schedule.mine.
    mangle = lambda f: "xǁ" + f.replace(".", "ǁ") if "." in f else "x_" + f
    wanted = {mangle(f): f for f in _FUNCTIONS.value}
    if unknown := set(wanted) - set(meta["hash_by_function_name"]):
      raise app.UsageError(
          f"--functions: {sorted(wanted[f] for f in unknown)} have no "
          f"mutants in {_MODULE.value} (functions, or Class.method)")
    todo = [k for k in todo
            if k.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0] in wanted]
  print(f"{len(todo)} mutants of {_MODULE.value} to run", flush=True)
  with concurrent.futures.ThreadPoolExecutor(_WORKERS.value) as pool:
    verdicts = (_in_process(todo, _TESTS.value) if _IN_PROCESS.value else
                zip(todo, pool.map(lambda n: _run_one(n, _TESTS.value),
                                   todo)))
    for name, code in verdicts:
      # Re-read: the file is rewritten after every verdict.
      with open(path) as f:
        meta = json.load(f)
      meta["exit_code_by_key"][name] = code
      _write_json(path, meta)
      print(f"{'survived' if code == _SURVIVED else 'detected'} {name}",
            flush=True)


if __name__ == "__main__":
  app.run(main)
