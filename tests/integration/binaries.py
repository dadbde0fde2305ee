"""Runs of the binaries that end before any computation (usage errors,
refusals, ``--help``, ``--print_config``), many in one subprocess.

Such a run is mostly Python start-up and imports (~2 s on 2 cores, nearly
all of it jax). :func:`run_binaries` starts one subprocess that imports
what every binary imports (jax, flax, optax, orbax, pretraining,
``experiments``) and forks one child per command line. Each child runs
its binary as ``python -m MODULE ARGS`` does (``runpy`` as ``__main__``,
``sys.argv[0]`` the module's file: absl's usage text and key flags are
the main module's), with its own stdout, stderr and exit status. The
parent defines no binary's flags, parses none and starts no JAX backend,
so every child starts from a fresh binary. (Its ``--helpfull`` also lists
the flags of what the parent imported, where the binary alone would not
import it: orbax's, for ``experiments.ginc_release``.)
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

_DRIVER = r"""
import importlib, json, os, runpy, sys, tempfile
# What every binary imports: a module only some import (chex, through the
# studies) would show its flags in the others' --helpfull.
for shared in ("jax", "flax.linen", "optax", "orbax.checkpoint",
               "experiments", "experiments.cli", "hmmprompt.pretrain"):
  importlib.import_module(shared)
out = []
for module, args in json.loads(sys.argv[1]):
  with tempfile.TemporaryFile("w+") as o, tempfile.TemporaryFile("w+") as e:
    pid = os.fork()
    if pid == 0:
      os.dup2(o.fileno(), 1)
      os.dup2(e.fileno(), 2)
      sys.argv = [module] + args  # runpy sets [0] to the module's file
      try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
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


def run_binaries(commands: list[tuple[str, list[str]]],
                 env: dict | None = None) -> list[dict]:
  """``[{"returncode", "stdout", "stderr"}]``, one per ``(module, args)``
  of ``commands``, each as ``python -m MODULE *ARGS`` would end."""
  proc = subprocess.run(
      [sys.executable, "-c", _DRIVER, json.dumps(commands)],
      capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def usage_errors(module: str, argvs: list[list[str]],
                 env: dict | None = None) -> list[dict]:
  """:func:`run_binaries` of one binary's command lines."""
  return run_binaries([(module, args) for args in argvs], env)
