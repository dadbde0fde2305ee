"""Head tuning and prompt tuning on a frozen backbone, and fine-tuning of a copy
of it (paper Sections 2-5): a tunable pytree, ``{"head": ...}``, ``{"prompt":
[P, D], "head": ...}`` or ``{"backbone": ..., "head": ...}`` (:data:`METHODS`),
trained by optax (:data:`OPTIMIZERS`); the frozen backbone's params are never
differentiated. :mod:`~hmmprompt.tuning.config` says what a run is,
:mod:`~hmmprompt.tuning.loop` runs it (:func:`run_seed`, :func:`tune`)."""

from hmmprompt.tuning.config import (METHODS, OPTIMIZERS, SPLITS, Data, Method,
                                     TuneConfig, backbone_head_inputs,
                                     data_from_task, num_steps)
from hmmprompt.tuning.loop import (Result, init_tunable, lane_group_for,
                                   num_trainable, run_seed, stack_data, tune,
                                   tune_many, tune_trials)
from hmmprompt.tuning.optim import tuning_lr, tuning_optimizer

