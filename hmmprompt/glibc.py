"""Keep freed host memory in the process (glibc), for XLA:CPU's sake.

XLA:CPU allocates each execution's temporaries afresh, and glibc serves
large blocks with ``mmap`` and gives them back with ``munmap`` when freed.
Every step of a jitted training loop then faults its working set in again,
page by page, zero-filled by the kernel: on the 2-core machine that was
about 40% of the cpu pretraining step's CPU time (docs/performance.md,
"Where the system time went", has the counts).

:func:`retain_freed_memory` tells glibc to keep freed memory for reuse
(no ``mmap`` for large blocks, no trimming of the heap top), which removes
nearly all of those faults.
The price is that the process's resident size stays at its peak.

It changes the process's allocator, so the library never calls it on its
own: binaries call it first thing in ``main``, notebooks and scripts may
call it once at the start. A no-op (returning ``False``) where the C library
is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # an int: mallopt's largest value
_TOP_PAD = 256 << 20


@functools.cache
def retain_freed_memory() -> bool:
  """Sets glibc's ``M_MMAP_MAX = 0``, ``M_TRIM_THRESHOLD`` = 2 GiB - 1 and
  ``M_TOP_PAD`` = 256 MiB; ``True`` if all three took effect."""
  name = ctypes.util.find_library("c")
  try:
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  return all(mallopt(param, value) == 1 for param, value in (
      (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
      (_M_TOP_PAD, _TOP_PAD)))
