r"""The tuning noise floor of Figure 3's arms (docs/noise_floor.md).

  python -m experiments.noise_floor --preset=cpu_paper --workdir=DIR \
      --sizes=4,12,30 --trials=5 --replicates=5 --backbone=exact,transformer \
      [--committed=docs/results/figure3-cpu-paper]

DIR is a Figure 3 workdir of the same preset (its pretrained transformers
are reused, or pretrained); ``replicates.jsonl`` gets every tuning, and
``noise_floor.md`` / ``noise_floor.json`` the spreads and each arm's floor,
with DIR's lines set beside ``--committed``'s and, where DIR holds
``--config.head_optimum`` lines, Adam beside the optimum. Reruns resume.
"""

import os

from absl import app
from absl import flags

from experiments import cli
from hmmprompt import files as files_lib
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import sweep

_PRESET = flags.DEFINE_enum("preset", "cpu_paper", list(configs.PRESETS),
                            "the Figure 3 preset whose arms are measured")
_CONFIG = cli.define_config(configs.PRESETS["cpu"]())
_WORKDIR = flags.DEFINE_string("workdir", None, "a Figure 3 workdir of the "
                               "preset (required; a rerun resumes)")
_BACKBONE = flags.DEFINE_list("backbone", ["exact"], "exact and/or "
                              "transformer")
_SIZES = flags.DEFINE_list("sizes", ["4", "12", "30"], "left-panel |H|")
_TRIALS = flags.DEFINE_integer("trials", 5, "the first draws of each size")
_REPLICATES = flags.DEFINE_integer("replicates", 5, "tuning seeds per cell")
_REL = flags.DEFINE_float("rel", 1e-6, "the backbone's relative perturbation "
                          "(0: none)")
_ARMS = flags.DEFINE_list("arms", list(noise.ARMS), "the arms (Setup.arms "
                          "specs, e.g. head,prompt-5,lora-1)")
_COMMITTED = flags.DEFINE_string(
    "committed", None, "a results directory of the same setup to set DIR's "
    "lines beside (reproduction across machines)")
flags.adopt_module_key_flags(cli)


@cli.one_line_errors
def main(argv):
  t0, workdir = cli.start(argv, workdir=_WORKDIR.value), _WORKDIR.value
  with cli.usage_errors():
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    configs.check_run(setup, _BACKBONE.value)
    cli.make_dir(workdir)
    sweep.check_workdir(workdir, setup)
    sizes = [int(s) for s in _SIZES.value]
    for name in _BACKBONE.value:
      noise.run(setup, workdir, name, sizes, _TRIALS.value,
                _REPLICATES.value, _REL.value, arms=_ARMS.value)
  title = (f"The tuning noise floor: preset {_PRESET.value}, |H| = "
           f"{', '.join(map(str, sizes))}, {_TRIALS.value} draws, "
           f"{_REPLICATES.value} tuning seeds")
  page = os.path.join(workdir, "noise_floor.md")
  files_lib.atomic_write_text(page, reporting.noise_floor_page(
      workdir, title, _COMMITTED.value))
  cli.done(t0, report=page)


if __name__ == "__main__":
  app.run(main)
