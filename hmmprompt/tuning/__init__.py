"""Tuning on a frozen backbone (paper Sections 2-5): ``{"head": ...}`` and a
method's extras (:data:`METHODS`: a soft prompt, a prefix, LoRA or a backbone
copy), trained by optax (:data:`OPTIMIZERS`). :mod:`~hmmprompt.tuning.config`
says what a run is, :mod:`~hmmprompt.tuning.loop` runs it (:func:`tune`)."""

from hmmprompt.tuning.config import (METHODS, OPTIMIZERS, SPLITS, Data, Method,
                                     TuneConfig, backbone_head_inputs,
                                     data_from_task, num_steps)
from hmmprompt.tuning.loop import (Result, init_tunable, lane_group_for,
                                   num_trainable, run_seed, stack_data, tune,
                                   tune_many, tune_trials)
from hmmprompt.tuning.optim import tuning_lr, tuning_optimizer

