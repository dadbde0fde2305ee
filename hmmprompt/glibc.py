"""Keep freed host memory in the process (glibc), for XLA:CPU's sake
(docs/performance.md, "Where the system time went"); the library never
calls :func:`retain_freed_memory` (the resident size stays at its peak):
binaries do, first thing in ``main``."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4


@functools.cache
def retain_freed_memory() -> bool:
  """Sets glibc's ``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD`` = 2 GiB - 1 and
  ``M_TOP_PAD`` = 256 MiB; ``True`` if all took effect (``False``: no glibc)."""
  try:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return all(mallopt(param, value) == 1 for param, value in (
      (_M_MMAP_MAX, 0),
      (_M_TRIM_THRESHOLD, 2**31 - 1),  # an int: mallopt's largest value
      (_M_TOP_PAD, 256 << 20)))
