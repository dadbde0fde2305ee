"""Runs of the binaries that end before any computation (usage errors,
refusals, ``--help``, ``--print_config``), each in a child of a zygote
(tests/zygote.py): ``python -m MODULE ARGS`` without its start-up.

Such a run is mostly Python start-up and imports (~2 s on 2 cores, nearly
all of it jax). The child runs its binary as ``python -m`` does
(``runpy`` as ``__main__``, ``sys.argv[0]`` the module's file: absl's
usage text and key flags are the main module's), with its own stdout,
stderr and exit status. The zygote defines no binary's flags, parses none
and starts no JAX backend, so every child starts from a fresh binary. (Its
``--helpfull`` also lists the flags of what the zygote imported, where the
binary alone would not import it: orbax's, for
``experiments.ginc_release``.)
"""

import zygote  # tests/zygote.py

ROOT = zygote.ROOT


def run_binaries(commands: list[tuple[str, list[str]]],
                 env: dict | None = None) -> list[dict]:
  """``[{"returncode", "stdout", "stderr"}]``, one per ``(module, args)``
  of ``commands``, each as ``python -m MODULE *ARGS`` would end."""
  ends = [zygote.run(["-m", module, *args], env) for module, args in commands]
  return [{"returncode": e.returncode, "stdout": e.stdout, "stderr": e.stderr}
          for e in ends]


def usage_errors(module: str, argvs: list[list[str]],
                 env: dict | None = None) -> list[dict]:
  """:func:`run_binaries` of one binary's command lines."""
  return run_binaries([(module, args) for args in argvs], env)
