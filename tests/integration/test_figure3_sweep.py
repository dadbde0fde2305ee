"""Figure 3 sweeps end to end: resume, both backbones, sharding, the binary."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import binaries  # tests/integration/binaries.py
import zygote  # tests/zygote.py
from hmmprompt import figure3
from hmmprompt import scheduling
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep
from hmmprompt import protocol
from hmmprompt import files as files_lib
from hmmprompt import tuning
from hmmprompt.pretrain import train as pretrain_train

_SETUP_ARGS = dict(trials=2, left_sizes=(4,), memory_sizes=(2,),
                   features=("raw",), overrides={
                       "task.num_train": 64, "task.num_val": 16,
                       "task.num_test": 32, "task.seq_len": 12,
                       "tune.epochs": 1, "tune.prompt_len": 2,
                       "pretrain.steps": 20})
SETUP = figure3.get_setup("tiny", **_SETUP_ARGS)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# The left panel's transformer sweep in a subprocess, SIGKILLed at a chosen
# point: during the stacked pretraining (after step 15; checkpoint at 10),
# or when the second group's tuning starts (the first group's lines are
# written, the second's are not).
_KILLED_SWEEP = """
import os, signal, sys
from hmmprompt import figure3
from hmmprompt.figure3 import sweep
from hmmprompt import protocol
setup = figure3.get_setup("tiny", **{args!r})
kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
calls = []
if sys.argv[2] == "pretrain":
  real = protocol.pretrain_lib.run_trials
  def run_trials(*a, **k):
    k["after_step"] = lambda step: step == 15 and kill()
    return real(*a, **k)
  protocol.pretrain_lib.run_trials = run_trials
else:
  real = protocol.tuning.tune_trials
  def tune_trials(*a, **k):
    calls.append(1)
    if len(calls) == 2:
      kill()
    return real(*a, **k)
  protocol.tuning.tune_trials = tune_trials
figure3.run_sweep(setup, sys.argv[1], "left", "transformer")
"""


# A sweep on 8 host devices, as a TPU v2-8 / v3-8 Colab runtime has them:
# data-parallel pretraining splits each batch over the 8 (the left panel:
# one stack, its head and prompt arms; tuning runs on one device, so the
# fine-tuning arm would only repeat the one-device program).
_EIGHT_DEVICES = """
import dataclasses, sys
import jax
from hmmprompt import figure3
assert jax.device_count() == 8, jax.devices()
setup = dataclasses.replace(figure3.get_setup("tiny", **{args!r}),
                            memory_sizes=(2,))
figure3.run_sweep(setup, sys.argv[1], "left", "transformer")
# A batch that does not split over the 8 is refused by name, before any
# work (the binary's check_run is the library's first step).
from hmmprompt.figure3 import configs
odd = figure3.get_setup("tiny", overrides={{"pretrain.batch_size": 12}})
try:
  configs.check_run(odd, ["transformer"])
except ValueError as e:
  assert "batch size 12 is not divisible by the 8 devices" in str(e), e
else:
  raise AssertionError("batch 12 on 8 devices was accepted")
"""


def _with_devices(n: int) -> dict:
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(
      flags + [f"--xla_force_host_platform_device_count={n}"]))


def test_sweep_writes_resumable_results(tmp_path, monkeypatch):
  """Both panels on the exact backbone; a rerun recomputes nothing, a lost
  group alone is redone, and the arms beyond the paper add lines and
  report columns without moving the paper's."""
  workdir = str(tmp_path)
  path = os.path.join(workdir, "results.jsonl")
  figure3.run_sweep(SETUP, workdir, "both", "exact")
  lines = schema.read_results(workdir)
  # left: 2 methods; right: memory + vanilla; 2 seeds each.
  assert len(lines) == 8
  keys = {r.key() for r in lines}
  assert len(keys) == 8
  for r in lines:
    assert 0.0 <= r.test_accuracy <= 1.0
    assert r.backbone == "exact" and r.pretrain_steps is None
    assert set(r.assumptions) in ({"3.1", "3.2", "3.5"},
                                  {"4.2", "4.4", "4.5"})
    assert isinstance(r.assumptions["3.1" if r.hmm == "vanilla"
                                    else "4.2"]["holds"], bool)
  methods = {(r.panel, r.hmm, r.method) for r in lines}
  assert methods == {("left", "vanilla", "head_linear"),
                     ("left", "vanilla", "prompt_linear"),
                     ("right", "memory", "head_attention"),
                     ("right", "vanilla", "head_linear")}

  # A rerun recomputes nothing.
  def boom(*a, **k):
    raise AssertionError("finished cells were recomputed")

  monkeypatch.setattr(protocol.tuning, "tune_trials", boom)
  figure3.run_sweep(SETUP, workdir, "both", "exact")
  assert len(files_lib.read_jsonl(path)) == 8

  # Lose one group's lines (as if killed mid-sweep): only it is redone.
  monkeypatch.undo()
  kept = [r.to_json() for r in lines if r.method != "prompt_linear"]
  files_lib.atomic_write_text(
      path, "".join(__import__("json").dumps(r) + "\n" for r in kept))
  calls = []
  real = tuning.tune_trials

  def counting(*a, **k):
    calls.append((a[4].method, a[4].head, a[4].optimizer))
    return real(*a, **k)

  monkeypatch.setattr(protocol.tuning, "tune_trials", counting)
  figure3.run_sweep(SETUP, workdir, "both", "exact")
  assert calls == [("prompt", "linear", "adam")]
  redone = schema.read_results(workdir)
  assert len(redone) == 8
  # Deterministic: the recomputed lines equal the originals.
  old = {r.key(): r.test_accuracy for r in lines}
  for r in redone:
    assert r.test_accuracy == pytest.approx(old[r.key()])

  # The arms beyond the paper on the same workdir: ``prompt_attention``
  # adds prompt tuning with the attention head on each memory HMM (Theorem
  # 4.6), ``head_optimum`` an L-BFGS twin of every linear-head arm. They
  # are new lines beside the paper's, whose keys do not move: only the new
  # arms are tuned, and a rerun without the flags recomputes nothing.
  setup = dataclasses.replace(SETUP, prompt_attention=True,
                              head_optimum=True)
  assert setup.fingerprint("exact") == SETUP.fingerprint("exact")
  calls.clear()  # (``counting`` still stands in for tune_trials)
  figure3.run_sweep(setup, workdir, "both", "exact")
  assert sorted(set(calls)) == [("head", "linear", "lbfgs"),
                                ("prompt", "attention", "adam")]
  lines = schema.read_results(workdir)
  arms = {(r.panel, r.hmm, r.method) for r in lines}
  assert arms == methods | {("left", "vanilla", "head_linear_lbfgs"),
                            ("right", "memory", "prompt_attention"),
                            ("right", "vanilla", "head_linear_lbfgs")}
  assert len(lines) == len({r.key() for r in lines}) == 2 * len(arms)
  for r in lines:
    if r.method in ("head_linear", "prompt_linear", "head_attention"):
      assert r.test_accuracy == pytest.approx(old[r.key()])
  adam_steps = tuning.num_steps(64, setup.tune)
  for r in lines:
    lbfgs = r.method.endswith("_lbfgs")
    assert r.tune_config["optimizer"] == ("lbfgs" if lbfgs else "adam")
    assert (r.tune_config["method"], r.tune_config["head"]) == tuple(
        r.method.split("_")[:2])
    if lbfgs:
      assert 1 <= r.steps <= setup.tune.lbfgs_max_steps
    else:
      assert r.steps == adam_steps
    assert 0.0 <= r.test_accuracy <= 1.0 and r.final_loss >= 0
  monkeypatch.setattr(protocol.tuning, "tune_trials", boom)
  figure3.run_sweep(SETUP, workdir, "both", "exact")
  monkeypatch.undo()

  summary = figure3.write_figure3_report(workdir)
  assert summary
  with open(os.path.join(workdir, "figure3.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  table = open(os.path.join(workdir, "figure3.md")).read()
  assert "paper prompt" in table and "exact: vanilla + prompt linear" in table
  left, right = table.split("## Right", 1)
  right = right.split("## ", 1)[0]
  columns = lambda panel: next(row for row in panel.splitlines()
                               if row.startswith("| size |")
                               ).strip("| ").split(" | ")
  assert "exact: vanilla + head optimum (raw)" in columns(left)
  assert "* head optimum: the linear head solved" in left
  assert {"exact: memory + attention prompt (raw)",
          "exact: memory + head attention (raw)",
          "exact: vanilla + head optimum (raw)"} <= set(columns(right))
  assert "* attention prompt: prompt tuning with the attention" in right


_BAD_FLAGS = [
    (["--preset=tiny"], "--workdir is required"),
    (["--preset=tiny", "--workdir=W", "--config.left_sizes=4,x"],
     "--config.left_sizes='4,x' is not a valid tuple of int"),
    (["--preset=tiny", "--workdir=W", "--config.left_sizes=4,0"],
     "left_sizes must be positive integers"),
    (["--preset=tiny", "--workdir=W", "--config.trials=0"],
     "trials must be an int >= 1"),
    (["--preset=huge", "--workdir=W"], "preset"),
    (["--workdir=W", "--backbone=bert"], "--backbone must be from"),
    (["--workdir=W", "--config.finetune=true"],
     "--config.finetune needs --backbone=transformer"),
    (["--workdir=W", "--backbone=transformer", "--preset=tiny",
      "--config.task.seq_len=100"], "exceed the pretrained context"),
    (["--workdir=W", "--num_tasks=2", "--task_index=2"], "task_index"),
    (["--workdir=W", "--workers=-1"], "--workers must be >= 0, got -1"),
    (["--workdir=W", "--workers=2", "--num_tasks=2"],
     "does not combine with --num_tasks > 1"),
    (["--workdir=W", "--backbone=transformer",
      "--config.pretrain.model.width=8"], "config.pretrain.model.width"),
    # A workdir of a sweep with other trial counts (an earlier version's
    # stamp), and one of another tuning recipe (issue 29: the report
    # averaged both setups).
    (["--preset=tiny", "--workdir=OTHER"], "holds results of another setup "
     "(right_trials: 5 -> 2; trials: 5 -> 2)"),
    (["--preset=tiny", "--workdir=TINY", "--config.tune.epochs=1",
      "--config.tune.prompt_len=1"], "holds results of another setup "
     "(tune.epochs: 2 -> 1; tune.prompt_len: 4 -> 1)"),
    # The same with result lines there: the fields, not the lines' digits.
    (["--preset=cpu", "--workdir=LINES"], "holds results of another setup "
     "(pretrain."),
    (["--preset=tiny", "--workdir=W", "--config.left_sizes="],
     "--config.left_sizes is empty: name at least one size (e.g. 4,12); "
     "--panel=right runs the right panel alone"),
]


def test_bad_flags_fail_clearly(tmp_path):
  other = tmp_path / "other"
  other.mkdir()
  files_lib.atomic_write_text(str(other / "sweep.json"),
                                '{"trials": 5, "right_trials": 5}')
  tiny = tmp_path / "tiny"
  tiny.mkdir()
  sweep.check_workdir(str(tiny), figure3.get_setup("tiny"))
  lines = tmp_path / "lines"  # a tiny sweep's stamp and one of its lines
  lines.mkdir()
  sweep.check_workdir(str(lines), figure3.get_setup("tiny"))
  files_lib.append_lines(schema.results_path(str(lines)), [
      schema.ResultLine(
          backbone="exact", panel="left", hmm="vanilla", num_states=4,
          memory_size=0, trial=0, task=0, method="head_linear",
          features="raw", setup=figure3.get_setup("tiny").fingerprint(),
          hmm_fingerprint="f", size=4, test_accuracy=1.0, val_accuracy=1.0,
          train_accuracy=1.0, final_loss=0.0, steps=1, seconds=1.0,
          task_redraws=0, assumptions={}, tune_config={}, task_config={})])
  argvs = [[a.replace("=W", f"={tmp_path}").replace("=OTHER", f"={other}")
            .replace("=TINY", f"={tiny}").replace("=LINES", f"={lines}")
            for a in args] for args, _ in _BAD_FLAGS]
  ends = binaries.usage_errors("experiments.figure3.__main__", argvs)
  for (args, match), end in zip(_BAD_FLAGS, ends):
    assert end["returncode"] != 0, args
    assert match in end["stderr"] + end["stdout"], (args, end["stderr"])
    assert "Traceback" not in end["stderr"], (args, end["stderr"])
    # One line; absl's own flag parsing, before main, prints its two.
    absl = end["stderr"].startswith("FATAL Flags parsing error")
    assert len(end["stderr"].strip().splitlines()) == (
        2 if absl else 1), (args, end["stderr"])


def test_transformer_sweep_records_pretraining_and_resumes(tmp_path,
                                                          monkeypatch):
  workdir = str(tmp_path)
  setup = dataclasses.replace(SETUP, memory_sizes=(2,), finetune=True)
  assert setup.pretrain.steps == 20 and setup.pretrain.cycles is None
  # The same sweep on 8 host devices, in a subprocess started first so that
  # it runs beside this one (compared below).
  eight = str(tmp_path / "eight")
  twin = zygote.popen(["-c", _EIGHT_DEVICES.format(args=_SETUP_ARGS),
                       eight], _with_devices(8), merge_stderr=True)
  figure3.run_sweep(setup, workdir, "both", "transformer")
  lines = figure3.read_results(workdir)
  # left: head, prompt, finetune; right: memory + vanilla; 2 seeds each.
  assert len(lines) == 10
  assert {r.backbone for r in lines} == {"transformer"}
  assert {r.method for r in lines if r.panel == "left"} == {
      "head_linear", "prompt_linear", "finetune_linear"}
  for r in lines:
    assert r.pretrain_steps == 20
    assert r.pretrain_ce_gap == pytest.approx(
        r.pretrain_mlm_ce - r.pretrain_bayes_ce, abs=1e-6)
    assert 0.0 <= r.pretrain_tv <= 1.0 and r.pretrain_wall_s > 0
  # One pretraining per HMM: |H| = 4 (left), memory |M| = 2 and its vanilla
  # twin of 8 states (right).
  pdirs = sorted(os.listdir(os.path.join(workdir, "pretrain")))
  assert [d.rsplit("-", 1)[0] for d in pdirs] == [
      "memory-h4-m2", "vanilla-h4", "vanilla-h8"]

  # A rerun neither tunes nor pretrains again.
  def boom(*a, **k):
    raise AssertionError("finished work was redone")

  monkeypatch.setattr(protocol.tuning, "tune_trials", boom)
  monkeypatch.setattr(pretrain_train, "make_train_step", boom)
  figure3.run_sweep(setup, workdir, "both", "transformer")
  assert len(figure3.read_results(workdir)) == 10
  # Pretraining alone (--pretrain_only) reuses every finished stack.
  sweep.pretrain_sweep(setup, workdir, "both")
  assert sorted(os.listdir(os.path.join(workdir, "pretrain"))) == pdirs
  monkeypatch.undo()

  # The sweep on 8 host devices: every line as on one device, to float
  # tolerance (the pretraining's sums run in another order).
  twin.wait(timeout=600)
  assert twin.returncode == 0, twin.output()[0][-3000:]
  one = {r.key(): r for r in lines if r.panel == "left"  # one stack
         and r.method != "finetune_linear"}
  got = figure3.read_results(eight)
  assert {r.key() for r in got} == set(one)
  for r in got:
    want = one[r.key()]
    for name in ("pretrain_mlm_ce", "pretrain_bayes_ce", "pretrain_tv",
                 "final_loss"):
      assert getattr(r, name) == pytest.approx(getattr(want, name),
                                               rel=1e-4), (r.key(), name)
    assert r.pretrain_bayes_ce == want.pretrain_bayes_ce  # the same data
    assert abs(r.test_accuracy - want.test_accuracy) <= 1 / 32, r.key()

  figure3.write_figure3_report(workdir)
  table = open(os.path.join(workdir, "figure3.md")).read()
  assert "transformer: vanilla + prompt linear" in table
  assert "vanilla-h8" in table and "Bayes CE" in table
  assert "Per trial (HMM draw)" in table

  # SIGKILL during stacked pretraining, then during tuning (subprocesses),
  # then a plain rerun: the same lines as the uninterrupted run, none duplicated, none
  # torn, none missing, equal values (resumed pretraining is bit-exact).
  crashed = str(tmp_path / "crashed")
  script = _KILLED_SWEEP.format(args=_SETUP_ARGS)
  run = lambda *a: zygote.run(["-c", script, crashed, *a])
  first = run("pretrain")
  assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
  results = os.path.join(crashed, "results.jsonl")
  assert not os.path.exists(results)
  h4 = os.listdir(os.path.join(crashed, "pretrain"))
  assert os.listdir(os.path.join(crashed, "pretrain", h4[0],
                                 "checkpoints")) == ["10"]
  second = run("tune")
  assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
  assert [r["method"] for r in files_lib.read_jsonl(results)] == [
      "head_linear"] * 2
  # (In this process: the programs are the first sweep's, compiled.)
  figure3.run_sweep(SETUP, crashed, "left", "transformer")
  raw = files_lib.read_jsonl(results)
  got = figure3.read_results(crashed)
  assert len(raw) == len(got) == len({r.key() for r in got}) == 4
  want = {r.key(): r for r in lines if r.panel == "left"
          and r.method != "finetune_linear"}
  assert {r.key() for r in got} == set(want)
  for r in got:
    w = want[r.key()]
    assert (r.test_accuracy, r.pretrain_ce_gap, r.hmm_fingerprint) == (
        w.test_accuracy, w.pretrain_ce_gap, w.hmm_fingerprint)


def _workers_command(workdir, sizes):
  """The exact backbone's left panel by the binary's ``--workers=2``."""
  return [sys.executable, "-m", "experiments.figure3", "--preset=tiny",
          "--backbone=exact", "--panel=left", f"--workdir={workdir}",
          "--workers=2", "--config.trials=1", f"--config.left_sizes={sizes}",
          "--config.features=raw", *[f"--config.{k}={v}" for k, v in
                                     _SETUP_ARGS["overrides"].items()]]


def _ends(stderr: str) -> list[str]:
  """``stderr`` without absl's log lines."""
  return [l for l in stderr.splitlines() if not re.match(r"[IW]\d{4} ", l)]


def test_sharded_sweep_merges_to_the_unsharded_one(tmp_path):
  whole, shards = str(tmp_path / "whole"), str(tmp_path / "shards")
  setup = dataclasses.replace(SETUP, left_sizes=(4, 6), trials=1)
  figure3.run_sweep(setup, whole, "left", "exact")
  for i in range(2):
    figure3.run_sweep(setup, shards, "left", "exact",
                scheduling.Schedule(num_hosts=2, host_index=i))
  files = sorted(os.listdir(shards))
  assert files == ["results-00000-of-00002.jsonl",
                   "results-00001-of-00002.jsonl", "sweep.json"]
  files = files[:2]
  per_file = [{r["num_states"] for r in files_lib.read_jsonl(
      os.path.join(shards, f))} for f in files]
  assert per_file == [{4}, {6}]  # each HMM on one host
  acc = lambda d: sorted((r.key(), r.test_accuracy)
                         for r in figure3.read_results(d))
  assert acc(shards) == acc(whole)

  # The binary's --workers=2: two processes, one per core, claim the two
  # stacks between them and their lines end merged in results.jsonl, equal
  # to the one process's (the exact backbone's tuning on one core sums as
  # on two here; accuracies equal, losses to float rounding).
  pool, command = str(tmp_path / "workers"), _workers_command
  proc = zygote.run(command(pool, "4,6")[1:])
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "worker 0" in proc.stderr and "worker 1" in proc.stderr
  # No log line that looks like an error: JAX's probe for libtpu is not
  # logged (experiments/__init__.py).
  assert "Unable to initialize backend" not in proc.stderr, proc.stderr
  # Both workers count the run's groups against one total (before, a
  # worker's total shrank as the other claimed stacks).
  counts = re.findall(r"\[(\d+)/(\d+) groups, all workers\]", proc.stderr)
  # 2 stacks x head and prompt; the last line (either worker's) at 4 of 4.
  assert len(counts) == 4 and {int(n) for _, n in counts} == {4}, (
      proc.stderr[-3000:])
  assert max(int(k) for k, _ in counts) == 4
  assert not re.search(r"\[\d+/\d+ groups\]", proc.stderr)
  assert sorted(os.listdir(pool)) == ["figure3.md", "figure3.png",
                                      "results.jsonl", "sweep.json"]
  assert acc(pool) == acc(whole)
  by_key = {r.key(): r for r in figure3.read_results(whole)}
  for r in figure3.read_results(pool):
    assert r.final_loss == pytest.approx(by_key[r.key()].final_loss,
                                         rel=1e-5)

  # Ctrl-C reaches the parent and both workers (one process group), a
  # SIGTERM the parent alone: one line, the parent's, as for one process,
  # no worker outlives it and no claims folder is left; a SIGKILL of the
  # parent alone says nothing, and its workers end within seconds.
  for n, (sig, to) in enumerate(((signal.SIGINT, os.killpg),
                                 (signal.SIGTERM, os.kill),
                                 (signal.SIGKILL, os.kill))):
    stopped = str(tmp_path / f"stopped{n}")
    os.makedirs(tmp := str(tmp_path / f"tmp{n}"))
    proc = subprocess.Popen(command(stopped, "4,6,8,10,12,14,16,18"),
                            cwd=ROOT, text=True, stderr=subprocess.PIPE,
                            start_new_session=True,
                            env=dict(os.environ, TMPDIR=tmp))
    try:
      err = ""
      while not all(f"worker {i}" in err for i in range(2)):
        err += proc.stderr.readline()
      to(proc.pid, sig)
      proc.wait(timeout=60)
      # EOF once the workers, which hold the pipe too, have ended: at
      # once, not after their ~8 stacks.
      t0 = time.monotonic()
      err += proc.stderr.read()
      assert time.monotonic() - t0 < 5, err[-3000:]
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    assert "claims" not in " ".join(os.listdir(stopped))
    if sig == signal.SIGKILL:
      assert proc.returncode == -sig and "error:" not in err, err[-3000:]
      continue
    assert proc.returncode == 128 + sig and _ends(err) == [
        f"error: stopped by {sig.name}; rerun the same command to resume "
        f"(finished work is kept in {stopped})"], err[-3000:]
    assert not [f for f in os.listdir(tmp) if "hmmprompt-claims" in f]


def test_a_workers_fault_ends_the_run_in_its_one_line(tmp_path, small_disk):
  """A full disk under ``--workers=2``: the worker that meets it leaves its
  error to the parent, which stops the other at once and ends with that
  one line and status 1, as one process does (before: each worker's line,
  then the parent's ``workers exited with [1, 1]``)."""
  workdir = str(small_disk("size=1m") / "w")
  os.makedirs(tmp := str(tmp_path / "tmp"))
  proc = subprocess.Popen(_workers_command(workdir, "4,6,8,10,12,14,16,18"),
                          cwd=ROOT, text=True, stderr=subprocess.PIPE,
                          env=dict(os.environ, TMPDIR=tmp))
  try:
    err = ""
    while not all(f"worker {i}" in err for i in range(2)):
      err += proc.stderr.readline()
    with pytest.raises(OSError, match="No space left"), open(
        os.path.join(os.path.dirname(workdir), "filler"), "wb") as f:
      while True:
        f.write(bytes(1 << 12))
        f.flush()
    err += proc.communicate(timeout=120)[1]
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 1, err[-3000:]
  assert re.fullmatch(
      re.escape("error: [Errno 28] No space left on device: ") + r"'.*'; "
      + re.escape(f"rerun the same command to resume (finished work is "
                  f"kept in {workdir})"), "\n".join(_ends(err))), err[-3000:]
  assert not os.listdir(tmp)  # the claims and the workers' faults
