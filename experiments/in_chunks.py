r"""Figure 3 in chunks of size stacks, each resuming from committed results
(docs/figure3_gpu.md, docs/figure3.md; :mod:`hmmprompt.figure3.chunks`).

  python -m experiments.in_chunks --preset=gpu --chunk=all --deadline_s=540 \
      --out=$OUT [--results=docs/results/figure3-gpu] [--backbone=transformer] \
      [--workdir=DIR [--checkpoints=deadline]] [--workers=0] [--config.*=...]
  python -m experiments.in_chunks --preset=gpu --merge=A.tar.gz[,B.tar.gz]
  python -m experiments.in_chunks --preset=gpu --chunk=left:30 \
      --step_bytes [--config.pretrain.trials_per_vmap=4]

Writes the chunk's missing cells to ``OUT/figure3-chunk.tar.gz``, also
after the deadline, an error or a signal. ``--helpfull``: every flag.
"""

import os
import sys

from absl import app
from absl import flags

from experiments import cli
from hmmprompt.figure3 import chunks
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import sweep
from hmmprompt.figure3 import workers
from hmmprompt import scheduling

_PRESET = flags.DEFINE_enum("preset", "gpu", list(configs.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = cli.define_config(configs.PRESETS["gpu"]())
_BACKBONE = flags.DEFINE_enum("backbone", "transformer", sweep.BACKBONES,
                              "transformer, or exact (tests)")
_CHUNK = flags.DEFINE_string("chunk", "all", "size stacks: left, right, all, "
                             "left:SIZES (|H|) or right:SIZES (|M|), e.g. 4,8")
_BUDGET = flags.DEFINE_float("budget_s", None, "start no stack after this "
                             "many seconds (default: no limit)", lower_bound=0)
_DEADLINE_S = flags.DEFINE_float(
    "deadline_s", None, "hard deadline, seconds from the start: start only "
    "the stacks (or whole trials_per_vmap groups) the estimate finishes by "
    "then, cheapest first; at it stop between steps and write the archive",
    lower_bound=0)
_OUT = flags.DEFINE_string("out", None, f"where {chunks.ARCHIVE} is written")
_RESULTS = flags.DEFINE_string(
    "results", None, "the committed results (default: docs/results/"
    "figure3-<preset>, _ as -), started from; --merge adds to them")
_WORKDIR = flags.DEFINE_string("workdir", None, "compute here, kept (a rerun "
                               "resumes); default: a temporary directory")
_CHECKPOINTS = flags.DEFINE_enum(
    "checkpoints", None, ["always", "deadline", "never"], "always (default "
    "with --workdir), deadline (only where --deadline_s stops a stack; ~7 GB "
    "at BERT width) or never (default without --workdir)")
_STEP_MEMORY = flags.DEFINE_bool("step_bytes", False, "print step memory; stop")
_MERGE = flags.DEFINE_list("merge", None, "archives to merge into --results")
_PRINT_CONFIG = cli.define_print_config()
_WORKERS, _WORKER, _CLAIMS = cli.define_worker_flags("the chunk")
flags.adopt_module_key_flags(cli)
_DEADLINE = flags.DEFINE_float("deadline", None, "internal: time.monotonic()")


@cli.one_line_errors
def main(argv):
  t0 = cli.start(argv)
  results = _RESULTS.value or chunks.results_dir(_PRESET.value)
  chunk, backbone, workdir = _CHUNK.value, _BACKBONE.value, _WORKDIR.value
  with cli.usage_errors():
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    if _MERGE.value:
      if _OUT.value:
        raise ValueError("--merge computes nothing: drop --out")
      cli.make_dir(results, "--results")
      # Checks the archive's preset (its own --results would pass).
      return print(*chunks.merge_all(_MERGE.value, results, setup,
                                     _PRESET.value), sep="\n")
    if _PRINT_CONFIG.value:
      return cli.print_config(setup)
    if _WORKER.value is not None:  # claims the chunk's stacks till a deadline
      sweep.run_sweep(
          chunks.chunk_setup(setup, chunk), workdir, "both", backbone,
          scheduling.Schedule(
              claim=workers.claims(_CLAIMS.value, backbone),
              progress=workers.progress(_CLAIMS.value, backbone),
              deadline=_DEADLINE.value),
          results_file=workers.worker_results_path(workdir, _WORKER.value),
          checkpoints=_CHECKPOINTS.value or "always")
      return
    if not _OUT.value and not _STEP_MEMORY.value:
      raise ValueError("--out is required (or --merge, --step_bytes)")
    if _DEADLINE_S.value is not None and _WORKERS.value != 1:
      raise ValueError("--deadline_s runs in this process: drop --workers")
    chunks.check_chunk(setup, chunk, backbone, results, workdir)
    chunks.resolve_checkpoints(_CHECKPOINTS.value, workdir, _DEADLINE_S.value)
    # Before any work: an --out it cannot write would lose the chunk's.
    for flag, path in (("--workdir", workdir), ("--out", _OUT.value)):
      if path:
        cli.make_dir(path, flag)
  if _STEP_MEMORY.value:
    return print(*map(chunks.describe_step_bytes,
                      chunks.chunk_step_bytes(setup, chunk)), sep="\n")
  count = workers.resolve_count(_WORKERS.value)
  info = chunks.run_chunk(
      setup, chunk, backbone, results, _OUT.value, _BUDGET.value, workdir,
      _PRESET.value, compute=None if count == 1 else workers.chunk_compute(
          sys.argv, count, backbone), info={"workers": count},
      deadline_s=_DEADLINE_S.value, checkpoints=_CHECKPOINTS.value)
  print(f"{info['cells_computed']} cells, skipped stacks "
        f"{info.get('skipped_stacks')}"
        + (f"; stopped: {info['stopped']}" if "stopped" in info else ""))
  cli.done(t0, archive=os.path.join(_OUT.value, chunks.ARCHIVE))


if __name__ == "__main__":
  app.run(main)
