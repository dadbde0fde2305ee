r"""Figure 3 on a lent accelerator, in chunks of whole size stacks.

  python -m experiments.accelerator --preset=gpu --chunk=left:4,8 \
      --budget_s=540 --out=$OUT [--results=docs/results/figure3-gpu] \
      [--backbone=transformer] [--config.<path>=...]
  python -m experiments.accelerator --merge=A.tar.gz[,B.tar.gz] \
      [--results=docs/results/figure3-gpu]
  python -m experiments.accelerator --preset=gpu --chunk=left:30 \
      --step_memory [--config.pretrain.trials_per_vmap=4]

A lent machine runs a command for minutes and keeps nothing, so the sweep
goes in chunks, each ending in one archive that is merged into the
committed results directory here:

* ``--chunk`` picks whole size stacks: ``left:4,8`` (|H| of the left
  panel), ``right:2,3`` (|M| of the right panel), ``left`` / ``right`` (a
  whole panel) or ``all``. A vanilla HMM both panels read (|H| = 8 is a
  left size and the twin of |M| = 2) is one stack of the most trials any
  panel reads; a chunk naming either panel's size runs both, so that no
  stack is drawn at another size or pretrained twice (logged).
* The work directory starts from ``--results``' ``results.jsonl`` and
  ``sweep.json``, so only missing cells are computed; results of another
  setup (other trial counts, a changed task, tuning or pretraining number,
  float32 vs bf16) are refused, what differs named: they would mix two
  setups in one report.
* ``--budget_s`` starts no stack after that many seconds (a stack started
  is finished), leaving time to write the archive. The work directory and
  its checkpoints are deleted at the end unless ``--workdir`` names one: a
  rerun with the same ``--workdir`` (on a machine kept warm) resumes a
  stack that a command's time limit cut short.
* ``OUT/figure3-gpu.tar.gz`` (written atomically, also after the budget or
  an error): ``results.jsonl``, ``sweep.json``, each pretraining run's
  ``pretrain/<run>/{metrics.jsonl,config.json}`` (no checkpoints), the
  report (``figure3.md``, ``figure3.png``, ``pretraining.png``) and
  ``run.json`` (preset, chunk, budget, device, wall time, cells computed).

``--step_memory`` computes nothing either: for each of the chunk's stacks
it compiles the pretraining step on shapes only and prints its state and
temporaries (:func:`hmmprompt.pretrain.step_memory`) against the device's
memory, to pick ``--config.pretrain.trials_per_vmap`` before a run rather
than from an out-of-memory error (seconds per stack; on the CPU an upper
bound).

``--merge`` computes nothing: it adds each archive's result lines to
``--results`` by key (a key already there keeps its line; different values
under one key are counted and logged), checks ``sweep.json`` and the
setup fingerprints agree, copies the pretraining metrics, appends
``run.json`` to ``runs.jsonl`` and renders the report again.

The library is :mod:`experiments.figure3.chunks`.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags

from experiments import cli
from experiments.figure3 import chunks
from experiments.figure3 import configs
from experiments.figure3 import sweep
from hmmprompt import config_flags

ARCHIVE = chunks.ARCHIVE

_PRESET = flags.DEFINE_enum("preset", "gpu", list(configs.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = config_flags.define(configs.PRESETS["gpu"]())
_BACKBONE = flags.DEFINE_enum("backbone", "transformer", sweep.BACKBONES,
                              "the pretrained transformer, or exact "
                              "(perfect pretraining; tests)")
_CHUNK = flags.DEFINE_string(
    "chunk", "all", "which size stacks: left:SIZES (|H|), right:SIZES "
    "(|M|), left, right or all; SIZES comma-separated")
_BUDGET = flags.DEFINE_float(
    "budget_s", None, "start no stack after this many seconds (a stack "
    "started is finished); default: no limit")
_OUT = flags.DEFINE_string("out", None, f"where {ARCHIVE} is written")
_RESULTS = flags.DEFINE_string(
    "results", chunks.RESULTS_DIR, "the committed results directory: a run "
    "starts from its lines, --merge adds to them")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "a directory to compute in, kept (its checkpoints "
    "too: delete it when done); a rerun with it resumes a stack cut short "
    "by a time limit; default: a temporary one, deleted after the archive "
    "is written")
_STEP_MEMORY = flags.DEFINE_bool(
    "step_memory", False, "print each stack's pretraining-step memory (XLA's "
    "buffer assignment, compiled on shapes only) and stop")
_MERGE = flags.DEFINE_list(
    "merge", None, "archives to merge into --results (computes nothing)")


def _merge(archives: list[str], results: str) -> None:
  for archive in archives:
    c = chunks.merge(archive, results)
    print(f"{archive}: {c['added']} lines added, {c['kept']} already in "
          f"{results} ({c['conflicts']} with other values, kept)")


def _print_step_memory(setup, chunk: str) -> None:
  for m in chunks.step_memory(setup, chunk):
    need = m["argument_bytes"] + m["temp_bytes"]
    fits = ("" if m["device_bytes"] is None else
            f" of {m['device_bytes'] / 2**30:.1f} GiB: "
            f"{'fits' if need <= m['device_bytes'] else 'does NOT fit'}")
    print(f"{m['stack']}: {m['trials']} trials, trials_per_vmap "
          f"{m['trials_per_vmap']}: state {m['state_bytes'] / 2**30:.1f} "
          f"GiB, temporaries {m['temp_bytes'] / 2**30:.1f} GiB, step "
          f"{need / 2**30:.1f} GiB{fits}")


def main(argv):
  t0 = cli.start(argv)
  with cli.usage_errors():
    if _MERGE.value:
      missing = [a for a in _MERGE.value if not os.path.isfile(a)]
      if _OUT.value or missing:
        raise ValueError("--merge computes nothing: drop --out" if _OUT.value
                         else f"--merge: no such archive {missing}")
      return _merge(_MERGE.value, _RESULTS.value)
    if not _OUT.value and not _STEP_MEMORY.value:
      raise ValueError("--out is required (or --merge, --step_memory)")
    if _BUDGET.value is not None and _BUDGET.value < 0:
      raise ValueError(f"--budget_s must be >= 0, got {_BUDGET.value}")
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    # Before any work: a bad chunk, inputs beyond the context, results of
    # another setup.
    chunks.chunk_sizes(setup, _CHUNK.value)
    configs.check_run(setup, [_BACKBONE.value])
    for where in (_RESULTS.value, _WORKDIR.value):
      if where:
        sweep.check_workdir(where, setup, write=False)
  if _STEP_MEMORY.value:
    return _print_step_memory(setup, _CHUNK.value)
  info = chunks.run_chunk(setup, _CHUNK.value, _BACKBONE.value,
                          _RESULTS.value, _OUT.value, _BUDGET.value,
                          _WORKDIR.value, _PRESET.value)
  print(f"{info['cells_computed']} cells, skipped stacks "
        f"{info['skipped_stacks']}")
  cli.done(t0, archive=os.path.join(_OUT.value, ARCHIVE))


if __name__ == "__main__":
  app.run(main)
