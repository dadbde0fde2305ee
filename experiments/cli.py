"""What every experiment binary's ``main`` does around the library call:
refuse stray arguments, set up host memory, turn the library's
``ValueError`` on bad input into a usage error (no traceback), and print
where the outputs are."""

from __future__ import annotations

import contextlib
import time

from absl import app

from hmmprompt import glibc


def start(argv, **required) -> float:
  """Checks the command line (no positional arguments; every ``required``
  flag value set) and retains freed host memory (XLA:CPU's per-step
  temporaries); returns the start time for :func:`done`."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name, value in required.items():
    if not value:
      raise app.UsageError(f"--{name} is required")
  glibc.retain_freed_memory()
  return time.perf_counter()


@contextlib.contextmanager
def usage_errors():
  """A ``ValueError`` raised inside (bad flags, a bad config, a workdir of
  another setup) ends the binary as a usage error; anything else keeps its
  traceback."""
  try:
    yield
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def done(t0: float, **outputs: str) -> None:
  """Prints ``done in <seconds>s`` and one ``name: path`` line per
  output."""
  width = max(map(len, outputs), default=0) + 1
  print(f"done in {time.perf_counter() - t0:.0f}s" + "".join(
      f"\n{name + ':':<{width}} {path}" for name, path in outputs.items()))
