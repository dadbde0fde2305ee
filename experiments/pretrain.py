r"""Pretrain the masked LM on text from an HMM.

  python -m experiments.pretrain --preset=tiny|cpu|cpu_capped|paper \
      --workdir=DIR [--config.model_kind=memory --config.memory_size=3] \
      [--config.num_states=10] [--config.hmm_seed=0] [--config.trials=K] \
      [--config.pretrain.lr=3e-3 --config.pretrain.model.num_heads=4 ...]

One config tree (:class:`Job`): the generating HMM's fields and the
``pretrain`` subtree (:class:`hmmprompt.pretrain.PretrainConfig`); every
leaf is a ``--config.<path>`` flag (``--helpfull`` lists them), unknown
keys are refused by name.

Writes DIR/config.json, DIR/hmm.npz, orbax checkpoints under
DIR/checkpoints/ and DIR/metrics.jsonl (trial, step, mlm_ce, bayes_ce, tv,
...). Rerunning the same command resumes from the newest readable
checkpoint (an unreadable one, e.g. a partial copy, is reported and set
aside in DIR/checkpoints.damaged/); runtime fields (log_every, ckpt_every,
keep, eval_batch, trials_per_vmap) may change between runs.

``--config.trials=K`` draws K HMMs (trial k from ``fold_in(PRNGKey(hmm_seed),
k)``) and pretrains K transformers in one stacked run
(:func:`hmmprompt.pretrain.run_trials`; one model is a stack of one).

Presets (hmmprompt/pretrain/config.py states their numbers):
  tiny        seconds; tests and smoke runs.
  cpu         a 2-core machine: 2 layers, width 64, 4 heads, context 80,
              batch 64, exact-conditional targets, lr 3e-3 in cycles up to
              31000 steps, until within 0.04 nats of the Bayes CE at the
              end of a cycle.
  cpu_capped  the main job's: cpu at batch 32, lr 5e-3, MASK-only
              corruption, cycles 500/500/1000 (at most 2000 steps).

--config.pretrain.targets=sampled|exact picks the loss's targets (the true
token, or its exact conditional given the corrupted input);
--config.pretrain.corpus.corruption=bert|mask the corruption.
  paper       Appendix D: BERT-base width, 6 layers, context 512, the fixed
              5000 x 10240-token corpus, 5% masking, batch 8, lr 1e-5, 3
              epochs; bf16 compute on accelerators.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

from absl import app
from absl import flags
from absl import logging
import jax

from hmmprompt import config_flags
from hmmprompt import host_memory
from hmmprompt import models
from hmmprompt import pretrain
from hmmprompt.pretrain import workdir as workdir_lib
from hmmprompt.backbones import transformer


@dataclasses.dataclass(frozen=True)
class Job:
  """The generating HMM and the pretraining recipe (the vocabulary is
  ``pretrain.model.vocab_size``)."""

  pretrain: pretrain.PretrainConfig
  model_kind: str = "vanilla"
  num_states: int = 10
  memory_size: int = 3
  hmm_seed: int = 0
  trials: int = 1

  def __post_init__(self):
    if self.model_kind not in models.KINDS:
      raise ValueError(f"model_kind must be one of {models.KINDS}, got "
                       f"{self.model_kind!r}")
    if not isinstance(self.trials, int) or self.trials < 1:
      raise ValueError(f"trials must be an int >= 1, got {self.trials!r}")

  def make_model(self) -> models.Model:
    """``[trials]`` stacked draws (one: ``random_model(PRNGKey(hmm_seed))``,
    stacked)."""
    key = jax.random.PRNGKey(self.hmm_seed)
    args = (self.model_kind, self.num_states, self.pretrain.model.vocab_size,
            self.memory_size)
    if self.trials > 1:
      return models.random_models(key, self.trials, *args)
    return models.stack([models.random_model(key, *args)])


def get_config(preset: str = "cpu", **overrides) -> Job:
  """The preset's job with ``{"a.b": value}`` overrides (strings parsed)."""
  job = Job(pretrain=pretrain.configure(preset))
  return config_flags.apply(job, overrides)


_PRESET = flags.DEFINE_enum("preset", "cpu", list(pretrain.PRESETS),
                            "pretraining preset")
_CONFIG = config_flags.define(Job(pretrain=pretrain.preset_config("cpu")))
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_CRASH_AT = flags.DEFINE_integer(
    "crash_at_step", None, "testing: SIGKILL this process after this step "
    "(checks that a rerun resumes exactly)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "call jax.distributed.initialize() "
                                 "(multi-host)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  host_memory.retain_freed_memory()  # XLA:CPU step temporaries
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  # Usage errors (flags, config, a workdir holding another run) are found
  # here, before any work; whatever fails later is a real error and keeps
  # its traceback.
  try:
    job = get_config(_PRESET.value, **_CONFIG.value())
    models_K = job.make_model()
    workdir_lib.prepare(_WORKDIR.value, job.pretrain, models_K)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  cfg = job.pretrain
  logging.info("devices: %s; %d params; %d steps", jax.devices(),
               transformer.num_params(transformer.init_params(
                   jax.random.PRNGKey(0), cfg.model)), cfg.total_steps)
  t0 = time.perf_counter()

  def after_step(step):
    if _CRASH_AT.value is not None and step >= _CRASH_AT.value:
      os.kill(os.getpid(), signal.SIGKILL)

  final = pretrain.run_trials(_WORKDIR.value, cfg, models_K,
                              log=logging.info, after_step=after_step)
  print(f"done in {time.perf_counter() - t0:.0f}s: "
        f"{final[0] if len(final) == 1 else final}")

if __name__ == "__main__":
  app.run(main)
