"""Model FLOP utilisation: the achieved FLOP/s over the device's dense peak
(``bench_mlm``, ``bench_trials``), and where a profiled step's time goes."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

import jax

# Dense peak TFLOP/s by (device kind substring, dtype), from vendor specs.
PEAK_TFLOPS = {("H100", "bfloat16"): 989.0, ("H100", "float32"): 494.5,
               ("H200", "bfloat16"): 989.0, ("H200", "float32"): 494.5,
               ("A100", "bfloat16"): 312.0, ("A100", "float32"): 156.0}


def peak_tflops(dtype: str, override: float | None = None) -> float | None:
  """``override`` if given, else the first device's listed peak for
  ``dtype`` on a GPU; ``None`` where unknown (a CPU: no MFU printed)."""
  if override is not None:
    return override
  if jax.default_backend() != "gpu":
    return None
  kind = jax.devices()[0].device_kind
  for (name, dt), peak in PEAK_TFLOPS.items():
    if name in kind and dt == dtype:
      return peak
  return None


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
