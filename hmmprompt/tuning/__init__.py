"""Head tuning and prompt tuning on a frozen backbone (paper Sections 2-5).

The tunable parameters are a pytree ``{"head": ...}`` (head tuning),
``{"prompt": [P, D], "head": ...}`` (prompt tuning) or ``{"backbone": ...,
"head": ...}`` (full fine-tuning, the paper's point of comparison; only for
backbones with ``finetunable`` set), updated by optax. The frozen backbone's
params are an argument of every function here and are never differentiated:
``jax.value_and_grad`` is taken with respect to the tunable pytree only
(fine-tuning starts its own copy from them).

Head tuning computes the frozen backbone's outputs once per example (no
prompt) and trains on those cached features. Prompt tuning runs the backbone
on ``(prompt, MASK, x_1, ...)`` at every step; the linear head reads the
output at the ``MASK`` position (:func:`hmmprompt.tasks.mask_index`).

Training is the paper's recipe (mini-batch Adam) by default. With the
backbone frozen, a head on cached features is a fixed model of fixed inputs
(the linear head: logistic regression, convex), so head tuning can also be
solved: ``TuneConfig(optimizer="lbfgs")`` runs full-batch L-BFGS on a
slightly L2-regularised objective to its optimum (:data:`OPTIMIZERS`).

One role per module:

* :mod:`~hmmprompt.tuning.config`: :class:`TuneConfig`, the methods it
  names (:class:`Method` objects in :data:`METHODS`; heads are
  :class:`hmmprompt.heads.Head` objects in :data:`hmmprompt.heads.HEADS`,
  and the loop only uses both interfaces, so a new one is one object and
  one registry entry) and one seed's arrays (:class:`Data`);
* :mod:`~hmmprompt.tuning.loop`: :func:`run_seed`, one seed end to end (pure,
  traceable, vmappable), and :func:`tune`, the host driver: one jitted
  program over any number of leading lane axes (seeds, tasks, trials), each
  lane getting what it gets alone (tested). :func:`tune_many` (``[S]``
  seeds) and :func:`tune_trials` (``[K, S]`` trials x tasks) stack lists
  for it.
"""

from hmmprompt.tuning.config import METHODS
from hmmprompt.tuning.config import OPTIMIZERS
from hmmprompt.tuning.config import SPLITS
from hmmprompt.tuning.config import Data
from hmmprompt.tuning.config import Method
from hmmprompt.tuning.config import TuneConfig
from hmmprompt.tuning.config import backbone_head_inputs
from hmmprompt.tuning.config import data_from_task
from hmmprompt.tuning.config import num_steps
from hmmprompt.tuning.loop import Result
from hmmprompt.tuning.loop import init_tunable
from hmmprompt.tuning.loop import run_seed
from hmmprompt.tuning.loop import stack_data
from hmmprompt.tuning.loop import tune
from hmmprompt.tuning.loop import lane_group_for
from hmmprompt.tuning.loop import tune_many
from hmmprompt.tuning.loop import tune_trials
from hmmprompt.tuning.optim import tuning_lr
from hmmprompt.tuning.optim import tuning_optimizer

