"""The pretraining binary end to end: data parallelism over processes on
one machine, SIGKILL and resume, checkpoints written once, usage errors.

Two local CPU processes joined by ``jax.distributed`` (a coordinator on the
loopback address, gloo collectives) pretrain the tiny preset (exact
targets) as one model, data-parallel over their two devices: the result
equals a one-process run on two devices bit for bit, each checkpoint is
written once, a two-process run killed mid-way resumes exactly, and a
one-device process reads its checkpoints. (That data parallelism equals
one device to float tolerance is the 8-device sweep's claim, in
test_figure3_sweep.py.) The first run finds its coordinator,
process count and index from the binary's flags, the rerun the way it
would under ``srun`` (SLURM's variables, set by hand here: there is no
SLURM on this machine). docs/multihost.md shows both launches. Each run
is ``python -m experiments.pretrain`` in its own process, a child of a
zygote (tests/zygote.py).
"""

import json
import os
import random
import re
import signal
import socket

import jax
import numpy as np

import binaries  # tests/integration/binaries.py
import zygote  # tests/zygote.py
from hmmprompt import pretrain

# Exact targets: computed inside the step, each device on its batch share.
ARGS = ["--preset=tiny", "--config.num_states=6", "--config.hmm_seed=3",
        "--config.pretrain.targets=exact"]
# SLURM's port for a job: SLURM_JOB_ID % 4096 + 61440 (jax's slurm_cluster).
_SLURM_PORT0 = 65535 - 2**12 + 1


def _env(devices: int, **extra) -> dict:
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return dict(os.environ, JAX_PLATFORMS="cpu", **extra, XLA_FLAGS=" ".join(
      flags + [f"--xla_force_host_platform_device_count={devices}"]))


def _port_is_free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


def _launch(workdir, env, *extra):
  return zygote.popen(["-m", "experiments.pretrain", f"--workdir={workdir}",
                       *ARGS, *extra], env)


def _wait(procs):
  """``[(returncode, stderr)]``; kills the rest if one hangs."""
  out = []
  try:
    for p in procs:
      _, err = p.communicate(timeout=240)
      out.append((p.returncode, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return out


def _two_processes_as_srun(workdir, *extra):
  """What ``srun --ntasks=2`` on one node sets, and ``--distributed``."""
  job = next(j for j in iter(lambda: random.randrange(2**12), None)
             if _port_is_free(_SLURM_PORT0 + j))
  return _wait([_launch(workdir, _env(
      1, SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost",
      SLURM_NTASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID=str(i)),
                        "--distributed", *extra) for i in range(2)])


def _metrics(workdir):
  lines = [json.loads(l) for l in open(os.path.join(workdir,
                                                    "metrics.jsonl"))]
  assert all(l.pop("wall_s") > 0 for l in lines)
  return lines


def _params(workdir):
  return jax.tree_util.tree_leaves_with_path(
      pretrain.load_backbone(workdir)[1])


def test_two_processes_equal_two_devices_and_resume(tmp_path):
  w = {name: str(tmp_path / name) for name in ("two_devices",
                                                "two_processes")}
  # One process on 2 devices, and two processes of 1 device each (one model
  # data-parallel over both) killed after step 35, between the checkpoints
  # of steps 30 and 40; side by side.
  port = next(p for p in iter(lambda: random.randint(20000, 40000), None)
              if _port_is_free(p))
  out = _wait([_launch(w["two_devices"], _env(2))] + [
                   _launch(w["two_processes"], _env(1), "--distributed",
                           f"--coordinator_address=127.0.0.1:{port}",
                           "--num_processes=2", f"--process_id={i}",
                           "--crash_at_step=35") for i in range(2)])
  assert out[0][0] == 0, out[0][1][-3000:]
  killed = out[1:]
  assert "process 1 of 2" in killed[1][1], killed[1][1][-3000:]
  assert "step 20: mlm_ce" in killed[0][1], killed[0][1][-3000:]
  # Process 0 kills itself; process 1 too, or it is ended by losing the
  # coordinator (process 0) first.
  assert killed[0][0] == -signal.SIGKILL and killed[1][0] != 0, killed[0][1][
      -3000:]
  # The same command, as srun would launch it: it resumes.
  out = _two_processes_as_srun(w["two_processes"])
  assert [rc for rc, _ in out] == [0, 0], out[0][1][-3000:] + out[1][1][-3000:]
  assert all("resumed from step 30" in err for _, err in out)

  # The killed and resumed run of 2 processes x 1 device ends where the
  # uninterrupted run of 1 process x 2 devices does, bit for bit (the same
  # program and sums, only the all-reduce crosses processes).
  two = _params(w["two_processes"])
  for (path, x), (_, y) in zip(two, _params(w["two_devices"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))
  m = _metrics(w["two_processes"])
  assert [(l["trial"], l["step"]) for l in m] == [(0, 20), (0, 40)]
  assert m == _metrics(w["two_devices"])

  # Each checkpoint written once: one directory per step kept (tiny keeps
  # 2) and, in it, one copy of the replicated state. Orbax splits its
  # writing between the processes: each writes its own OCDBT tree
  # (ocdbt.process_0/, ocdbt.process_1/), and their chunk keys are disjoint
  # and together the one-process run's (a copy per process would give each
  # tree every key). Keys, not bytes: how OCDBT batches chunks into
  # compressed data files varies from run to run (the same state took
  # 234-308 kB on disk in one run).
  def trees(workdir, step):
    root = os.path.join(workdir, "checkpoints", step, "default")
    return {d: _ocdbt_keys(os.path.join(root, d)) for d in os.listdir(root)
            if d.startswith("ocdbt.process_")}

  for name in ("two_processes", "two_devices"):
    assert sorted(os.listdir(os.path.join(w[name], "checkpoints"))) == [
        "30", "40"], name
  for step in ("30", "40"):
    (one,) = trees(w["two_devices"], step).values()
    split = trees(w["two_processes"], step)
    assert sorted(split) == ["ocdbt.process_0", "ocdbt.process_1"], split
    keys = list(split.values())
    assert all(keys) and not keys[0] & keys[1], step
    assert keys[0] | keys[1] == one, step


def _ocdbt_keys(tree: str) -> set:
  """The keys of one OCDBT tree (tensorstore: orbax's storage layer)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  store = ts.KvStore.open({"driver": "ocdbt",
                           "base": f"file://{os.path.abspath(tree)}/"})
  return set(store.result().list().result())


def test_bad_flags_fail_clearly(tmp_path):
  w = f"--workdir={tmp_path}"
  cases = [
      (["--preset=tiny"], "--workdir is required"),
      ([w, *ARGS, "--config.pretrain.model.num_heads=3"],
       "divisible by num_heads"),
      ([w, *ARGS, "--config.pretrain.lr_typo=1"], "config.pretrain.lr_typo"),
      ([w, *ARGS, "--config.pretrain.steps=ten"], "config.pretrain.steps"),
      ([w, *ARGS, "--config.trials=0"], "trials must be an int >= 1"),
      ([w, *ARGS, "--num_processes=2"],
       "--num_processes need --distributed"),
      ([w, *ARGS, "--distributed"], "pass --coordinator_address, "
       "--num_processes and --process_id"),
      ([w, *ARGS, "--distributed", "--coordinator_address=127.0.0.1:1",
        "--num_processes=2", "--process_id=2"], "process_id < num_processes"),
  ]
  env = {k: v for k, v in _env(1).items() if not k.startswith("SLURM_")}
  ends = binaries.usage_errors("experiments.pretrain",
                               [args for args, _ in cases], env=env)
  for (args, match), end in zip(cases, ends):
    assert end["returncode"] != 0, args
    assert match in end["stderr"], (args, end["stderr"][-2000:])
    assert "Traceback" not in end["stderr"], (args, end["stderr"][-2000:])


def test_faults_end_in_one_line_and_a_rerun_resumes(small_disk):
  """The faults a researcher meets end the binary with one line saying what
  happened and how to resume, no traceback (orbax's threads printed ~1 300
  lines for a full disk): a filesystem too small for the first checkpoint,
  then SIGTERM after the second. The newest checkpoint then damaged, the
  same command warns in one line (tensorstore's callbacks printed ~100
  tracebacks), resumes from the one before and finishes."""
  workdir, env = str(small_disk("size=128k") / "w"), _env(1)
  [full] = _wait([_launch(workdir, env)])
  small_disk("remount", "size=64m")
  [stopped] = _wait([_launch(workdir, env, "--crash_at_step=25",
                             "--crash_signal=SIGTERM")])
  for root, _, names in os.walk(os.path.join(workdir, "checkpoints", "20")):
    for name in names:
      if "metadata" not in name.lower() and "commit" not in name:
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"\0garbage" * 8)
  [again] = _wait([_launch(workdir, env)])
  for (rc, err), want_rc, what in (
      (full, 1, "[Errno 28] No space left on device (step 10's checkpoint "
       "needs"), (stopped, 128 + signal.SIGTERM, "stopped by SIGTERM")):
    ends = [l for l in err.splitlines() if not re.match(r"[IW]\d{4} ", l)]
    assert rc == want_rc and len(ends) == 1, err[-3000:]
    assert ends[0].startswith(f"error: {what}"), ends
    assert ends[0].endswith("; rerun the same command to resume (finished "
                            f"work is kept in {workdir})"), ends
  assert again[0] == 0, again[1][-3000:]
  assert [l for l in again[1].splitlines() if not re.match(
      r"[IW]\d{4} ", l)] == [], again[1][-3000:]
  assert "checkpoint at step 20" in again[1], again[1][-3000:]
  assert "resumed from step 10" in again[1], again[1][-3000:]
  # The finished run's result: a line per trial, its numbers as numbers
  # (not a dict's repr with np.float64(...)); a rerun prints it again and
  # evaluates (logs) nothing.
  done = zygote.run(["-m", "experiments.pretrain", f"--workdir={workdir}",
                     *ARGS], env, timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  assert re.fullmatch(r"trial 0: step \d+, ce_gap \d+\.\d{4}, tv \d\.\d{4}, "
                      r"mlm_ce \d+\.\d{4}, bayes_ce \d+\.\d{4}, \d+ s of "
                      r"training", done.stdout.splitlines()[0]), done.stdout
  assert "float64" not in done.stdout
  assert "mlm_ce" not in done.stderr, done.stderr[-3000:]
