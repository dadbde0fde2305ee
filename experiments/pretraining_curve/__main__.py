"""Accuracy against pretraining quality (docs/pretraining_curve.md).
  python -m experiments.pretraining_curve --preset=cpu --workdir=DIR
Every setup field is a --config.<path> flag; --helpfull lists them.
"""

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import pretraining_curve as curve
from hmmprompt.pretraining_curve import report

main = cli.study_main(curve, curve.run_curve, report.write_curve_report,
                      results="curve.jsonl", table="curve.md", plot="curve.png")
flags.adopt_module_key_flags(cli)
if __name__ == "__main__":
  app.run(main)
