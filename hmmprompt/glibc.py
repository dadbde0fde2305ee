"""The C library's process settings that binaries make, first thing in
``main`` (the library never does): keep freed host memory in the process,
for XLA:CPU's sake (docs/performance.md, "Where the system time went"; the
resident size stays at its peak), and end a worker with its parent."""

import ctypes
import ctypes.util
import functools
import signal

# mallopt(3) parameters.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8


@functools.cache
def _mallopt():
  """glibc's ``mallopt``, or one that fails (``0``) where there is none."""
  try:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
  except (OSError, AttributeError, TypeError):
    return lambda param, value: 0
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return mallopt


@functools.cache
def retain_freed_memory() -> bool:
  """Sets glibc's ``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD = -1`` (never trim: a
  step's 1.6 GiB block atop freed memory passed a 2 GiB cap) and ``M_TOP_PAD`` =
  256 MiB; ``True`` if all took effect (``False``: no glibc)."""
  return all(_mallopt()(param, value) == 1 for param, value in (
      (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1), (_M_TOP_PAD, 256 << 20)))


def one_arena() -> bool:
  """Sets ``M_ARENA_MAX = 1`` before any thread starts: a block over a thread
  arena's 64 MiB heap (a big step's XLA:CPU temporaries) is kept, not mapped
  each step; small blocks on many threads lose more to its lock."""
  return _mallopt()(_M_ARENA_MAX, 1) == 1


def end_with_parent() -> bool:
  """Asks Linux to SIGTERM this process when its parent ends (a ``--workers``
  process must not outlive its run, even a killed one); ``True`` if set."""
  try:
    return ctypes.CDLL(None).prctl(1, int(signal.SIGTERM)) == 0  # DEATHSIG
  except (OSError, AttributeError):
    return False
