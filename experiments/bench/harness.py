"""What the benchmarks share: start, timers, train steps, MFU, top ops."""

import collections
from collections.abc import Callable
import glob
import gzip
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time

from absl import app
import jax
import jax.numpy as jnp

from hmmprompt import glibc
from hmmprompt import sharding

peak_tflops = sharding.peak_tflops  # the library's (pretraining logs MFU)
NO_BENCH = "not installed (pip install -e '.[bench]')"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))  # the checkout, where the benchmarks' subprocesses run


def header(devices: bool = True) -> str:
  """The date, CPU (model, cores this process may use), python and jax
  versions and (``devices``: starts jax's backend) the devices."""
  lscpu = shutil.which("lscpu") and subprocess.run(
      ["lscpu"], capture_output=True, text=True, check=False).stdout
  cpu = re.search(r"^Model name:\s*(.+)$", lscpu or "", re.M)
  return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{cpu[1] if cpu else platform.processor() or platform.machine()}, "
          f"{len(os.sched_getaffinity(0))} cores; python "
          f"{platform.python_version()}, jax {jax.__version__}" + (
              f" on {jax.default_backend()}: {jax.device_count()} x "
              f"{jax.devices()[0].device_kind}" if devices else ""))


def start(argv, retain_freed_memory: bool = True, devices: bool = True):
  """A benchmark's start: no positional arguments, glibc's settings as the
  binaries' (XLA:CPU step temporaries), the :func:`header`."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if retain_freed_memory:
    glibc.retain_freed_memory()
  print(header(devices), flush=True)


def train_steps(step: Callable, batch: Callable, state, hmms, n: int = 1
                ) -> Callable:
  """A callable: ``n`` steps ``state, loss = step(state, *batch(i), hmms)``
  (``i`` counts all its calls), the state carried; the last loss."""
  box = [state, 0]
  def run():
    for _ in range(n):
      box[0], loss = step(box[0], *batch(box[1]), hmms)
      box[1] += 1
    return loss
  return run


def seconds_per_call(fn: Callable, repeats: int = 1, steps: int = 1,
                     warmup: int = 1, sync: Callable = jax.block_until_ready
                     ) -> float:
  """Seconds per call of ``fn()`` after ``warmup`` calls: the median of
  ``repeats`` timings of ``steps`` calls, each ``sync``-ed on the last's."""
  def per_call(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
      out = fn()
    sync(out)
    return (time.perf_counter() - t0) / n
  per_call(warmup)
  return statistics.median([per_call(steps) for _ in range(repeats)])


def interleaved(arms: dict[str, Callable], rounds: int) -> dict[str, float]:
  """Each arm's seconds over ``rounds`` calls after one untimed, the arms
  taking turns (load from other work falls on all alike)."""
  jax.block_until_ready([fn() for fn in arms.values()])
  spent = dict.fromkeys(arms, 0.0)
  for _ in range(rounds):
    for name, fn in arms.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      spent[name] += time.perf_counter() - t0
  return spent


def against_first(fns: dict, args, repeats: int, line: Callable, first: str):
  """Prints ``line(name, seconds)`` of each of ``fns(*args)``, its time
  over the first's (``first`` names it), its largest difference from it."""
  base = ref = None
  for name, fn in fns.items():
    try:
      got = fn(*args)
      secs = seconds_per_call(lambda fn=fn: fn(*args), repeats)
    except jax.errors.JaxRuntimeError as e:  # e.g. [B, T, H, H] at 10 240
      print(f"  {name:<34s} failed: {str(e).splitlines()[0][:80]}")
      continue
    out = line(name, secs)
    if base is None:
      base, ref = secs, got
    else:
      out += (f"   {secs / base:6.2f}x {first}, max |diff| "
              f"{float(jnp.max(jnp.abs(got - ref))):.1e}")
    print(out)


def describe(flops: float, seconds: float, peak: float | None) -> str:
  """``"12.34 TFLOP/s, MFU 5.6%"``: MFU over the dense ``peak`` (if any)."""
  tflops = flops / seconds / 1e12
  return f"{tflops:.2f} TFLOP/s" + (f", MFU {100 * tflops / peak:.1f}%"
                                    if peak else "")


def top_ops(trace_dir: str, top: int = 15) -> list[tuple[str, float, float]]:
  """``(name, ms, share)`` of the ``top`` events by time in the newest
  perfetto trace under ``trace_dir``, on the devices (else the host)."""
  paths = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz",
                           recursive=True), key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(paths[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  keep = {p for p, n in names.items() if n.startswith("/device")} or set(names)
  total: collections.Counter[str] = collections.Counter()
  for e in events:  # ("$file:line fn" events: Python frames, not ops)
    if e.get("ph") == "X" and e.get("pid") in keep and e["name"][:1] != "$":
      total[e["name"]] += e.get("dur", 0.0)  # microseconds
  whole = sum(total.values()) or 1.0
  return [(name, us / 1e3, us / whole) for name, us in total.most_common(top)]
