"""experiments.in_chunks: chunks in separate processes merge to the whole
sweep, a rerun computes nothing, a spent budget still writes the archive,
bad input is refused by name."""

import dataclasses
import json
import os
import re
import signal
import tarfile
import time

import pytest

import binaries  # tests/integration/binaries.py
import zygote  # tests/zygote.py
from hmmprompt.figure3 import chunks
from hmmprompt import figure3
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep
from hmmprompt import protocol
from hmmprompt import files as files_lib
from hmmprompt.pretrain import train as pretrain_train

# |H| = 8 is a left size and the vanilla twin of |M| = 2: one stack that
# both panels read, so a chunk naming either runs it whole.
_OVERRIDES = {"trials": 2, "features": "raw", "left_sizes": "4,8",
              "memory_sizes": "2", "task.num_train": 64, "task.num_val": 16,
              "task.num_test": 32, "task.seq_len": 12, "tune.epochs": 1,
              "tune.prompt_len": 2, "pretrain.steps": 20}
SETUP = figure3.get_setup("tiny", _OVERRIDES)
FLAGS = ["--preset=tiny", "--backbone=exact"] + [
    f"--config.{k}={v}" for k, v in _OVERRIDES.items()]


def _binary(*args):
  return zygote.run(["-m", "experiments.in_chunks", *FLAGS, *args])


def _members(out_dir):
  with tarfile.open(os.path.join(out_dir, chunks.ARCHIVE)) as tar:
    return sorted(tar.getnames())


def _run_json(out_dir):
  with tarfile.open(os.path.join(out_dir, chunks.ARCHIVE)) as tar:
    return json.load(tar.extractfile("run.json"))


def _values(workdir):
  """Key -> every field but the timing ones."""
  return {r.key(): {k: v for k, v in r.to_json().items()
                    if k not in chunks.TIMING_FIELDS}
          for r in schema.read_results(workdir)}


def test_chunk_sizes_close_over_shared_stacks_and_refuse_bad_text():
  assert chunks.chunk_sizes(SETUP, "all") == ((4, 8), (2,))
  assert chunks.chunk_sizes(SETUP, "left:4") == ((4,), ())
  # The vanilla |H| = 8 stack is the left size 8 and |M| = 2's twin.
  assert chunks.chunk_sizes(SETUP, "left:8") == ((8,), (2,))
  assert chunks.chunk_sizes(SETUP, "right:2") == ((8,), (2,))
  assert chunks.chunk_sizes(SETUP, "left") == ((4, 8), (2,))
  # Sizes are no part of the fingerprint: a chunk's lines key as the
  # whole sweep's.
  part = chunks.chunk_setup(SETUP, "left:4")
  for backbone in sweep.BACKBONES:
    assert part.fingerprint(backbone) == SETUP.fingerprint(backbone)
  for chunk, match in [("middle:4", "expected left:SIZES"),
                       ("left:4,x", "comma-separated integers"),
                       ("left:", "comma-separated integers"),
                       ("left:5", r"\[5\] not among the left panel's"),
                       ("right:4", r"\[4\] not among the right panel's")]:
    with pytest.raises(ValueError, match=f"--chunk='{chunk}'.*{match}"):
      chunks.chunk_sizes(SETUP, chunk)


def test_chunks_in_two_processes_merge_to_the_whole_run(tmp_path,
                                                       monkeypatch):
  empty, merged, whole = (str(tmp_path / d) for d in ("empty", "merged",
                                                      "whole"))
  os.makedirs(empty)
  outs = [str(tmp_path / f"out{i}") for i in range(2)]
  # Two processes: the binary in a subprocess, the other chunk in this one.
  # The binary runs --workers=2 (one process per core claiming stacks; its
  # one stack goes to one of them, the other finds none left).
  proc = _binary("--chunk=left:4", f"--results={empty}", f"--out={outs[0]}",
                 "--workers=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  chunks.run_chunk(SETUP, "right:2", "exact", empty, outs[1],
                        preset="tiny")
  assert os.listdir(empty) == []  # a run never writes to --results
  # No report: the merge renders it (nothing slow before the archive).
  assert _members(outs[0]) == ["results.jsonl", "run.json", "sweep.json"]
  runs = [_run_json(out) for out in outs]
  # left:4 is one stack (4 cells); right:2 runs the shared |H| = 8 stack
  # whole (left 4 cells, right 2) and the memory one (2).
  assert [(r["cells_computed"], r["left_sizes"], r["memory_sizes"])
          for r in runs] == [(4, [4], []), (8, [8], [2])]
  assert runs[0]["device"] == ["cpu:0"] and runs[0]["skipped_stacks"] == []
  assert runs[0]["workers"] == 2 and "workers" not in runs[1]
  for out in outs:
    chunks.merge(os.path.join(out, chunks.ARCHIVE), merged)
  assert len(files_lib.read_jsonl(os.path.join(merged, "runs.jsonl"))) == 2
  assert "paper prompt" in open(os.path.join(merged, "figure3.md")).read()

  info = chunks.run_chunk(SETUP, "all", "exact", empty,
                               str(tmp_path / "out_all"), preset="tiny")
  assert info["cells_computed"] == 12
  chunks.merge(str(tmp_path / "out_all" / chunks.ARCHIVE), whole)
  # The same cells as the whole run's; accuracies equal, the worker's
  # losses to float rounding (XLA single-threaded on one core sums in
  # its own order).
  parts, together = _values(merged), _values(whole)
  assert parts.keys() == together.keys() and len(parts) == 12
  for key, line in together.items():
    assert line["final_loss"] == pytest.approx(parts[key]["final_loss"],
                                               rel=1e-5)
    assert ({**line, "final_loss": 0} == {**parts[key], "final_loss": 0})

  # Merging again adds nothing (keys are kept once); rerunning a finished
  # chunk from the merged results computes nothing.
  counts = chunks.merge(os.path.join(outs[1], chunks.ARCHIVE),
                             merged)
  assert counts == {"added": 0, "kept": 8, "conflicts": 0}
  assert len(files_lib.read_jsonl(os.path.join(merged,
                                                 "results.jsonl"))) == 12

  def boom(*a, **k):
    raise AssertionError("finished work was redone")

  monkeypatch.setattr(protocol, "draw_stack", boom)  # no stack is made
  info = chunks.run_chunk(SETUP, "right:2", "exact", merged,
                               str(tmp_path / "out_again"))
  assert info["cells_computed"] == 0 and info["skipped_stacks"] == []

  # An archive of other trial counts, or of another setup, is refused.
  bad = str(tmp_path / "bad")
  os.makedirs(bad)
  files_lib.atomic_write_text(os.path.join(bad, "sweep.json"),
                                '{"trials": 5, "right_trials": 5}')
  with pytest.raises(ValueError, match=re.escape(
      "holds results of another setup (right_trials: 5 -> 2; trials: 5 -> 2")):
    chunks.merge(os.path.join(outs[0], chunks.ARCHIVE), bad)
  other = dataclasses.replace(SETUP, seed=1)
  with pytest.raises(ValueError, match=re.escape(
      "holds results of another setup (seed: 0 -> 1)")):
    chunks.run_chunk(other, "left:4", "exact", merged, str(tmp_path))
  os.remove(os.path.join(bad, "sweep.json"))
  files_lib.append_lines(os.path.join(bad, "results.jsonl"), [dataclasses.replace(
      schema.read_results(merged)[0], setup="0123456789ab")])
  with pytest.raises(ValueError, match="exact lines of setups"):
    chunks.merge(os.path.join(outs[0], chunks.ARCHIVE), bad)


_REFUSALS = [
    (["--chunk=left:5"], "--chunk='left:5': [5] not among the left panel's"),
    (["--checkpoints=deadline"], "error: --checkpoints=deadline needs "
     "--workdir: a temporary workdir is never resumed\n"),
]


def test_spent_budget_runs_no_stack_and_bad_chunks_are_refused(tmp_path):
  """A spent budget still writes the archive; a bad chunk is refused by
  name, writing nothing (one start of the binaries, forked per run)."""
  os.makedirs(tmp_path / "results")
  for i in range(len(_REFUSALS)):
    os.makedirs(tmp_path / f"bad{i}")
  spent, *refused = binaries.run_binaries([("experiments.in_chunks", [
      *FLAGS, "--budget_s=0", f"--results={tmp_path / 'results'}",
      f"--out={tmp_path / 'out'}"])] + [
          ("experiments.in_chunks", [*FLAGS, *flags,
                                     f"--out={tmp_path}/bad{i}"])
          for i, (flags, _) in enumerate(_REFUSALS)])
  assert spent["returncode"] == 0, spent["stderr"][-3000:]
  assert "deadline passed: skipped 3 stacks (6 groups)" in spent["stderr"]
  run = _run_json(str(tmp_path / "out"))
  assert run["cells_computed"] == 0 and run["budget_s"] == 0
  assert run["skipped_stacks"] == ["vanilla-h4", "vanilla-h8",
                                   "memory-h4-m2"]
  assert "run.json" in _members(str(tmp_path / "out"))
  for i, ((_, refusal), end) in enumerate(zip(_REFUSALS, refused)):
    assert end["returncode"] == 2 and "Traceback" not in end["stderr"]
    assert refusal in end["stderr"], end["stderr"][-2000:]
    assert os.listdir(tmp_path / f"bad{i}") == []


def test_transformer_chunk_archives_pretraining_metrics(tmp_path,
                                                       monkeypatch):
  setup = dataclasses.replace(SETUP, left_sizes=(4,), memory_sizes=())
  results, out = str(tmp_path / "results"), str(tmp_path / "out")
  workdir = str(tmp_path / "workdir")
  info = chunks.run_chunk(setup, "left:4", "transformer", results, out,
                               workdir=workdir)
  assert info["cells_computed"] == 4
  assert os.listdir(os.path.join(workdir, "pretrain"))  # kept, checkpoints
  names = _members(out)
  pretrain = [n for n in names if n.startswith("pretrain/")]
  tag = pretrain[0].split("/")[1]
  assert tag.startswith("vanilla-h4-") and pretrain == [
      f"pretrain/{tag}/config.json", f"pretrain/{tag}/metrics.jsonl"]
  # No checkpoints, no hmm.npz, no report (the merge renders it).
  assert not {"pretraining.png", "figure3.md"} & set(names)
  chunks.merge(os.path.join(out, chunks.ARCHIVE), results)
  metrics = files_lib.read_jsonl(os.path.join(results, "pretrain", tag,
                                                "metrics.jsonl"))
  assert {m["trial"] for m in metrics} == {0, 1}
  table = open(os.path.join(results, "figure3.md")).read()
  assert "Bayes CE" in table and tag in table

  # A rerun from the merged results neither pretrains nor tunes.
  def boom(*a, **k):
    raise AssertionError("finished work was redone")

  monkeypatch.setattr(pretrain_train, "make_train_step", boom)
  monkeypatch.setattr(protocol.tuning, "tune_trials", boom)
  info = chunks.run_chunk(setup, "left:4", "transformer", results,
                               str(tmp_path / "again"))
  assert info["cells_computed"] == 0
  assert not any(n.startswith("pretrain/")
                 for n in _members(str(tmp_path / "again")))
  # Nor does one from nothing in the kept workdir (what a stack cut short by
  # a time limit resumes from).
  info = chunks.run_chunk(setup, "left:4", "transformer",
                               str(tmp_path / "none"), str(tmp_path / "kept"),
                               workdir=workdir)
  assert info["cells_computed"] == 0


def test_step_bytes_per_stack_of_the_chunk():
  setup = dataclasses.replace(SETUP, memory_sizes=())
  got = chunks.chunk_step_bytes(setup, "left:8")
  assert [(m["stack"], m["trials"]) for m in got] == [("vanilla-h8", 2)]
  m = got[0]
  assert m["temp_bytes"] > 0 and m["state_bytes"] > 0
  assert m["device_bytes"] is None  # the CPU reports no memory limit


def test_sigterm_mid_tuning_archives_every_finished_cell(tmp_path):
  """A lent machine's time limit (SIGTERM) in the middle of tuning: the
  run ends within seconds with an archive of every finished cell and one
  line saying how to resume, its temporary workdir removed; the archive
  merges. The tuning program runs in XLA the while, where a Python signal
  handler would wait for it (issue 49 lost cells that way)."""
  results, out = tmp_path / "results", tmp_path / "out"
  os.makedirs(results)
  flags = [f for f in FLAGS if f != "--backbone=exact"]
  proc = zygote.popen(
      ["-m", "experiments.in_chunks", *flags, "--backbone=transformer",
       "--chunk=left:4", f"--results={results}", f"--out={out}",
       "--config.tune.epochs=20"])
  log = []
  while proc.poll() is None and not any(  # up to the first finished group
      "[1/" in line and "groups]" in line for line in log):
    time.sleep(0.05)
    log = proc.output()[1].splitlines()
  # A temporary workdir writes no checkpoints, and says so.
  workdir = next((l.split(" in ")[-1].split("/pretrain/")[0] for l in log
                  if "(no checkpoints)" in l), None)
  assert workdir and os.path.isdir(workdir), "\n".join(log)[-3000:]
  time.sleep(0.5)  # into the second group's tuning program
  proc.send_signal(signal.SIGTERM)
  t0 = time.monotonic()
  proc.wait(timeout=30)
  assert time.monotonic() - t0 < 5
  rest = proc.output()[1]
  assert proc.returncode == 128 + signal.SIGTERM, rest[-3000:]
  archive = os.path.join(out, chunks.ARCHIVE)
  assert rest.splitlines()[-1] == (
      f"stopped by SIGTERM: archive written; {archive} holds every finished "
      f"cell; rerun the same command to resume (merge the archive with "
      f"--merge={archive} first when this machine is gone)")
  assert not os.path.exists(workdir)
  run = _run_json(out)
  assert run["error"] == "stopped by SIGTERM"
  # Group 1 (head tuning, 2 trials) finished; the prompt groups did not.
  assert run["cells_computed"] == 2, rest[-3000:]
  assert chunks.merge(archive, str(results))["added"] == 2
  lines = schema.read_results(str(results))
  assert {(r.method, r.trial) for r in lines} == {("head_linear", 0),
                                                  ("head_linear", 1)}
  assert all(r.pretrain_ce_gap is not None for r in lines)


def test_only_a_kept_workdir_checkpoints(tmp_path, monkeypatch):
  """A temporary workdir is never resumed: its stacks pretrain without
  checkpoints (~7 GB an evaluation for 20 BERT-width trials); a kept
  --workdir keeps them, so a stack cut short resumes, every ckpt_every
  steps or, asked, only where the deadline stops it. Other asks are
  refused by name, before any directory is made."""
  seen = []
  monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: seen.append(
      (k["checkpoints"], os.path.basename(a[1]))) or [])
  os.makedirs(tmp_path / "results")
  run = lambda workdir, **kw: chunks.run_chunk(
      SETUP, "left:4", "transformer", str(tmp_path / "results"),
      str(tmp_path / "out"), workdir=workdir, **kw)
  for workdir in (None, str(tmp_path / "kept")):
    run(workdir)
  run(str(tmp_path / "kept"), checkpoints="deadline", deadline_s=100.0)
  run(None, checkpoints="never")
  assert seen[0][0] == "never" and seen[0][1].startswith("figure3-chunk-")
  assert seen[1:3] == [("always", "kept"), ("deadline", "kept")]
  assert seen[3][0] == "never"
  for workdir, kw, refusal in (
      (None, {"checkpoints": "always"}, "--checkpoints=always needs "
       "--workdir: a temporary workdir is never resumed"),
      (None, {"checkpoints": "deadline", "deadline_s": 9.0},
       "--checkpoints=deadline needs --workdir"),
      ("new", {"checkpoints": "deadline"}, "--checkpoints=deadline writes "
       "a checkpoint only where --deadline_s stops a stack: set "
       "--deadline_s"),
      ("new", {"checkpoints": "often"}, "checkpoints must be one of "
       "('always', 'deadline', 'never'), got 'often'")):
    with pytest.raises(ValueError, match=re.escape(refusal)):
      run(workdir and str(tmp_path / workdir), **kw)
  assert len(seen) == 4 and not os.path.exists(tmp_path / "new")


def test_merging_an_archive_again_or_into_another_preset(tmp_path,
                                                         monkeypatch):
  """Issue 66: an archive merged twice adds its run.json to runs.jsonl
  once; one merged under another --preset (or --config) than it ran with
  is refused by name, as a usage error of the binary, merging nothing."""
  monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: [])
  results, out = str(tmp_path / "results"), str(tmp_path / "out")
  os.makedirs(results)
  chunks.run_chunk(SETUP, "left:4", "exact", results, out, preset="tiny")
  archive = os.path.join(out, chunks.ARCHIVE)
  runs = os.path.join(results, "runs.jsonl")
  for _ in range(2):
    chunks.merge(archive, results, SETUP, "tiny")
    assert len(files_lib.read_jsonl(runs)) == 1
  before = sorted(os.listdir(results))
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{archive} holds results of another setup than this --preset=tiny "
      f"and its --config flags (seed: 0 -> 1): merge it with the flags it "
      f"ran with") + "$"):
    chunks.merge(archive, results, dataclasses.replace(SETUP, seed=1),
                 "tiny")
  proc = zygote.run(["-m", "experiments.in_chunks", "--preset=cpu",
                     f"--merge={archive}", f"--results={results}"])
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.splitlines()[-1] == (
      f"error: {archive} holds results of --preset=tiny, not of this "
      f"--preset=cpu: merge it with --preset=tiny (and the --config flags "
      f"it ran with)")
  assert sorted(os.listdir(results)) == before
  assert len(files_lib.read_jsonl(runs)) == 1
