"""Model FLOP utilisation: the achieved FLOP/s over the device's dense peak
(``bench_mlm``, ``bench_trials``), and where a profiled step's time goes."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

from hmmprompt import sharding

# The peak table lives with the library (the pretraining loop logs MFU).
PEAK_TFLOPS = sharding.PEAK_TFLOPS
peak_tflops = sharding.peak_tflops


def describe(flops: float, seconds: float, peak: float | None) -> str:
  """``"12.34 TFLOP/s, MFU 5.6%"`` (no MFU without a peak)."""
  tflops = flops / seconds / 1e12
  return f"{tflops:.2f} TFLOP/s" + (f", MFU {100 * tflops / peak:.1f}%"
                                    if peak else "")


def top_ops(trace_dir: str, top: int = 15) -> list[tuple[str, float, float]]:
  """The ``top`` events by total duration in the newest perfetto trace under
  ``trace_dir`` (``jax.profiler.trace(..., create_perfetto_trace=True)``):
  ``(name, ms, share of the device's total)``, counting only the device's
  processes (``/device:...``) where the trace has any (a GPU's kernels),
  else the host's (a CPU run), Python frames left out."""
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
  device = {pid for pid, n in names.items() if n.startswith("/device")}
  keep = device or set(names)
  total: collections.Counter[str] = collections.Counter()
  for e in events:
    # "$file:line fn" events are Python frames, not ops.
    if (e.get("ph") == "X" and e.get("pid") in keep
        and not e["name"].startswith("$")):
      total[e["name"]] += e.get("dur", 0.0)  # microseconds
  whole = sum(total.values()) or 1.0
  return [(name, us / 1e3, us / whole) for name, us in total.most_common(top)]
