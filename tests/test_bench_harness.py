"""experiments.bench.harness: the benchmarks' start (header, positional
arguments refused), timers, train steps and ratio line, the peak a device's
MFU is taken against, a profile's top ops (what the accelerator session reads
from its trace)."""

import gzip
import json
import os
import re

from absl import app
import jax
import jax.numpy as jnp
import pytest

from experiments.bench import harness


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
  assert harness.top_ops(str(tmp_path / "gpu")) == [
      ("cudnn_fmha", 2.5, 0.625), ("fusion.3", 1.5, 0.375)]
  assert harness.top_ops(str(tmp_path / "gpu"), top=1) == [
      ("cudnn_fmha", 2.5, 0.625)]
  _trace(str(tmp_path / "cpu" / "run"), [
      _process(7, "/host:CPU"), _op(7, "$profiler.py:307 trace", 8e3),
      _op(7, "dot.2", 300.0), _op(7, "while.5", 100.0)])
  assert harness.top_ops(str(tmp_path / "cpu")) == [
      ("dot.2", 0.3, 0.75), ("while.5", 0.1, 0.25)]
  with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz "
                     "under"):
    harness.top_ops(str(tmp_path / "none"))


def test_mfu_is_achieved_over_peak_and_absent_without_one():
  assert harness.describe(2e12, 0.5, 8.0) == "4.00 TFLOP/s, MFU 50.0%"
  assert harness.describe(2e12, 0.5, None) == "4.00 TFLOP/s"
  assert harness.peak_tflops("bfloat16", 123.0) == 123.0
  if jax.default_backend() == "cpu":
    assert harness.peak_tflops("bfloat16") is None  # no listed peak for a CPU


def test_the_timers_call_warmup_then_the_timed_calls():
  """The benchmarks' shared timers: untimed calls first (the compile),
  then ``repeats`` x ``steps`` (or a turn per arm and round)."""
  calls = []
  fn = lambda: calls.append(1) or jax.numpy.zeros(())
  assert harness.seconds_per_call(fn, repeats=3, steps=2, warmup=2) >= 0.0
  assert len(calls) == 2 + 3 * 2
  calls.clear()
  spent = harness.interleaved({"a": fn, "b": fn}, rounds=3)
  assert list(spent) == ["a", "b"] and min(spent.values()) >= 0.0
  assert len(calls) == 2 + 2 * 3


def test_start_refuses_arguments_and_prints_the_header(capsys):
  """The header: date, CPU and cores, python and jax versions, the devices
  (without them: no backend started, for a benchmark whose work is in
  subprocesses)."""
  with pytest.raises(app.UsageError, match="unexpected arguments"):
    harness.start(["bench", "extra"], retain_freed_memory=False)
  harness.start(["bench"], retain_freed_memory=False)
  (head,) = capsys.readouterr().out.splitlines()
  assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC; .+, \d+ cores; python "
                      r"3\.\S+, jax \S+ on \w+: \d+ x .+", head), head
  assert " on " not in harness.header(devices=False).split("jax ")[1]


def test_train_steps_carry_the_state_and_number_the_batches():
  step = lambda state, x, hmms: (state + x * hmms,) * 2  # loss: the state
  run = harness.train_steps(step, lambda i: (i,), 0, 10, n=2)
  assert run() == 10  # batches 0, 1: state 0 -> 0 -> 10
  assert run() == 60  # batches 2, 3: 10 -> 30 -> 60


def test_against_first_prints_each_arm_against_the_first(capsys):
  x = jnp.arange(3.0)
  harness.against_first({"a": lambda v: v, "b": lambda v: v + 0.5}, (x,), 1,
                        lambda name, secs: f"  {name}", "a's time")
  a, b = capsys.readouterr().out.splitlines()
  assert a == "  a"
  assert re.fullmatch(r"  b   +\d+\.\d\dx a's time, max \|diff\| 5\.0e-01", b)
