"""``--cpu-profile=DIR``: each test's CPU seconds, for the suite's budget.

The suite is CPU-bound on 2 cores, so a test's cost is its CPU: user +
sys of the process that ran it and of the subprocesses it waited for
(``getrusage``, self and children; the children of tests/zygote.py's
zygotes report theirs). ``--durations`` gives wall time, which leaves out
a test's subprocesses on the other core and counts the waits for the core
it shares. Both move with this VM's speed (1.5x within hours,
docs/performance.md): compare tests within one run. Each process appends
one line per test to ``DIR/<pid>.jsonl``; the run's summary (totals, the
heaviest files and tests) ends the terminal report. Collection, imports
and set-up outside a test are not counted: ``/usr/bin/time`` gives the
whole.

  ./launch.sh test --cpu-profile=/tmp/cpu     # a fresh DIR per run
"""

import collections
import glob
import json
import os
import resource
import sys
import time

import pytest


def pytest_addoption(parser):
  parser.addoption("--cpu-profile", metavar="DIR", default=None,
                   help="append each test's CPU seconds (self and children) "
                   "to DIR/<pid>.jsonl and summarize them")


def _cpu() -> tuple[float, float]:
  s, c = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                          resource.RUSAGE_CHILDREN))
  # A zygote's children are its own: it reports their CPU (tests/zygote.py).
  forked = sys.modules.get("zygote")
  return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime + (
      forked.CPU_S[0] if forked else 0.0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  out = item.config.getoption("--cpu-profile")
  if out is None:
    yield
    return
  (s0, c0), t0 = _cpu(), time.monotonic()
  yield
  (s1, c1), t1 = _cpu(), time.monotonic()
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{os.getpid()}.jsonl"), "a") as f:
    f.write(json.dumps({"test": item.nodeid, "self_s": s1 - s0,
                        "children_s": c1 - c0, "wall_s": t1 - t0}) + "\n")


def pytest_terminal_summary(terminalreporter, config):
  out = config.getoption("--cpu-profile")
  if out is None or hasattr(config, "workerinput"):  # the controller only
    return
  rows = [json.loads(line) for path in glob.glob(os.path.join(out, "*.jsonl"))
          for line in open(path)]
  cpu = lambda r: r["self_s"] + r["children_s"]
  by_file = collections.Counter()
  for r in rows:
    by_file[r["test"].split("::")[0]] += cpu(r)
  write = terminalreporter.write_line
  write(f"CPU of {len(rows)} tests: {sum(map(cpu, rows)):.1f} s "
        f"({sum(r['children_s'] for r in rows):.1f} s in subprocesses); "
        f"lines in {out}")
  for path, s in by_file.most_common(10):
    write(f"{s:8.1f} s  {path}")
  for r in sorted(rows, key=cpu, reverse=True)[:15]:
    write(f"{cpu(r):8.1f} s  {r['test']}")
