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
keep, eval_batch, trials_per_vmap, retain) may change between runs.

``--config.trials=K`` draws K HMMs (trial k from ``fold_in(PRNGKey(hmm_seed),
k)``) and pretrains K transformers in one stacked run
(:func:`hmmprompt.pretrain.run_trials`; one model is a stack of one).

Several processes (hosts), one model data-parallel over all their devices:
``--distributed`` calls ``jax.distributed.initialize``, which finds the
coordinator, process count and index itself under SLURM (``srun``), Open
MPI and on TPU VMs; elsewhere pass them, e.g. two processes on one machine
(CPU collectives: gloo):

  python -m experiments.pretrain --preset=tiny --workdir=DIR --distributed \
      --coordinator_address=127.0.0.1:12345 --num_processes=2 --process_id=I

Every process runs the same command (I = 0, 1) on a shared DIR; process 0
writes the files, orbax writes each checkpoint once (docs/multihost.md).

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
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "data-parallel over several processes (hosts): "
    "call jax.distributed.initialize(), which finds the three settings "
    "below on SLURM, Open MPI and TPU VMs")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "--distributed: HOST:PORT of process 0's "
    "coordinator (default: auto-detected, or $JAX_COORDINATOR_ADDRESS); "
    "127.0.0.1:PORT runs several processes on one machine")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "--distributed: how many processes (default: "
    "auto-detected)")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "--distributed: this process's index in [0, "
    "num_processes) (default: auto-detected)")


def _initialize_distributed() -> None:
  """``jax.distributed.initialize`` with the flags that are set (the rest
  auto-detected); before any JAX computation."""
  given = {"coordinator_address": _COORDINATOR.value,
           "num_processes": _NUM_PROCESSES.value,
           "process_id": _PROCESS_ID.value}
  given = {k: v for k, v in given.items() if v is not None}
  if not _DISTRIBUTED.value:
    if given:
      raise app.UsageError(f"--{', --'.join(given)} need --distributed")
    return
  try:
    jax.distributed.initialize(**given)
  except ValueError as e:  # bad values, or nothing detected to fill in
    hint = ("" if len(given) == 3 else " (no SLURM, Open MPI or TPU "
            "environment was detected to fill in the rest: pass "
            "--coordinator_address, --num_processes and --process_id)")
    raise app.UsageError(f"--distributed: {e}{hint}") from e


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  host_memory.retain_freed_memory()  # XLA:CPU step temporaries
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  _initialize_distributed()
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
  logging.info("process %d of %d; devices: %s; %d params; %d steps",
               jax.process_index(), jax.process_count(), jax.devices(),
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
