"""The sweep in one process per core, on one machine (XLA:CPU spreads these
models' small matmuls poorly over cores: docs/performance.md): the binary's
``--workers=N`` starts N copies of itself, each pinned to one core, claiming
stacks into its own results file; the parent merges those (docs/figure3.md)."""

import glob
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax

from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep
from hmmprompt import protocol
from hmmprompt import files as files_lib

# Eigen's matmuls on one thread; the pinning in spawn() keeps the rest of
# XLA's threads on the worker's one core.
SINGLE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false",)


def _cores() -> list[int]:
  """The cores this process may run on (all where the OS cannot say)."""
  if hasattr(os, "sched_getaffinity"):
    return sorted(os.sched_getaffinity(0))
  return list(range(os.cpu_count() or 1))


def auto_count() -> int:
  """Workers for ``--workers=0``: the cores this process may run on, at
  most one per 4 GB of available memory (docs/figure3.md)."""
  cores = len(_cores())
  try:
    with open("/proc/meminfo") as f:
      kb = next(int(line.split()[1]) for line in f
                if line.startswith("MemAvailable:"))
  except (OSError, StopIteration):
    return cores
  return max(1, min(cores, kb // (4 * 2**20)))


def resolve_count(requested: int, num_hosts: int = 1) -> int:
  """The ``--workers`` to run (0: :func:`auto_count`, 1 with host sharding or
  off the CPU); ``ValueError`` for a count it cannot run (docs/figure3.md)."""
  if requested < 0:
    raise ValueError(f"--workers must be >= 0, got {requested}")
  if requested == 0 and num_hosts > 1:
    return 1  # each host of the array runs its share in one process
  count = auto_count() if requested == 0 else requested
  if count > 1 and num_hosts > 1:
    raise ValueError("--workers > 1 splits this machine's share by claims; "
                     "it does not combine with --num_tasks > 1")
  if count > 1 and jax.default_backend() != "cpu":
    if requested == 0:
      return 1
    raise ValueError(f"--workers={count} runs one process per CPU core; "
                     f"the backend here is {jax.default_backend()}")
  return count


_IN_FLIGHT: dict[str, list] = {}  # claims dir -> its workers, for stop_all


def stop_all() -> None:
  """Stops every worker in flight and removes its claims directory (what a
  fault or signal runs before ``os._exit``, which skips ``finally``)."""
  for claims_dir, procs in list(_IN_FLIGHT.items()):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    for p in procs:
      p.wait()
    shutil.rmtree(claims_dir, ignore_errors=True)


def run_workers(argv: list[str], count: int, workdir: str) -> None:
  """:func:`spawn` with a fresh temporary claims directory, then
  :func:`merge_results` into ``workdir``; ``SystemExit`` if a worker failed."""
  claims_dir = tempfile.mkdtemp(prefix="hmmprompt-claims-")
  _IN_FLIGHT[claims_dir] = []
  try:
    codes = spawn(argv, count, claims_dir)
    faults = [pathlib.Path(path).read_text() for path in sorted(
        glob.glob(error_path(claims_dir, "*")))]
  finally:
    _IN_FLIGHT.pop(claims_dir, None)
    shutil.rmtree(claims_dir, ignore_errors=True)
    merge_results(workdir)
  if faults:  # the binary ends with the worker's one line, as if its own
    raise OSError(faults[0])
  if any(codes):
    raise SystemExit(f"workers exited with {codes} (their logs above); "
                     f"rerun to resume")


def error_path(claims_dir: str, worker: int | str) -> str:
  """Where worker ``worker`` leaves its fault (an ``OSError``'s text) for
  the parent, which stops the other workers and ends with it."""
  return os.path.join(claims_dir, f"error-worker{worker}")


def spawn(argv: list[str], count: int, claims_dir: str) -> list[int]:
  """Runs ``count`` copies of the binary ``argv`` (``sys.argv``, without
  ``--workers``) sharing ``claims_dir``, worker ``i`` on the ``i``-th
  allowed core; returns their exit codes (the rest stopped by SIGTERM if
  this one is stopped or a worker left a fault at :func:`error_path`)."""
  os.makedirs(claims_dir, exist_ok=True)
  pathlib.Path(_count_path(claims_dir)).write_text(str(count))  # progress()
  env = dict(os.environ, XLA_FLAGS=" ".join(
      [os.environ.get("XLA_FLAGS", ""), *SINGLE_THREAD_FLAGS]).strip())
  # One malloc arena, which keeps a step's temporaries (docs/figure3.md).
  env.setdefault("MALLOC_ARENA_MAX", "1")
  # Shared by the workers (the same tuning programs), gone with the claims.
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(claims_dir, "xla"))
  spec = sys.modules["__main__"].__spec__
  if spec is None:
    raise ValueError("--workers needs the binary run as python -m MODULE")
  cores, taskset = _cores(), shutil.which("taskset")
  procs = _IN_FLIGHT.setdefault(claims_dir, [])
  try:
    for i in range(count):
      pin = [taskset, "-c", str(cores[i % len(cores)])] if taskset else []
      procs.append(subprocess.Popen(
          [*pin, sys.executable, "-m", spec.name,
           *_without(argv[1:], ("workers",)),
           f"--worker={i}", f"--claims={claims_dir}"], env=env))
    # A worker's fault (error_path) stops the others at once. Every worker
    # is polled each round: a code is known only once polled.
    while True:
      codes = [p.poll() for p in procs]
      if None not in codes or any(
          code and os.path.exists(error_path(claims_dir, i))
          for i, code in enumerate(codes)):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        p.wait()
  return [p.returncode for p in procs]


def claims(claims_dir: str, backbone: str
           ) -> Callable[[protocol.ModelId], bool]:
  """``claim(mid)``: True for exactly one of the processes that ask (an
  exclusive create of ``claims_dir/<backbone>-<tag>``)."""
  def claim(mid: protocol.ModelId) -> bool:
    try:
      os.close(os.open(os.path.join(claims_dir, f"{backbone}-{mid.tag}"),
                       os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
      return False
    return True
  return claim


def _count_path(claims_dir: str) -> str:
  return os.path.join(claims_dir, "workers")


def progress(claims_dir: str, backbone: str
             ) -> Callable[[str | None], tuple[int, int]]:
  """``Schedule.progress``: marks the tuning group ``key`` (``None``: none)
  finished (``claims_dir/finished-<backbone>/key``); returns ``(groups the
  workers of claims_dir finished, :func:`spawn`'s count of them or 1)``."""
  folder = os.path.join(claims_dir, f"finished-{backbone}")
  def progress(key: str | None) -> tuple[int, int]:
    try:  # a progress line is not worth a fault
      os.makedirs(folder, exist_ok=True)
      if key is not None:
        pathlib.Path(folder, key).touch()
      finished = len(os.listdir(folder))
    except OSError:
      finished = 0
    try:
      workers = int(pathlib.Path(_count_path(claims_dir)).read_text())
    except (OSError, ValueError):
      workers = 1
    return finished, workers
  return progress


def worker_results_path(workdir: str, worker: int) -> str:
  return os.path.join(workdir, f"results-worker{worker}.jsonl")


def merge_results(workdir: str) -> int:
  """Moves worker files' lines into ``DIR/results.jsonl``; returns how many."""
  path, added = schema.results_path(workdir), 0
  for part in sorted(glob.glob(os.path.join(workdir, "results-worker*.jsonl"))):
    new, _, _ = files_lib.merge_lines(
        path, files_lib.read_lines(part, schema.ResultLine))
    added += len(new)
    os.remove(part)
  return added


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
  """``argv`` without the flags ``names`` (``--name=value``, ``--name v``)."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a.lstrip("-").partition("=")[0] in names and a.startswith("--"):
      skip = "=" not in a
    else:
      out.append(a)
  return out


def chunk_compute(argv: list[str], count: int, backbone: str) -> Callable:
  """A ``compute`` for :func:`chunks.run_chunk`: ``count`` workers of the
  binary ``argv`` claim the chunk's stacks in its workdir, each until the
  shared deadline; returns the tags of the stacks still missing cells."""
  def compute(chunk_setup, workdir: str, deadline: float | None) -> list[str]:
    # time.monotonic() is one clock for every process of a machine.
    args = [*_without(argv, ("workdir", "out", "budget_s")),
            f"--workdir={workdir}",
            *([] if deadline is None else [f"--deadline={deadline!r}"])]
    run_workers(args, count, workdir)
    return [mid.tag for mid, groups in sweep.missing_cells(
        chunk_setup, workdir, "both", backbone).items() if groups]
  return compute
