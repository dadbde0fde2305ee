r"""Figure 3 of the paper: head vs prompt tuning, memory vs vanilla HMMs.

  python -m experiments.figure3 --backbone=exact,transformer --preset=cpu \
      --workdir=DIR [--panel=left|right|both] [--config.trials=N] \
      [--config.right_trials=N] [--config.tasks_per_hmm=N] \
      [--config.left_sizes=4,8] [--config.finetune=true] \
      [--config.pretrain.lr=3e-3] [--num_tasks=N --task_index=I] \
      [--pretrain_only]

Left panel: vanilla HMMs with |H| in ``left_sizes`` and |X| = 10; head
tuning vs prompt tuning, both with a linear head at the MASK position (and,
with ``finetune``, full fine-tuning of the transformer). Right panel:
single-cell memory HMMs (|H| = 4, |M| in ``memory_sizes``) with an attention
head, vs vanilla HMMs with |M||H| states and a linear head (head tuning).
Every arm runs with each of ``features``.

Trials, as the paper runs them: every trial is a new HMM draw of the size,
its own pretrained backbone and its own task(s); the report's mean and
interval are over trials. The trials of a size form one stack (a leading
axis on every array): drawn, pretrained and tuned as one vmapped program.
``tasks_per_hmm > 1`` adds tasks on each HMM, to separate task noise from
HMM noise.

Backbones: ``exact`` is perfect pretraining (Appendix B's message passing);
``transformer`` is the masked LM of :mod:`hmmprompt.pretrain`, pretrained
once per HMM (a stacked run per size, :func:`pretrain.run_trials`) under
DIR/pretrain/<model>-<config hash>/ (reused when present, resumed when
interrupted) and then frozen.

One module per role:

* :mod:`.configs`: the config tree :class:`Setup`, presets (``tiny``,
  ``cpu``, ``paper``) and :func:`get_setup`, the one way in;
* :mod:`.sweep`: the plan (groups by model), stacks of trials, random
  streams, :func:`run`;
* :mod:`.records`: :class:`ResultLine`, the declared schema of a result
  line (written, keyed, read and plotted through it);
* :mod:`.reporting`: table, plot, pretraining table;
* ``__main__``: the thin absl binary.

Outputs, all written atomically; a rerun skips finished lines:
  DIR/sweep.json      the trial counts (a rerun with others is refused)
  DIR/results.jsonl   one ResultLine per (backbone, panel, hmm, num_states,
                      memory_size, trial, task, method, features, setup)
  DIR/figure3.png     mean and 95% t-interval over trials, both backbones
  DIR/figure3.md      the same beside the paper's reference numbers, the
                      variance components, a per-trial table (HMM
                      fingerprint, pretraining gap, accuracies) and every
                      pretrained trial's CE gap and time
"""

from experiments.figure3.configs import PRESETS
from experiments.figure3.configs import Setup
from experiments.figure3.configs import get_setup
from experiments.figure3.records import ResultLine
from experiments.figure3.records import read_results
from experiments.figure3.records import results_path
from experiments.figure3.reporting import mean_ci
from experiments.figure3.reporting import pretraining_table
from experiments.figure3.reporting import report
from experiments.figure3.sweep import BACKBONES
from experiments.figure3.sweep import run
