r"""Compile reuse in the transformer sweep: XLA compilations and their time
with transformer backbones cached per config (as shipped) against rebuilt
per model (a new static jit argument for every pretrained model).

  python -m experiments.bench.compiles [--preset=cpu] [--pretrain_steps=100]

Runs the sweep twice in fresh processes and workdirs, pretraining cut to
``--pretrain_steps`` (only tuning's compilations differ).
"""

import json
import sys
import tempfile
import time

from absl import app
from absl import flags

from experiments.bench import harness

_PRESET = flags.DEFINE_string("preset", "cpu", "figure3 preset")
_STEPS = flags.DEFINE_integer("pretrain_steps", 100,
                              "pretraining steps per model")
_CHILD = flags.DEFINE_enum("child", None, ["cached", "uncached"],
                           "internal: run one sweep and print its counts")
_WORKDIR = flags.DEFINE_string("child_workdir", None, "internal")


def _child(mode: str, workdir: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from hmmprompt import figure3  # pylint: disable=g-import-not-at-top
  from hmmprompt.backbones import transformer  # pylint: disable=g-import-not-at-top

  stats = {"compiles": 0, "compile_s": 0.0}

  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      stats["compiles"] += 1
      stats["compile_s"] += duration

  jax.monitoring.register_event_duration_secs_listener(listener)
  if mode == "uncached":  # new closures for every model
    transformer.make_backbone = transformer.build_backbone
  setup = figure3.get_setup(_PRESET.value,
                            overrides={"pretrain.steps": _STEPS.value})
  t0 = time.perf_counter()
  figure3.run_sweep(setup, workdir, "both", "transformer")
  stats["wall_s"] = time.perf_counter() - t0
  stats["lines"] = len(figure3.read_results(workdir))
  print(json.dumps(stats))


@harness.main(devices=False)  # the sweeps start theirs in their processes
def main():
  if _CHILD.value:
    return _child(_CHILD.value, _WORKDIR.value)
  out = {}
  for mode in ("uncached", "cached"):
    with tempfile.TemporaryDirectory() as d:
      proc = harness.child(
          [sys.executable, "-m", "experiments.bench.compiles",
           f"--child={mode}", f"--child_workdir={d}",
           f"--preset={_PRESET.value}", f"--pretrain_steps={_STEPS.value}"],
          f"the {mode} sweep")
      out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
      print(f"{mode:9s} {out[mode]}", flush=True)
  u, c = out["uncached"], out["cached"]
  print(f"compiles {u['compiles']} -> {c['compiles']}; compile time "
        f"{u['compile_s']:.0f} s -> {c['compile_s']:.0f} s; sweep wall "
        f"{u['wall_s']:.0f} s -> {c['wall_s']:.0f} s "
        f"({u['wall_s'] / c['wall_s']:.2f}x)")


if __name__ == "__main__":
  app.run(main)
