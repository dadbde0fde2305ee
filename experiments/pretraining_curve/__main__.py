"""Accuracy against pretraining quality (docs/pretraining_curve.md): head
and prompt tuning on the checkpoints one stacked pretraining run per model
retains, the exact backbone on the same tasks as the limit.

  python -m experiments.pretraining_curve --preset=cpu --workdir=DIR

The flags set most often: --preset (tiny or cpu), --workdir (required; a
rerun resumes), --config.trials, --config.vanilla_sizes,
--config.memory_sizes, --config.pretrain.retain (the checkpoint steps).
Every field of the preset is a --config.<path>=<value> flag: --helpfull
lists them all with the default preset's values, --print_config prints
the chosen preset's.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import pretraining_curve as curve
from hmmprompt.pretraining_curve import report

_PRESET = flags.DEFINE_enum("preset", "cpu", list(curve.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = cli.define_config(curve.PRESETS["cpu"]())
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "output directory (required; a rerun with it resumes)")
_PRINT_CONFIG = cli.define_print_config()
flags.adopt_module_key_flags(cli)


@cli.one_line_errors
def main(argv):
  t0 = cli.start(argv, **({} if _PRINT_CONFIG.value else
                          {"workdir": _WORKDIR.value}))
  workdir = _WORKDIR.value
  with cli.usage_errors():
    setup = curve.get_setup(_PRESET.value, _CONFIG.value())
    if _PRINT_CONFIG.value:
      return cli.print_config(setup)
    cli.make_dir(workdir)  # a file, or not writable: before any work
    curve.check_workdir(workdir, setup)
  curve.run_curve(setup, workdir)
  print(report.write_curve_report(workdir))
  cli.done(t0, results=curve.lines_path(workdir),
           table=os.path.join(workdir, "curve.md"),
           plot=os.path.join(workdir, "curve.png"))


if __name__ == "__main__":
  app.run(main)
