"""What the binaries share: flags, the command line's checks, errors, report."""

import contextlib
import functools
import os
import signal
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from typing import NoReturn

from absl import app
from absl import flags
import jax

from hmmprompt import config_flags
from hmmprompt import glibc
from hmmprompt import sharding


def _end(what, status: int, say: bool = True) -> NoReturn:
  """Prints ``error: <what>`` and how to resume, and exits at once (at the
  interpreter's exit orbax's threads print pages)."""
  if say:
    workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
    print(f"error: {what}{resume_hint(workdir)}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  if workers := sys.modules.get("hmmprompt.figure3.workers"):
    workers.stop_all()  # no worker or claims folder outlives this process
  os._exit(status)


def resume_hint(workdir: str | None) -> str:
  """How to resume, and where work is kept ("" where ``workdir`` is empty)."""
  if workdir and not (os.path.isdir(workdir) and os.listdir(workdir)):
    return ""
  return "; rerun the same command to resume" + (
      f" (finished work is kept in {workdir})" if workdir else "")


def make_dir(path: str, flag: str = "--workdir") -> str:
  """``path``, made a directory if missing; else ValueError naming ``flag``."""
  if os.path.lexists(path) and not os.path.isdir(path):
    what = "a file" if os.path.isfile(path) else "something else"
    raise ValueError(f"{flag} {path} is {what}, not a directory")
  why = lambda e: (e.strerror or str(e)).lower()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:  # usually a parent that is a file (ENOTDIR names none)
    up = os.path.dirname(os.path.abspath(path))
    while up != os.path.dirname(up) and not os.path.lexists(up):
      up = os.path.dirname(up)
    raise ValueError(f"{flag} {path}: cannot create: " + (
        f"{up} is a file" if os.path.isfile(up) else why(e))) from None
  try:  # O_TMPFILE where it can: nothing left behind, even when killed
    tempfile.TemporaryFile(dir=path).close()
  except OSError as e:
    raise ValueError(f"{flag} {path}: cannot write: {why(e)}") from None
  return path


def _is_worker() -> bool:  # a --workers child (--worker set)
  return "worker" in flags.FLAGS and flags.FLAGS["worker"].value is not None


def one_line_errors(main: Callable) -> Callable:
  """``main`` ending a usage error with ``error: <what>``, status 2 (not
  absl's whole help), and a fault (``OSError``, SIGINT, SIGTERM) at once
  with such a line and how to resume, status 1 or 128 + the signal."""
  @functools.wraps(main)
  def main_with_one_line_errors(argv):
    # Not KeyboardInterrupt: a garbage collection callback can swallow it. A
    # worker leaves the line to its parent (Ctrl-C reaches the process group).
    stop = lambda signum, _: _end(f"stopped by {signal.Signals(signum).name}",
                                  128 + signum, say=not _is_worker())
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, stop)
    if _is_worker():  # a worker whose parent is gone (SIGKILL) ends too
      parent = os.getppid()
      def end_with_parent():
        while os.getppid() == parent:
          time.sleep(1)
        os._exit(128 + signal.SIGTERM)
      threading.Thread(target=end_with_parent, daemon=True).start()
    try:
      return main(argv)
    except app.UsageError as e:
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    except OSError as e:
      _end(e, 1, say=not _told_parent(e))
  return main_with_one_line_errors


def _told_parent(what) -> bool:
  """Whether this worker left ``what`` for its parent (workers.error_path)."""
  if not _is_worker():
    return False
  from hmmprompt.figure3 import workers  # pylint: disable=g-import-not-at-top
  try:
    with open(workers.error_path(flags.FLAGS["claims"].value,
                                 flags.FLAGS["worker"].value), "w") as f:
      f.write(str(what))
    return True
  except OSError:  # the same full disk, say: the line is printed here
    return False


def define_config(default_cfg, flag_values=flags.FLAGS):
  """``--config.<path>`` string flags for every leaf of ``default_cfg``,
  registered to :mod:`hmmprompt.config_flags` (so ``--helpfull`` lists
  them, ``--help`` not); ``.value()``: ``{path: value}`` of those given."""
  paths = config_flags.leaves(default_cfg)
  for path, hint in paths.items():
    value = functools.reduce(getattr, path.split("."), default_cfg)
    flags.DEFINE_string(f"{config_flags.PREFIX}.{path}", None,
                        f"{getattr(hint, '__name__', hint)}; the default "
                        f"preset's {value!r} (--print_config shows the "
                        f"chosen --preset's)", flag_values=flag_values,
                        module_name=config_flags.__name__)
  given = lambda p: flag_values[f"{config_flags.PREFIX}.{p}"].value
  return types.SimpleNamespace(value=lambda: {
      p: given(p) for p in paths if given(p) is not None})


def define_worker_flags(what: str) -> tuple[flags.FlagHolder, ...]:
  """``--workers`` (:mod:`hmmprompt.figure3.workers`) and, internal (only
  ``--helpfull`` lists them), ``--worker`` and ``--claims``."""
  internal = "hmmprompt.figure3.workers"
  return (flags.DEFINE_integer("workers", 1, f"processes here, each taking "
                               f"the next unclaimed stack of {what} (CPU; 0: "
                               "one per core and per 4 GB free memory)"),
          flags.DEFINE_integer("worker", None, "internal: this worker's "
                               "index", module_name=internal),
          flags.DEFINE_string("claims", None, "internal: the workers' "
                              "claims directory", module_name=internal))


def define_print_config():
  return flags.DEFINE_bool("print_config", False, "print the resolved config "
                           "(--preset, its --config.<path> overrides), "
                           "`path = value` a leaf; run nothing")


def print_config(cfg) -> None:
  print(*config_flags.describe(cfg), sep="\n")


_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "opt-in: a directory (e.g. DIR/jax-cache) "
    "keeping compiled XLA programs for later runs to reuse")


def start(argv, **required) -> float:
  """Checks the command line (no positional arguments; each ``required``
  flag set unless ``--print_config``) and sets up; the start time."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (missing := [f"--{k}" for k, v in required.items() if not v]) and not (
      "print_config" in flags.FLAGS and flags.FLAGS.print_config):
    raise app.UsageError(f"{missing[0]} is required")
  if path := _COMPILATION_CACHE.value:
    with usage_errors():
      make_dir(path, "--compilation_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  glibc.retain_freed_memory()  # XLA:CPU's per-step temporaries
  if _is_worker():
    glibc.end_with_parent()  # whatever ends the parent (its SIGTERM, a kill)
  return time.perf_counter()


@contextlib.contextmanager
def usage_errors():
  """A ``ValueError`` raised inside ends the binary as a usage error."""
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
      "distributed", False, "data-parallel over processes (hosts) joined by "
      "jax.distributed.initialize(), which finds the settings below itself "
      "on SLURM, Open MPI and TPU VMs")
  settings = (
      flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process "
                          "0's coordinator (or $JAX_COORDINATOR_ADDRESS; "
                          "127.0.0.1:PORT: processes on one machine)"),
      flags.DEFINE_integer("num_processes", None, "how many processes"),
      flags.DEFINE_integer("process_id", None, "this one's, < num_processes"))
  def initialize() -> None:
    if on.value:
      sharding.initialize_distributed(*(f.value for f in settings))
    elif given := [f"--{f.name}" for f in settings if f.value is not None]:
      raise ValueError(f"{', '.join(given)} need --distributed")
  return initialize


def study_main(study, run: Callable, write_report: Callable,
               one_arena: bool = False, **outputs: str) -> Callable:
  """A study's ``main`` over ``study.{PRESETS,get_setup,check_workdir}``;
  ``one_arena``: :func:`hmmprompt.glibc.one_arena`, for steps whose
  temporaries pass 64 MiB."""
  preset = flags.DEFINE_enum("preset", "cpu", list(study.PRESETS),
                             "config preset; --config.<path> overrides it")
  config = define_config(study.PRESETS["cpu"]())
  print_it = define_print_config()
  workdir = flags.DEFINE_string("workdir", None, "output; a rerun resumes")
  @one_line_errors
  def main(argv):
    t0, out = start(argv, workdir=workdir.value), workdir.value
    if one_arena:
      glibc.one_arena()  # before the first computation starts XLA's threads
    with usage_errors():
      setup = study.get_setup(preset.value, config.value())
      if print_it.value:
        return print_config(setup)
      getattr(study, "check_inputs", lambda _: None)(setup)
      study.check_workdir(make_dir(out), setup)
    run(setup, out)
    print(write_report(out))
    done(t0, **{k: os.path.join(out, f) for k, f in outputs.items()})
  return main
