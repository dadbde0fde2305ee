"""Masked-LM pretraining on HMM text, measured against the Bayes optimum:
:class:`PretrainConfig` and its presets, :func:`run_trials` (K models in
one jitted step), :func:`load_trials` of a finished run."""

from hmmprompt.pretrain.config import PRESETS
from hmmprompt.pretrain.config import PretrainConfig
from hmmprompt.pretrain.config import configure
from hmmprompt.pretrain.config import preset_config
from hmmprompt.pretrain.config import resolve_dtype
from hmmprompt.pretrain.job import Job
from hmmprompt.pretrain.evaluation import ValidationSet
from hmmprompt.pretrain.evaluation import evaluate
from hmmprompt.pretrain.evaluation import validation_set
from hmmprompt.pretrain.loop import CHECKPOINTS
from hmmprompt.pretrain.loop import DeadlineReached
from hmmprompt.pretrain.loop import Keys
from hmmprompt.pretrain.loop import check_checkpoints
from hmmprompt.pretrain.loop import evaluate_checkpoints
from hmmprompt.pretrain.loop import run
from hmmprompt.pretrain.loop import run_trials
from hmmprompt.pretrain.loop import running_at_checkpoint
from hmmprompt.pretrain.loop import train_trials
from hmmprompt.pretrain.train import TrainState
from hmmprompt.pretrain.train import init_states
from hmmprompt.pretrain.train import lr_schedule
from hmmprompt.pretrain.train import make_optimizer
from hmmprompt.pretrain.train import make_train_step
from hmmprompt.pretrain.train import mlm_loss
from hmmprompt.pretrain.train import step_bytes
from hmmprompt.pretrain.workdir import TrialInfo
from hmmprompt.pretrain.workdir import load_backbone
from hmmprompt.pretrain.workdir import load_retained
from hmmprompt.pretrain.workdir import load_trials
