r"""Stacked pretraining steps: K trials in one jitted step, per trial-step.

  python -m experiments.bench_trials [--preset=cpu_capped] [--trials=3] \
      [--steps=40]

Times one model's train step (the baseline, measured in the same run), then
K stacked models (own HMMs, states and batches) stepped by
``make_stacked_train_step`` with ``trials_per_vmap`` = 0 (one vmap over the
trials) and 1 (one trial after another inside the jitted step), and prints
milliseconds per trial-step and the ratio to the single model.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app
from absl import flags
import jax

from hmmprompt import corpus
from hmmprompt import glibc
from hmmprompt import generative
from hmmprompt import pretrain
from hmmprompt import sharding

_PRESET = flags.DEFINE_enum("preset", "cpu_capped", list(pretrain.PRESETS),
                            "pretraining preset (its model and batch)")
_TRIALS = flags.DEFINE_integer("trials", 3, "K stacked trials")
_STEPS = flags.DEFINE_integer("steps", 40, "timed steps (after 5 warm-up)")
_STATES = flags.DEFINE_integer("num_states", 12, "|H| of the HMMs")


def _time(step_fn, batch_fn, state, hmm, steps):
  for s in range(5):  # compile and warm up
    state, loss = step_fn(state, *batch_fn(s), hmm)
  jax.block_until_ready(loss)
  t0 = time.perf_counter()
  for s in range(steps):
    state, loss = step_fn(state, *batch_fn(s), hmm)
  jax.block_until_ready(loss)
  return (time.perf_counter() - t0) / steps


def main(argv):
  del argv
  glibc.retain_freed_memory()
  # Batches are drawn fresh whatever the preset's corpus: the step's cost
  # does not depend on where its tokens come from (a fixed corpus, the
  # paper's, would need each trial's chunks built first).
  base = pretrain.configure(_PRESET.value)
  cfg = base.with_overrides(
      corpus=dataclasses.replace(base.corpus, fresh=True),
      steps=base.total_steps)
  k, mesh = _TRIALS.value, sharding.data_mesh()
  stacked = generative.random_models(jax.random.PRNGKey(0), k, "vanilla",
                                 _STATES.value, cfg.model.vocab_size)
  hmms = jax.vmap(generative.as_hmm)(stacked)
  keys = jax.random.split(jax.random.PRNGKey(1), k)
  batch = jax.jit(jax.vmap(
      lambda key, s, m: corpus.batch_at(key, s, m, None, cfg.corpus,
                                        cfg.batch_size, cfg.model.vocab_size),
      in_axes=(0, None, 0)))
  # The baseline: one model, a stack of one (the unbatched body).
  take1 = lambda tree: jax.tree.map(lambda x: x[:1], tree)
  single = _time(pretrain.make_train_step(cfg, mesh),
                 lambda s: take1(batch(keys, s, stacked)),
                 pretrain.init_states(keys[:1], cfg), take1(hmms),
                 _STEPS.value)
  print(f"{_PRESET.value}, |H| {_STATES.value}, B {cfg.batch_size}, T "
        f"{cfg.corpus.chunk_len}, {jax.default_backend()}")
  print(f"single model            {single * 1e3:7.1f} ms/step (baseline)")
  for per_vmap, name in ((0, "one vmap"), (1, "one trial at a time")):
    c = dataclasses.replace(cfg, trials_per_vmap=per_vmap)
    t = _time(pretrain.make_train_step(c, mesh),
              lambda s: batch(keys, s, stacked),
              pretrain.init_states(keys, c), hmms, _STEPS.value)
    print(f"{k} trials, {name:20s}{t * 1e3 / k:7.1f} ms per trial-step "
          f"({t / k / single:.2f}x the single model)")

if __name__ == "__main__":
  app.run(main)
