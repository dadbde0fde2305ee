"""Accuracy against pretraining quality (docs/pretraining_curve.md): head
and prompt tuning on the checkpoints one stacked pretraining run per model
retains, the exact backbone on the same tasks as the limit.

  python -m experiments.pretraining_curve --preset=cpu --workdir=DIR

Often set: --config.trials, --config.vanilla_sizes, --config.memory_sizes,
--config.pretrain.retain (checkpoint steps); --helpfull lists all of them.
"""

import os

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import pretraining_curve as curve
from hmmprompt.pretraining_curve import report

_PRESET = flags.DEFINE_enum("preset", "cpu", list(curve.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = cli.define_config(curve.PRESETS["cpu"]())
_WORKDIR = flags.DEFINE_string("workdir", None, "output; a rerun resumes")
_PRINT_CONFIG = cli.define_print_config()
flags.adopt_module_key_flags(cli)


@cli.one_line_errors
def main(argv):
  t0, workdir = cli.start(argv, workdir=_WORKDIR.value), _WORKDIR.value
  with cli.usage_errors():
    setup = curve.get_setup(_PRESET.value, _CONFIG.value())
    if _PRINT_CONFIG.value:
      return cli.print_config(setup)
    cli.make_dir(workdir)
    curve.check_workdir(workdir, setup)
  curve.run_curve(setup, workdir)
  print(report.write_curve_report(workdir))
  cli.done(t0, results=curve.lines_path(workdir),
           table=os.path.join(workdir, "curve.md"),
           plot=os.path.join(workdir, "curve.png"))


if __name__ == "__main__":
  app.run(main)
