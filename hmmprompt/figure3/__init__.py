r"""Figure 3 of the paper: head vs prompt tuning, memory vs vanilla HMMs
(docs/figure3.md). The binary:

```
python -m experiments.figure3 --backbone=exact,transformer --preset=cpu \
    --workdir=DIR [--panel=left|right|both] [--config.trials=N] \
    [--config.left_sizes=4,8] [--config.pretrain.lr=3e-3] \
    [--num_tasks=N --task_index=I] [--workers=N] [--pretrain_only]
```

Left panel: vanilla HMMs, head vs prompt tuning with a linear head at the
MASK. Right panel: memory HMMs with an attention head vs vanilla HMMs of
``|M||H|`` states with a linear head. Every trial is a new HMM draw with
its own backbone and tasks (the paper's protocol); a size's trials are one
stack, drawn, pretrained and tuned as one vmapped program
(:mod:`hmmprompt.protocol`).

* :mod:`.configs`: the config tree :class:`Setup` and its presets;
* :mod:`.sweep`: the plan, the stacks, :func:`run_sweep`;
* :mod:`.records`: :class:`ResultLine`, the declared schema of a line;
* :mod:`.reporting`: tables and plots; :mod:`.chunks`: the sweep in
  chunks for a lent machine (``experiments/in_chunks.py``);
* :mod:`.workers`: ``--workers``, one process per core on one machine.

The binaries are thin absl mains under ``experiments/``: ``figure3``
(this sweep), ``in_chunks`` (its chunks) and ``hard_set``.

Outputs, all written atomically; a rerun skips finished lines:
DIR/sweep.json (the setup's identity: a run of another setup is refused,
what differs named), DIR/results.jsonl, DIR/figure3.png, DIR/figure3.md
(beside the paper's numbers, variance components, a per-trial table and
every pretrained trial's CE gap) and DIR/pretrain/ (the transformers).
"""

from hmmprompt.figure3.configs import PRESETS
from hmmprompt.figure3.configs import Setup
from hmmprompt.figure3.configs import get_setup
from hmmprompt.figure3.schema import ResultLine
from hmmprompt.figure3.schema import read_results
from hmmprompt.figure3.schema import results_path
from hmmprompt.figure3.reporting import mean_ci
from hmmprompt.figure3.reporting import write_figure3_report
from hmmprompt.figure3.sweep import BACKBONES
from hmmprompt.figure3.sweep import run_sweep
