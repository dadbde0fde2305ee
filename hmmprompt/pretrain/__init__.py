"""Masked-LM pretraining on HMM text, measured against the Bayes optimum.

One role per module:

* :mod:`~hmmprompt.pretrain.config`: :class:`PretrainConfig` and the named
  presets (``tiny``, ``cpu``, ``cpu_capped``, ``cpu_adamw``, ``paper``),
  :func:`configure`;
* :mod:`~hmmprompt.pretrain.job`: :class:`Job`, K draws of one HMM
  family and their recipe (``experiments/pretrain.py``'s config tree);
* :mod:`~hmmprompt.pretrain.train`: :class:`TrainState`, AdamW (or Muon) with
  learning-rate cycles, the loss and the jitted data-parallel step of K
  models (one model: K = 1), :func:`step_bytes` (its XLA buffer sizes,
  compiled on shapes only);
* :mod:`~hmmprompt.pretrain.evaluation`: held-out CE against the exact Bayes
  conditionals;
* :mod:`~hmmprompt.pretrain.workdir`: the run directory (its layout
  version), :func:`load_trials`, :func:`load_backbone` and
  :func:`load_retained` (the checkpoints of :attr:`PretrainConfig.retain`,
  stacked ``[Q, K]``);
* :mod:`~hmmprompt.pretrain.loop`: :func:`run_trials`, the one loop (K
  models of one config, one per HMM draw, in one jitted step; resumable
  from the newest readable checkpoint; each stops on its own at a target
  gap), :func:`run`, one model as a stack of one, and
  :func:`evaluate_checkpoints` (retained checkpoints on the loop's
  validation sets);
* :mod:`~hmmprompt.pretrain.curves`: TensorBoard event files, one run per
  trial (optional: the ``tensorboard`` extra).
"""

from hmmprompt.pretrain.config import PRESETS
from hmmprompt.pretrain.config import PretrainConfig
from hmmprompt.pretrain.config import configure
from hmmprompt.pretrain.config import preset_config
from hmmprompt.pretrain.config import resolve_dtype
from hmmprompt.pretrain.job import Job
from hmmprompt.pretrain.evaluation import ValidationSet
from hmmprompt.pretrain.evaluation import evaluate
from hmmprompt.pretrain.evaluation import validation_set
from hmmprompt.pretrain.loop import DeadlineReached
from hmmprompt.pretrain.loop import Keys
from hmmprompt.pretrain.loop import evaluate_checkpoints
from hmmprompt.pretrain.loop import run
from hmmprompt.pretrain.loop import run_trials
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
