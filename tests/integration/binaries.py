"""Bad-flag runs of a binary, many in one subprocess.

A binary's usage errors end before any computation, so a run is mostly
Python start-up and imports (~1.5 s on 2 cores). :func:`usage_errors`
imports the binary once in one subprocess and forks one child per command
line: each child calls ``absl.app.run(main, argv)``, as ``python -m
binary ARGS`` would, with its own stdout, stderr and exit status. The
parent never parses flags or starts a JAX backend, so every child starts
from a freshly imported binary.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

_DRIVER = r"""
import importlib, json, os, sys, tempfile
from absl import app
module, argvs = sys.argv[1], json.loads(sys.argv[2])
main = importlib.import_module(module).main
out = []
for args in argvs:
  with tempfile.TemporaryFile("w+") as o, tempfile.TemporaryFile("w+") as e:
    pid = os.fork()
    if pid == 0:
      os.dup2(o.fileno(), 1)
      os.dup2(e.fileno(), 2)
      try:
        app.run(main, argv=[module] + args)
        code = 0
      except SystemExit as x:  # app.run exits with main's return value
        code = (0 if x.code is None else
                x.code if isinstance(x.code, int) else 1)
      except BaseException:  # a traceback: printed, as python -m would
        import traceback
        traceback.print_exc()
        code = 1
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    _, status = os.waitpid(pid, 0)
    o.seek(0)
    e.seek(0)
    out.append({"returncode": os.waitstatus_to_exitcode(status),
                "stdout": o.read(), "stderr": e.read()})
print(json.dumps(out))
"""


def usage_errors(module: str, argvs: list[list[str]],
                 env: dict | None = None) -> list[dict]:
  """``[{"returncode", "stdout", "stderr"}]``, one per command line of
  ``argvs``, each as ``python -m MODULE *ARGS`` would end; ``module`` is
  the binary's importable module (``experiments.figure3.__main__``)."""
  proc = subprocess.run(
      [sys.executable, "-c", _DRIVER, module, json.dumps(argvs)],
      capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
