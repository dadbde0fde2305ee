"""Masked-LM pretraining on HMM text against the Bayes optimum: presets
(:class:`PretrainConfig`), :func:`run_trials`, :func:`load_trials`."""

from hmmprompt.pretrain.config import (PRESETS, PretrainConfig, configure,
                                       preset_config, resolve_dtype)
from hmmprompt.pretrain.job import Job
from hmmprompt.pretrain.evaluation import (
    ValidationSet, evaluate, evaluate_checkpoints, validation_set)
from hmmprompt.pretrain.loop import (
    CHECKPOINTS, DeadlineReached, Keys, check_checkpoints,
    run, run_trials, running_at_checkpoint, train_trials)
from hmmprompt.pretrain.train import (TrainState, init_states, lr_schedule,
                                      make_optimizer, make_train_step, mlm_loss,
                                      step_bytes)
from hmmprompt.pretrain.workdir import (TrialInfo, load_backbone, load_retained,
                                        load_trials)
