"""What the benchmarks share: timing, model FLOP utilisation (achieved
FLOP/s over the device's dense peak), where a profiled step's time goes."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import statistics
import time
from collections.abc import Callable

import jax

from hmmprompt import sharding

peak_tflops = sharding.peak_tflops  # the library's (pretraining logs MFU)


def seconds_per_call(fn: Callable, repeats: int = 1, steps: int = 1,
                     warmup: int = 1, sync: Callable = jax.block_until_ready
                     ) -> float:
  """Seconds per call of ``fn()`` after ``warmup`` calls: the median of
  ``repeats`` timings of ``steps`` calls, each ``sync``-ed on the last's."""
  for _ in range(warmup):
    out = fn()
  sync(out)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      out = fn()
    sync(out)
    times.append((time.perf_counter() - t0) / steps)
  return statistics.median(times)


def interleaved(arms: dict[str, Callable], rounds: int) -> dict[str, float]:
  """Each arm's total seconds over ``rounds`` calls after one untimed,
  the arms taking turns (load from other work falls on all alike)."""
  jax.block_until_ready([fn() for fn in arms.values()])
  spent = dict.fromkeys(arms, 0.0)
  for _ in range(rounds):
    for name, fn in arms.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      spent[name] += time.perf_counter() - t0
  return spent


def describe(flops: float, seconds: float, peak: float | None) -> str:
  """``"12.34 TFLOP/s, MFU 5.6%"`` (no MFU without a peak)."""
  tflops = flops / seconds / 1e12
  return f"{tflops:.2f} TFLOP/s" + (f", MFU {100 * tflops / peak:.1f}%"
                                    if peak else "")


def top_ops(trace_dir: str, top: int = 15) -> list[tuple[str, float, float]]:
  """The ``top`` events by total duration in the newest perfetto trace under
  ``trace_dir``: ``(name, ms, share of the total)``, of the device's
  processes (``/device:...``) where it has any, else the host's."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**",
                                        "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(paths[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  keep = ({pid for pid, n in names.items() if n.startswith("/device")}
          or set(names))
  total: collections.Counter[str] = collections.Counter()
  for e in events:
    # "$file:line fn" events are Python frames, not ops.
    if (e.get("ph") == "X" and e.get("pid") in keep
        and not e["name"].startswith("$")):
      total[e["name"]] += e.get("dur", 0.0)  # microseconds
  whole = sum(total.values()) or 1.0
  return [(name, us / 1e3, us / whole) for name, us in total.most_common(top)]
