"""hmmprompt.glibc: freed blocks are reused without page faults."""

import subprocess
import sys

import pytest

_SCRIPT = """
import resource, sys
import numpy as np
from hmmprompt import glibc
if sys.argv[1] == "retain":
  assert glibc.retain_freed_memory()
def faults():
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(64 << 17)  # 64 MiB, once, so the heap has grown
before = faults()
for _ in range(20):
  np.ones(64 << 17).sum()  # allocate, touch every page, free
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="glibc mallopt")
def test_retained_memory_is_not_faulted_in_again():
  counts = {}
  for mode in ("default", "retain"):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode],
                         capture_output=True, text=True, check=True)
    counts[mode] = int(out.stdout.strip())
  # 20 x 64 MiB of fresh pages by default (hundreds of faults each, fewer
  # than 16k where transparent huge pages serve them); reused after.
  assert counts["default"] > 20 * 100, counts
  assert counts["retain"] < counts["default"] / 10, counts
