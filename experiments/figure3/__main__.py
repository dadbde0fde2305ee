"""The Figure 3 binary: parse flags into a Setup, run, report (see the
package docstring for the command line)."""

from __future__ import annotations

import os
import time

from absl import app
from absl import flags
from absl import logging

from experiments.figure3 import configs
from experiments.figure3 import records
from experiments.figure3 import reporting
from experiments.figure3 import sweep
from hmmprompt import config_flags
from hmmprompt import host_memory
from hmmprompt import results as results_lib

_PRESET = flags.DEFINE_enum("preset", "cpu", list(configs.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = config_flags.define(configs.PRESETS["cpu"]())
_BACKBONE = flags.DEFINE_list(
    "backbone", ["exact"], "comma-separated, run in this order: exact "
    "(perfect pretraining: Appendix B's message passing) and/or transformer "
    "(the masked LM, pretrained once per HMM and cached under "
    "DIR/pretrain/)")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_PANEL = flags.DEFINE_enum("panel", "both", ["left", "right", "both"],
                           "which panel(s)")
_PRETRAIN_ONLY = flags.DEFINE_bool(
    "pretrain_only", False, "transformer: pretrain the sweep's models, "
    "write DIR/pretraining.md and DIR/pretraining.png and stop")
_NUM_TASKS = flags.DEFINE_integer(
    "num_tasks", 1, "split the sweep over this many hosts (a SLURM array, "
    "TPU VMs); each HMM's cells go to one host")
_TASK_INDEX = flags.DEFINE_integer("task_index", 0,
                                   "this host's index in [0, num_tasks)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  host_memory.retain_freed_memory()  # XLA:CPU step temporaries
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  backbones = _BACKBONE.value
  bad = [b for b in backbones if b not in sweep.BACKBONES]
  if bad or not backbones:
    raise app.UsageError(f"--backbone must be from "
                         f"{','.join(sweep.BACKBONES)}; got {backbones}")
  if _PRETRAIN_ONLY.value and "transformer" not in backbones:
    raise app.UsageError("--pretrain_only needs --backbone=transformer")
  if _NUM_TASKS.value < 1 or not 0 <= _TASK_INDEX.value < _NUM_TASKS.value:
    raise app.UsageError(f"need num_tasks >= 1 and 0 <= task_index < "
                         f"num_tasks; got --num_tasks={_NUM_TASKS.value} "
                         f"--task_index={_TASK_INDEX.value}")
  try:
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    if setup.finetune and "transformer" not in backbones:
      raise ValueError("--config.finetune needs --backbone=transformer (the "
                       "exact backbone has no free parameters to fine-tune)")
    if "transformer" in backbones:
      setup.check_context()
    workdir = _WORKDIR.value
    os.makedirs(workdir, exist_ok=True)
    sweep.check_workdir(workdir, setup)  # made with other trial counts?
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  # Usage errors end above; whatever fails below is a real error and keeps
  # its traceback.
  t0 = time.perf_counter()
  for name in backbones:
    if _PRETRAIN_ONLY.value and name != "transformer":
      continue
    logging.info("backbone %s, preset %s, task %d of %d", name,
                 _PRESET.value, _TASK_INDEX.value, _NUM_TASKS.value)
    sweep.run(setup, workdir, _PANEL.value, name, _NUM_TASKS.value,
              _TASK_INDEX.value, pretrain_only=_PRETRAIN_ONLY.value)
  if _PRETRAIN_ONLY.value:
    table = reporting.pretraining_report(workdir)  # + pretraining.png
    results_lib.atomic_write_text(os.path.join(workdir, "pretraining.md"),
                                  table)
    print(table)
    return
  reporting.report(workdir)
  logging.info("done in %.0fs", time.perf_counter() - t0)
  path = records.results_path(workdir, _NUM_TASKS.value, _TASK_INDEX.value)
  print(f"done in {time.perf_counter() - t0:.0f}s\nresults: {path}\n"
        f"plot:    {os.path.join(workdir, 'figure3.png')}\n"
        f"table:   {os.path.join(workdir, 'figure3.md')}")


if __name__ == "__main__":
  app.run(main)
