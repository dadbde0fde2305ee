"""Data-parallel pretraining over several processes, on one machine.

Two local CPU processes joined by ``jax.distributed`` (a coordinator on the
loopback address, gloo collectives) pretrain the tiny preset as one model,
data-parallel over their two devices: the result equals a one-process run
on two devices and on one (float tolerance), each checkpoint is written
once, and a two-process run killed mid-way resumes exactly. The killed run
and its rerun find their coordinator, process count and index the way they
would under ``srun`` (SLURM's variables, set by hand here: there is no
SLURM on this machine), the first run from the binary's flags
(docs/multihost.md).
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys

import jax
import numpy as np

from hmmprompt import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
ARGS = ["--preset=tiny", "--config.num_states=6", "--config.hmm_seed=3"]
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
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.pretrain", f"--workdir={workdir}",
       *ARGS, *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)


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


def _one_process(workdir, devices):
  (rc, err), = _wait([_launch(workdir, _env(devices))])
  assert rc == 0, err[-3000:]


def _two_processes_by_flags(workdir, *extra):
  port = next(p for p in iter(lambda: random.randint(20000, 40000), None)
              if _port_is_free(p))
  return _wait([_launch(workdir, _env(1), "--distributed",
                        f"--coordinator_address=127.0.0.1:{port}",
                        "--num_processes=2", f"--process_id={i}", *extra)
                for i in range(2)])


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
  return jax.tree.leaves(pretrain.load_backbone(workdir)[1])


def _assert_close(a, b, rtol=1e-5, atol=1e-6):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol,
                               atol=atol)


def test_two_processes_equal_one_and_resume(tmp_path):
  w = {name: str(tmp_path / name) for name in ("one", "two_devices",
                                                "two_processes", "killed")}
  _one_process(w["one"], 1)
  _one_process(w["two_devices"], 2)
  out = _two_processes_by_flags(w["two_processes"])
  assert [rc for rc, _ in out] == [0, 0], out[0][1][-3000:] + out[1][1][-3000:]
  assert "process 1 of 2" in out[1][1]

  # One model data-parallel: 2 processes x 1 device = 1 process x 2
  # devices = 1 process x 1 device, to float tolerance.
  two = _params(w["two_processes"])
  _assert_close(two, _params(w["two_devices"]))
  _assert_close(two, _params(w["one"]))
  m = _metrics(w["two_processes"])
  assert [(l["trial"], l["step"]) for l in m] == [(0, 20), (0, 40)]
  for other in ("two_devices", "one"):
    o = _metrics(w[other])
    assert [sorted(l) for l in o] == [sorted(l) for l in m]
    for a, b in zip(m, o):
      _assert_close([a[k] for k in sorted(a)], [b[k] for k in sorted(b)],
                    rtol=1e-4)

  # Each checkpoint once: one directory per step kept (tiny keeps 2), no
  # per-process copies or leftover temporaries.
  for name in ("two_processes", "two_devices"):
    assert sorted(os.listdir(os.path.join(w[name], "checkpoints"))) == [
        "30", "40"], name

  # Killed after step 25 (both processes), rerun: it resumes from the
  # checkpoint of step 20 and ends where the uninterrupted run ends.
  out = _two_processes_as_srun(w["killed"], "--crash_at_step=25")
  assert [rc for rc, _ in out] == [-signal.SIGKILL] * 2, out[0][1][-3000:]
  assert "process 1 of 2" in out[1][1]
  out = _two_processes_as_srun(w["killed"])
  assert [rc for rc, _ in out] == [0, 0], out[0][1][-3000:] + out[1][1][-3000:]
  assert all("resumed from step 20" in err for _, err in out)
  for x, y in zip(_params(w["killed"]), two):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _metrics(w["killed"]) == m
