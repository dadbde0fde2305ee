r"""Figure 3: head vs prompt tuning on HMM draws, exact and pretrained
backbones (docs/figure3.md).

  python -m experiments.figure3 --preset=cpu --backbone=exact,transformer \
      --workdir=runs/figure3 --workers=0 [--panel=left] [--config.trials=5]

The flags set most often, besides those above:
  --preset       tiny (a smoke run), cpu (the main job), cpu_paper, paper, gpu,
                 adaptation (docs/adaptation.md; --config.arms)
  --panel        left (vanilla HMMs), right (memory HMMs) or both
  --config.trials, --config.right_trials      HMM draws per size
  --config.left_sizes, --config.memory_sizes  the panels' sizes, e.g. 4,8
Every field of the preset is a --config.<path>=<value> flag (--helpfull
lists them), --print_config prints the chosen preset's.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from experiments import cli
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import sweep
from hmmprompt.figure3 import workers
from hmmprompt import scheduling
from hmmprompt.pretrain import report as pretrain_report

_PRESET = flags.DEFINE_enum("preset", "cpu", list(configs.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = cli.define_config(configs.PRESETS["cpu"]())
_BACKBONE = flags.DEFINE_list("backbone", ["exact"], "exact (Appendix B) "
                              "and/or transformer (pretrained: DIR/pretrain/)")
_WORKDIR = flags.DEFINE_string("workdir", None, "output; a rerun resumes")
_PANEL = flags.DEFINE_enum("panel", "both", ["left", "right", "both"], "which")
_PRETRAIN_ONLY = flags.DEFINE_bool("pretrain_only", False, "pretrain the "
                                   "models, write DIR/pretraining.*, stop")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 1, "hosts the sweep is split "
                                  "over (a SLURM array; an HMM's cells: one)")
_TASK_INDEX = flags.DEFINE_integer("task_index", 0, "this host's, < num_tasks")
_PRINT_CONFIG = cli.define_print_config()
_WORKERS, _WORKER, _CLAIMS = cli.define_worker_flags("the sweep")
flags.adopt_module_key_flags(cli)


def _schedule(backbone: str) -> scheduling.Schedule:
  """This process's share: a worker's claims, or a host's shard."""
  if _WORKER.value is not None:
    return scheduling.Schedule(
        claim=workers.claims(_CLAIMS.value, backbone),
        progress=workers.progress(_CLAIMS.value, backbone))
  return scheduling.Schedule(num_hosts=_NUM_TASKS.value,
                             host_index=_TASK_INDEX.value)


def _run(setup, workdir: str, names: list[str]) -> None:
  """This process's part: all of it, a host's share, or a worker's."""
  worker = _WORKER.value
  only = ["transformer"] if _PRETRAIN_ONLY.value else names
  # The transformer first: its long stacks are best claimed first.
  for name in sorted(only, key=lambda n: n != "transformer"):
    logging.info("backbone %s, preset %s, task %d of %d%s", name,
                 _PRESET.value, _TASK_INDEX.value, _NUM_TASKS.value,
                 "" if worker is None else f", worker {worker}")
    if _PRETRAIN_ONLY.value:
      sweep.pretrain_sweep(setup, workdir, _PANEL.value, _schedule(name))
    else:
      sweep.run_sweep(setup, workdir, _PANEL.value, name, _schedule(name),
                      results_file=None if worker is None else
                      workers.worker_results_path(workdir, worker))


@cli.one_line_errors
def main(argv):
  t0 = cli.start(argv, workdir=_WORKDIR.value)
  workdir, names = _WORKDIR.value, _BACKBONE.value
  with cli.usage_errors():
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    if _PRINT_CONFIG.value:
      return cli.print_config(setup)
    configs.check_run(setup, names, _PRETRAIN_ONLY.value)
    _schedule("exact").check()
    count = (1 if _WORKER.value is not None else
             workers.resolve_count(_WORKERS.value, _NUM_TASKS.value))
    cli.make_dir(workdir)  # a file, or not writable: refused before work
    sweep.check_workdir(workdir, setup)  # a workdir of another setup?
  if _WORKER.value is not None:
    return _run(setup, workdir, names)
  workers.merge_results(workdir)  # what a killed run's workers left
  if count > 1:
    workers.run_workers(sys.argv, count, workdir)
  else:
    _run(setup, workdir, names)
  if _PRETRAIN_ONLY.value:
    return print(pretrain_report.write_report(workdir))
  reporting.write_figure3_report(workdir)
  cli.done(t0, results=schema.results_path(workdir, _NUM_TASKS.value,
                                             _TASK_INDEX.value),
           plot=os.path.join(workdir, "figure3.png"),
           table=os.path.join(workdir, "figure3.md"))


if __name__ == "__main__":
  app.run(main)
