"""hmmprompt.glibc: freed blocks are reused without page faults."""

import subprocess
import sys

import pytest

_SCRIPT = """
import resource, sys, threading
import numpy as np
from hmmprompt import glibc
if sys.argv[1] != "default":
  assert glibc.retain_freed_memory()
if sys.argv[1] == "one_arena":
  assert glibc.one_arena()
def faults():
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def cycles(mib):
  np.ones(mib << 17)  # once, so the heap has grown
  before = faults()
  for _ in range(20):
    np.ones(mib << 17).sum()  # allocate, touch every page, free
  counts.append(faults() - before)
counts = []
cycles(64)
# 96 MiB from a thread, as XLA:CPU's temporaries: over a thread arena's heap.
thread = threading.Thread(target=cycles, args=(96,))
thread.start()
thread.join()
print(*counts)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="glibc mallopt")
def test_retained_memory_is_not_faulted_in_again():
  main, thread = {}, {}
  for mode in ("default", "retain", "one_arena"):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode],
                         capture_output=True, text=True, check=True)
    main[mode], thread[mode] = map(int, out.stdout.split())
  # 20 x 64 MiB of fresh pages by default (hundreds of faults each, fewer
  # than 16k where transparent huge pages serve them); reused after.
  assert main["default"] > 20 * 100, main
  assert main["retain"] < main["default"] / 10, main
  # A thread's 96 MiB blocks are mapped afresh unless there is one arena
  # (48 faults a block at least: 2 MiB huge pages).
  assert thread["retain"] >= 20 * 48, thread
  assert thread["one_arena"] < thread["retain"] / 10, thread
