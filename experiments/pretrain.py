r"""Pretrain the masked LM on text from an HMM.

  python -m experiments.pretrain --preset=tiny|cpu|paper --workdir=DIR \
      [--hmm=vanilla|memory] [--num_states=10] [--memory_size=3] \
      [--hmm_seed=0] [--steps=N] [--batch_size=B] [--lr=LR] ...

Writes DIR/config.json, DIR/hmm.npz, orbax checkpoints under
DIR/checkpoints/ and DIR/metrics.jsonl (step, mlm_ce, bayes_ce, tv, ...).
Rerunning the same command resumes from the latest checkpoint.

Presets:
  tiny   seconds; tests and smoke runs.
  cpu    for a 2-core machine: a 2-layer, width-64, 4-head model, context
         80, batch 64, 15% masking, lr 3e-3 in cycles of 1000, 2000, 4000,
         8000 and 16000 steps, fresh HMM samples every step, until within
         0.04 nats of the Bayes CE at the end of a cycle (at most 31000
         steps; README: steps, time and Bayes gap per Figure 3 size).
  paper  Appendix D: BERT-base width, 6 layers, context 512, the fixed
         5000 x 10240-token corpus, 5% masking, batch 8, lr 1e-5, 3 epochs,
         500 warmup steps; bf16 compute on accelerators.
"""

from __future__ import annotations

import os
import signal
import time

from absl import app
from absl import flags
from absl import logging
import jax

from hmmprompt import hmm as hmm_lib
from hmmprompt import memory as memory_lib
from hmmprompt import pretrain
from hmmprompt.backbones import transformer


_PRESET = flags.DEFINE_enum("preset", "cpu", ["tiny", "cpu", "paper"],
                            "size preset")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_HMM = flags.DEFINE_enum("hmm", "vanilla", ["vanilla", "memory"],
                         "generating model")
_STATES = flags.DEFINE_integer("num_states", 10, "|H| (syntax states for "
                               "--hmm=memory)")
_MEMORY = flags.DEFINE_integer("memory_size", 3, "|M| for --hmm=memory")
_VOCAB = flags.DEFINE_integer("vocab_size", 10, "|X|")
_HMM_SEED = flags.DEFINE_integer("hmm_seed", 0, "seed of the random HMM")
_SEED = flags.DEFINE_integer("seed", 0, "seed of init, data and masking")
_STEPS = flags.DEFINE_integer("steps", None, "train steps (preset)")
_BATCH = flags.DEFINE_integer("batch_size", None, "global batch (preset)")
_LR = flags.DEFINE_float("lr", None, "peak learning rate (preset)")
_WARMUP = flags.DEFINE_integer("warmup_steps", None, "warmup (preset)")
_D_MODEL = flags.DEFINE_integer("d_model", None, "width (preset)")
_LAYERS = flags.DEFINE_integer("num_layers", None, "layers (preset)")
_HEADS = flags.DEFINE_integer("num_heads", None, "heads (preset)")
_D_FF = flags.DEFINE_integer("d_ff", None, "MLP width (preset)")
_CONTEXT = flags.DEFINE_integer("context", None, "training chunk length = "
                                "model context (preset)")
_MASK = flags.DEFINE_float("mask_rate", None, "masking rate (preset)")
_TARGET_GAP = flags.DEFINE_float(
    "target_gap", None, "stop once the held-out CE is within this many nats "
    "of the Bayes CE (steps becomes a cap)")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                           "compute dtype; auto = bf16 off CPU")
_CRASH_AT = flags.DEFINE_integer(
    "crash_at_step", None, "testing: SIGKILL this process after this step "
    "(checks that a rerun resumes exactly)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "call jax.distributed.initialize() "
                                 "(multi-host)")


def config_from_flags() -> pretrain.PretrainConfig:
  model_kw = {k: f.value for k, f in (("d_model", _D_MODEL),
                                      ("num_layers", _LAYERS),
                                      ("num_heads", _HEADS), ("d_ff", _D_FF))
              if f.value is not None}
  top = {k: f.value for k, f in (("steps", _STEPS), ("batch_size", _BATCH),
                                 ("lr", _LR), ("warmup_steps", _WARMUP),
                                 ("target_gap", _TARGET_GAP))
         if f.value is not None}
  corpus_kw = {} if _MASK.value is None else {"mask_rate": _MASK.value}
  try:
    return pretrain.configure(_PRESET.value, _VOCAB.value,
                              context=_CONTEXT.value, dtype=_DTYPE.value,
                              model=model_kw, corpus=corpus_kw,
                              seed=_SEED.value, **top)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def model_from_flags():
  key = jax.random.PRNGKey(_HMM_SEED.value)
  try:
    if _HMM.value == "memory":
      return memory_lib.random_memory_hmm(key, _MEMORY.value, _STATES.value,
                                          _VOCAB.value)
    return hmm_lib.random_hmm(key, _STATES.value, _VOCAB.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  if _DISTRIBUTED.value:
    jax.distributed.initialize()
  cfg = config_from_flags()
  model = model_from_flags()
  logging.info("devices: %s; %d params; %d steps", jax.devices(),
               transformer.num_params(transformer.init_params(
                   jax.random.PRNGKey(0), cfg.model)), cfg.total_steps)
  t0 = time.perf_counter()

  def after_step(step):
    if _CRASH_AT.value is not None and step >= _CRASH_AT.value:
      os.kill(os.getpid(), signal.SIGKILL)

  try:
    final = pretrain.run(_WORKDIR.value, cfg, model, log=logging.info,
                         after_step=after_step)
  except ValueError as e:  # a workdir holding another run
    raise app.UsageError(str(e)) from e
  print(f"done in {time.perf_counter() - t0:.0f}s: {final}")


if __name__ == "__main__":
  app.run(main)
