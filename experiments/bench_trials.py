r"""Stacked pretraining steps: K trials in one jitted step, per trial-step.

  python -m experiments.bench_trials [--preset=cpu_capped] [--trials=3] \
      [--steps=40] [--batch_size=64] [--trials_per_vmap=0,1,4] \
      [--profile_dir=/tmp/prof]

Times one model's train step (the baseline, measured in the same run), then
K stacked models (own HMMs, states and batches) stepped by
``make_stacked_train_step`` at each ``trials_per_vmap`` asked for (0: one
vmap over all K trials; 1: one trial after another inside the jitted step;
m: vmaps of m), and prints milliseconds per trial-step and the ratio to the
single model, and on a known GPU (or with ``--peak_tflops``) the MFU by
``transformer.train_flops_per_token``.
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
from hmmprompt.backbones import transformer

from experiments import mfu

_PRESET = flags.DEFINE_enum("preset", "cpu_capped", list(pretrain.PRESETS),
                            "pretraining preset (its model and batch)")
_TRIALS = flags.DEFINE_integer("trials", 3, "K stacked trials")
_STEPS = flags.DEFINE_integer("steps", 40, "timed steps (after 5 warm-up)")
_STATES = flags.DEFINE_integer("num_states", 12, "|H| of the HMMs")
_BATCH = flags.DEFINE_integer("batch_size", None, "per-trial batch (default: "
                              "the preset's)", lower_bound=1)
_PER_VMAP = flags.DEFINE_list("trials_per_vmap", ["0", "1"],
                              "stacked settings timed (0: all K in one vmap)")
_PEAK = flags.DEFINE_float("peak_tflops", None,
                           "device peak for MFU (default: known GPUs)")
_PROFILE = flags.DEFINE_string(
    "profile_dir", None, "trace 5 steps of the last setting here and print "
    "the top ops by device time")


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
  try:
    per_vmap = [int(m) for m in _PER_VMAP.value]
  except ValueError as e:
    raise app.UsageError(f"--trials_per_vmap takes ints: {e}") from None
  base = pretrain.configure(_PRESET.value)
  # Batches are drawn fresh whatever the preset's corpus: the step's cost
  # does not depend on where its tokens come from (a fixed corpus, the
  # paper's, would need each trial's chunks built first).
  cfg = base.with_overrides(
      corpus=dataclasses.replace(base.corpus, fresh=True),
      steps=base.total_steps, batch_size=_BATCH.value or base.batch_size)
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
  flops = transformer.train_flops_per_token(
      cfg.model, cfg.corpus.chunk_len) * cfg.batch_size * cfg.corpus.chunk_len
  peak = mfu.peak_tflops(cfg.model.dtype, _PEAK.value)
  print(f"{_PRESET.value}, |H| {_STATES.value}, B {cfg.batch_size}, T "
        f"{cfg.corpus.chunk_len}, {cfg.model.dtype}, {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}); {flops / 1e9:.2f} GFLOP per "
        f"trial-step")
  print(f"single model            {single * 1e3:7.2f} ms/step (baseline; "
        f"{mfu.describe(flops, single, peak)})")
  for m in per_vmap:
    name = {0: "one vmap", 1: "one trial at a time"}.get(m, f"vmaps of {m}")
    c = dataclasses.replace(cfg, trials_per_vmap=m)
    t = _time(pretrain.make_train_step(c, mesh),
              lambda s: batch(keys, s, stacked),
              pretrain.init_states(keys, c), hmms, _STEPS.value)
    print(f"{k} trials, {name:20s}{t * 1e3 / k:7.2f} ms per trial-step "
          f"({t / k / single:.2f}x the single model; "
          f"{mfu.describe(flops * k, t, peak)})")
  if _PROFILE.value and per_vmap:
    step_fn = pretrain.make_train_step(c, mesh)
    state = pretrain.init_states(keys, c)
    state, loss = step_fn(state, *batch(keys, 0, stacked), hmms)  # compile
    jax.block_until_ready(loss)
    with jax.profiler.trace(_PROFILE.value, create_perfetto_trace=True):
      for s in range(1, 6):
        state, loss = step_fn(state, *batch(keys, s, stacked), hmms)
      jax.block_until_ready(loss)
    print(f"top ops over 5 steps of {k} trials, {name} (ms, share):")
    for op, ms, share in mfu.top_ops(_PROFILE.value):
      print(f"  {ms:9.2f} {100 * share:5.1f}%  {op[:100]}")

if __name__ == "__main__":
  app.run(main)
