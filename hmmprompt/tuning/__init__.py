"""Head tuning and prompt tuning on a frozen backbone, and fine-tuning of
a copy of it (paper Sections 2-5): a tunable pytree, ``{"head": ...}``,
``{"prompt": [P, D], "head": ...}`` or ``{"backbone": ..., "head": ...}``
(:data:`METHODS`), trained by optax (:data:`OPTIMIZERS`); the frozen
backbone's params are never differentiated.
:mod:`~hmmprompt.tuning.config` says what a run is,
:mod:`~hmmprompt.tuning.loop` runs it (:func:`run_seed`, :func:`tune`)."""

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

