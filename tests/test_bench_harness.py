"""experiments.mfu: the peak a device's MFU is taken against, a
profile's top ops (what the accelerator session reads from its trace) and
the benchmarks' timers."""

import gzip
import json
import os

import jax
import pytest

from experiments import mfu


def _trace(path, events):
  os.makedirs(path)
  with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
    json.dump({"traceEvents": events}, f)


def _process(pid, name):
  return {"ph": "M", "name": "process_name", "pid": pid,
          "args": {"name": name}}


def _op(pid, name, dur):
  return {"ph": "X", "pid": pid, "name": name, "dur": dur, "ts": 0}


def test_top_ops_sum_the_devices_kernels_by_name(tmp_path):
  """Durations (us) summed per name over the device's processes only,
  largest first, with shares of the device's total; a host-only trace
  (a CPU run) counts the host, without Python frames."""
  _trace(str(tmp_path / "gpu" / "plugins" / "profile" / "run"), [
      _process(1, "/device:GPU:0"), _process(2, "/host:CPU"),
      _op(1, "fusion.3", 500.0), _op(1, "cudnn_fmha", 2500.0),
      _op(1, "fusion.3", 1000.0), _op(2, "PjitFunction(step)", 9e6),
      {"ph": "i", "pid": 1, "name": "marker"}])
  assert mfu.top_ops(str(tmp_path / "gpu")) == [
      ("cudnn_fmha", 2.5, 0.625), ("fusion.3", 1.5, 0.375)]
  assert mfu.top_ops(str(tmp_path / "gpu"), top=1) == [
      ("cudnn_fmha", 2.5, 0.625)]
  _trace(str(tmp_path / "cpu" / "run"), [
      _process(7, "/host:CPU"), _op(7, "$profiler.py:307 trace", 8e3),
      _op(7, "dot.2", 300.0), _op(7, "while.5", 100.0)])
  assert mfu.top_ops(str(tmp_path / "cpu")) == [("dot.2", 0.3, 0.75),
                                               ("while.5", 0.1, 0.25)]
  with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz "
                     "under"):
    mfu.top_ops(str(tmp_path / "none"))


def test_mfu_is_achieved_over_peak_and_absent_without_one():
  assert mfu.describe(2e12, 0.5, 8.0) == "4.00 TFLOP/s, MFU 50.0%"
  assert mfu.describe(2e12, 0.5, None) == "4.00 TFLOP/s"
  assert mfu.peak_tflops("bfloat16", 123.0) == 123.0
  if jax.default_backend() == "cpu":
    assert mfu.peak_tflops("bfloat16") is None  # no listed peak for a CPU


def test_the_timers_call_warmup_then_the_timed_calls():
  """The benchmarks' shared timers: untimed calls first (the compile),
  then ``repeats`` x ``steps`` (or a turn per arm and round)."""
  calls = []
  fn = lambda: calls.append(1) or jax.numpy.zeros(())
  assert mfu.seconds_per_call(fn, repeats=3, steps=2, warmup=2) >= 0.0
  assert len(calls) == 2 + 3 * 2
  calls.clear()
  spent = mfu.interleaved({"a": fn, "b": fn}, rounds=3)
  assert list(spent) == ["a", "b"] and min(spent.values()) >= 0.0
  assert len(calls) == 2 + 2 * 3
