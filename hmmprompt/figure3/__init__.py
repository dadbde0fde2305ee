"""Figure 3 of the paper: head vs prompt tuning, memory vs vanilla HMMs
(docs/figure3.md; the binaries ``python -m experiments.figure3`` and
``experiments/in_chunks.py``). Every trial is a new HMM draw with its own
backbone and tasks; a size's trials are one stack (:mod:`hmmprompt.protocol`).
A workdir holds, each written atomically (a rerun skips finished lines),
DIR/sweep.json (the setup's identity), DIR/results.jsonl
(:class:`ResultLine`), DIR/figure3.{md,png} and DIR/pretrain/."""

from hmmprompt.figure3.configs import PRESETS, Setup, get_setup
from hmmprompt.figure3.schema import ResultLine, read_results, results_path
from hmmprompt.figure3.reporting import mean_ci, write_figure3_report
from hmmprompt.figure3.sweep import BACKBONES, run_sweep
