r"""System against user time of a pretraining step, Figure 3's (``cpu``,
``|H|`` = 12, 3 draws) beside ICL's (5 seeds), with the binaries' glibc
settings and one malloc arena (docs/performance.md), a process each.

  python -m experiments.bench.sys_time [--steps=30] [--warmup=5]
"""

import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from experiments.bench import harness
from hmmprompt import generative
from hmmprompt import ginc
from hmmprompt import glibc
from hmmprompt import icl
from hmmprompt import pretrain

_STEPS = flags.DEFINE_integer("steps", 30, "timed steps per run")
_WARMUP = flags.DEFINE_integer("warmup", 5, "untimed steps first")
_CHILD = flags.DEFINE_string("child", None, "internal: STUDY,ARENAS")
_RUNS = [(s, a) for s in ("figure3", "icl") for a in ("default", "one")]


def child(name: str, arenas: str) -> None:
  """Prints the timed steps' seconds, minor faults per step (this process)."""
  glibc.retain_freed_memory()
  if arenas == "one":
    glibc.one_arena()
  if name == "icl":
    setup = icl.get_setup("cpu")
    mix = ginc.mixture(icl.load_concepts(setup, "id"))
    cfg, models_K = setup.pretrain, generative.stack([mix] * setup.seeds)
  else:
    job = pretrain.Job.of("cpu", num_states=12, trials=3)
    cfg, models_K = job.pretrain, job.make_model()
  warm, n = _WARMUP.value, _STEPS.value
  cfg = dataclasses.replace(cfg, steps=warm + n, cycles=None, target_gap=None,
                            eval_every=10**9, ckpt_every=10**9)
  marks = {}
  def after_step(step):
    if step in (warm, warm + n):
      use = resource.getrusage(resource.RUSAGE_SELF)
      marks[step] = (time.perf_counter(), use.ru_utime, use.ru_stime,
                     use.ru_minflt)
  with tempfile.TemporaryDirectory() as d:
    pretrain.run_trials(d, cfg, models_K, log=lambda _: None,
                        after_step=after_step)
  deltas = [(b - a) / n for a, b in zip(marks[warm], marks[warm + n])]
  print(json.dumps(dict(zip(("wall", "user", "sys", "faults"), deltas))))


def main(argv):
  if _CHILD.value:
    return child(*_CHILD.value.split(","))
  harness.start(argv, devices=False)
  print(f"{_STEPS.value} steps after {_WARMUP.value}; per step:\n"
        "study    arenas   wall ms  user ms  sys ms  sys/user  faults  "
        "wall vs default")
  base = {}
  for name, arenas in _RUNS:
    proc = subprocess.run(  # in the checkout, for -m
        [sys.executable, "-m", "experiments.bench.sys_time",
         f"--steps={_STEPS.value}", f"--warmup={_WARMUP.value}",
         f"--child={name},{arenas}"], capture_output=True, text=True,
        check=False, cwd=harness.ROOT)
    if proc.returncode:
      sys.exit(f"{proc.stderr[-4000:]}\n{name} ({arenas}) failed (exit "
               f"{proc.returncode})")
    out = json.loads(proc.stdout)
    base.setdefault(name, out["wall"])
    print(f"{name:8s} {arenas:8s} {1e3 * out['wall']:7.0f} "
          f"{1e3 * out['user']:8.0f} {1e3 * out['sys']:7.0f} "
          f"{out['sys'] / out['user']:8.2f} {out['faults']:7.0f} "
          f"{out['wall'] / base[name]:8.2f}x", flush=True)


if __name__ == "__main__":
  app.run(main)
