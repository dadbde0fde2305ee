"""What the experiment binaries share around the library call: flags,
the command line's checks, usage errors and the outputs' report."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

from absl import app
from absl import flags
import jax

from hmmprompt import config_flags
from hmmprompt import glibc
from hmmprompt import sharding


def _end(what, status: int, say: bool = True) -> NoReturn:
  """Prints ``error: <what>`` and how to resume (:func:`resume_hint`), and
  exits at once: the interpreter's exit is where orbax's threads print
  pages."""
  if say:
    workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
    print(f"error: {what}{resume_hint(workdir)}", file=sys.stderr,
          flush=True)
  sys.stdout.flush()
  os._exit(status)


def resume_hint(workdir: str | None) -> str:
  """What a fault's line adds: how to resume and where finished work is
  kept, where the ``--workdir`` holds some; nothing where it holds none
  (nothing started: a rerun would start afresh); without one (a binary's
  own outputs), how to resume alone."""
  if not workdir:
    return "; rerun the same command to resume"
  if not (os.path.isdir(workdir) and os.listdir(workdir)):
    return ""
  return (f"; rerun the same command to resume (finished work is kept in "
          f"{workdir})")


def make_dir(path: str, flag: str = "--workdir") -> str:
  """Creates directory ``path`` (and its parents) where missing and returns
  it; ``ValueError`` (a usage error: before any work, not a fault to
  resume) naming ``flag`` and why it cannot be one: a file, or a directory
  that cannot be created or written."""
  if os.path.lexists(path) and not os.path.isdir(path):
    what = "a file" if os.path.isfile(path) else "something else"
    raise ValueError(f"{flag} {path} is {what}, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    # The usual cause: a parent that is a file (ENOTDIR names none).
    up = os.path.dirname(os.path.abspath(path))
    while up != os.path.dirname(up) and not os.path.lexists(up):
      up = os.path.dirname(up)
    why = (f"{up} is a file" if os.path.isfile(up) else
           (e.strerror or str(e)).lower())
    raise ValueError(f"{flag} {path}: cannot create: {why}") from None
  try:  # O_TMPFILE where it can: nothing left behind, even when killed
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as e:
    raise ValueError(f"{flag} {path}: cannot write: "
                     f"{(e.strerror or str(e)).lower()}") from None
  return path


def _is_worker() -> bool:
  """Whether this process is a ``--workers`` child (``--worker`` set)."""
  return "worker" in flags.FLAGS and flags.FLAGS["worker"].value is not None


def _stop(signum, _) -> None:
  # Ends here, not by raising KeyboardInterrupt: that can land in a garbage
  # collection callback, which swallows it. A --workers process leaves the
  # line to its parent (Ctrl-C reaches the whole process group).
  _end(f"stopped by {signal.Signals(signum).name}", 128 + signum,
       say=not _is_worker())


def one_line_errors(main: Callable) -> Callable:
  """``main`` whose usage errors end the binary with ``error: <what is
  wrong>`` on stderr and status 2, not absl's whole module help first; its
  faults (``OSError``: a full disk, a missing directory; SIGINT, SIGTERM)
  end it at once with one such line saying how to resume where work was
  kept (:func:`resume_hint`), status 1 or 128 + the signal. Finished work
  is on disk by then (atomic writes)."""
  @functools.wraps(main)
  def main_with_one_line_errors(argv):
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, _stop)
    try:
      return main(argv)
    except app.UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    except OSError as e:
      _end(e, 1, say=not _told_parent(e))
  return main_with_one_line_errors


def _told_parent(what) -> bool:
  """Whether this ``--workers`` process left ``what`` for its parent, which
  stops the other workers and ends with the line (workers.error_path)."""
  if not _is_worker():
    return False
  # Here, not at the top: only the figure3 binaries (which import it
  # already) have workers; the pretrain binary needs none of figure3.
  from hmmprompt.figure3 import workers  # pylint: disable=g-import-not-at-top
  try:
    with open(workers.error_path(flags.FLAGS["claims"].value,
                                 flags.FLAGS["worker"].value), "w") as f:
      f.write(str(what))
    return True
  except OSError:  # the same full disk, say: the line is printed here
    return False


def define_config(default_cfg, flag_values=flags.FLAGS) -> ConfigOverrides:
  """``--config.<path>`` string flags for every leaf of ``default_cfg``
  (:func:`config_flags.leaves`). They are registered to
  :mod:`hmmprompt.config_flags`, not to this module, so a binary's
  ``flags.adopt_module_key_flags(cli)`` does not make them key flags:
  ``--help`` shows the binary's module docstring (its usage: the flags
  set most often, the common ``--config`` paths) and its own flags, and
  ``--helpfull`` every ``--config.<path>`` too."""
  for path, hint in config_flags.leaves(default_cfg).items():
    value = functools.reduce(getattr, path.split("."), default_cfg)
    flags.DEFINE_string(f"{config_flags.PREFIX}.{path}", None,
                        f"{getattr(hint, '__name__', hint)}; the default "
                        f"preset's {value!r} (--print_config shows the "
                        f"chosen --preset's)", flag_values=flag_values,
                        module_name=config_flags.__name__)
  return ConfigOverrides(tuple(config_flags.leaves(default_cfg)), flag_values)


@dataclasses.dataclass(frozen=True)
class ConfigOverrides:
  paths: tuple[str, ...]
  flag_values: Any

  def value(self) -> dict[str, str]:
    """The ``--config.*`` flags given on the command line."""
    flag = lambda path: self.flag_values[f"{config_flags.PREFIX}.{path}"]
    return {p: flag(p).value for p in self.paths
            if flag(p).value is not None}


_INTERNAL = "hmmprompt.figure3.workers"  # where --worker's work is done


def define_worker_flags(what: str) -> tuple[flags.FlagHolder, ...]:
  """``--workers`` (:mod:`hmmprompt.figure3.workers`) and what it passes
  its workers: ``--worker`` (the index), ``--claims`` (their directory)."""
  return (
      flags.DEFINE_integer(
          "workers", 1, f"processes on this machine, one per core, each "
          f"taking the next unclaimed stack of {what} (CPU only; 0: one per "
          f"core, at most one per 4 GB of free memory)"),
      # Internal, so not the binary's key flags: --helpfull lists them.
      flags.DEFINE_integer("worker", None, "internal: this worker's index "
                           "(set by --workers)", module_name=_INTERNAL),
      flags.DEFINE_string("claims", None, "internal: the workers' shared "
                          "claims directory", module_name=_INTERNAL))


def define_print_config():
  return flags.DEFINE_bool(
      "print_config", False, "print the resolved configuration (the "
      "--preset with every --config.<path> override applied; --helpfull "
      "shows the default preset's values), one `path = value` line a leaf, "
      "and run nothing")


def print_config(cfg) -> None:
  print(*config_flags.describe(cfg), sep="\n")


_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "opt-in: keep every compiled XLA program in "
    "this directory (e.g. DIR/jax-cache under the --workdir) and reuse it "
    "in later runs, which then skip their compiles (the JAX_COMPILATION_"
    "CACHE_DIR variable does the same)")


def start(argv, **required) -> float:
  """Checks the command line (no positional arguments; every ``required``
  flag set), turns on ``--compilation_cache`` and retains freed host
  memory (XLA:CPU's per-step temporaries); returns the start time."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name, value in required.items():
    if not value:
      raise app.UsageError(f"--{name} is required")
  if path := _COMPILATION_CACHE.value:
    try:
      make_dir(path, "--compilation_cache")
    except ValueError as e:
      raise app.UsageError(str(e)) from e
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  glibc.retain_freed_memory()
  if _is_worker():
    glibc.end_with_parent()  # whatever ends the parent (its SIGTERM, a kill)
  return time.perf_counter()


@contextlib.contextmanager
def usage_errors():
  """A ``ValueError`` raised inside (bad flags, config or workdir) ends the
  binary as a usage error; anything else keeps its traceback."""
  try:
    yield
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def done(t0: float, **outputs: str) -> None:
  """Prints ``done in <seconds>s`` and a ``name: path`` line per output."""
  width = max(map(len, outputs), default=0) + 1
  print(f"done in {time.perf_counter() - t0:.0f}s" + "".join(
      f"\n{name + ':':<{width}} {path}" for name, path in outputs.items()))


def define_distributed_flags() -> Callable[[], None]:
  """``--distributed`` and its settings; returns ``initialize()`` (before
  any JAX computation): joins the processes, or refuses the settings."""
  on = flags.DEFINE_bool(
      "distributed", False, "data-parallel over several processes (hosts): "
      "call jax.distributed.initialize(), which finds the three settings "
      "below on SLURM, Open MPI and TPU VMs")
  settings = {
      "--coordinator_address": flags.DEFINE_string(
          "coordinator_address", None, "--distributed: HOST:PORT of process "
          "0's coordinator (default: auto-detected, or "
          "$JAX_COORDINATOR_ADDRESS); 127.0.0.1:PORT runs several processes "
          "on one machine"),
      "--num_processes": flags.DEFINE_integer(
          "num_processes", None, "--distributed: how many processes "
          "(default: auto-detected)"),
      "--process_id": flags.DEFINE_integer(
          "process_id", None, "--distributed: this process's index in [0, "
          "num_processes) (default: auto-detected)")}

  def initialize() -> None:
    if on.value:
      sharding.initialize_distributed(*(f.value for f in settings.values()))
    elif given := [k for k, f in settings.items() if f.value is not None]:
      raise ValueError(f"{', '.join(given)} need --distributed")
  return initialize
