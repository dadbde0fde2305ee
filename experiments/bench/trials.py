r"""Stacked pretraining steps, per trial-step: one model's step (the
baseline), then K stacked models (own HMMs, states and batches) at each
``--trials_per_vmap`` (docs/performance.md).

  python -m experiments.bench.trials [--preset=cpu_capped] [--trials=3] \
      [--steps=40] [--batch_size=64] [--trials_per_vmap=0,1,4] \
      [--profile_dir=/tmp/prof]
"""

import dataclasses

from absl import app
from absl import flags
import jax

from hmmprompt import corpus
from hmmprompt import generative
from hmmprompt import pretrain
from hmmprompt import sharding
from hmmprompt.backbones import transformer
from experiments.bench import harness

_PRESET = flags.DEFINE_enum("preset", "cpu_capped", list(pretrain.PRESETS),
                            "pretraining preset (its model and batch)")
_TRIALS = flags.DEFINE_integer("trials", 3, "K stacked trials")
_STEPS = flags.DEFINE_integer("steps", 40, "timed steps (after 5 warm-up)")
_STATES = flags.DEFINE_integer("num_states", 12, "|H| of the HMMs")
_BATCH = flags.DEFINE_integer("batch_size", None, "per-trial batch "
                              "(default: the preset's)", lower_bound=1)
_PER_VMAP = flags.DEFINE_list("trials_per_vmap", ["0", "1"], "settings timed "
                              "(0: all K in one vmap)")
_PEAK = flags.DEFINE_float("peak_tflops", None, "MFU's peak (default: GPUs')")
_PROFILE = flags.DEFINE_string("profile_dir", None, "trace 5 steps of the "
                               "last setting here; print the top ops")


def main(argv):
  harness.start(argv)
  try:
    per_vmap = [int(m) for m in _PER_VMAP.value]
  except ValueError as e:
    raise app.UsageError(f"--trials_per_vmap takes ints: {e}") from None
  base = pretrain.configure(_PRESET.value)
  # Fresh batches whatever the preset's corpus: the same cost, no chunks.
  cfg = base.with_overrides(
      corpus=dataclasses.replace(base.corpus, fresh=True),
      steps=base.total_steps, batch_size=_BATCH.value or base.batch_size)
  k, mesh, t = _TRIALS.value, sharding.data_mesh(), cfg.corpus.chunk_len
  stacked = generative.random_models(jax.random.PRNGKey(0), k, "vanilla",
                                     _STATES.value, cfg.model.vocab_size)
  hmms = jax.vmap(generative.as_hmm)(stacked)
  keys = jax.random.split(jax.random.PRNGKey(1), k)
  batch = jax.jit(jax.vmap(lambda key, s, m: corpus.batch_at(key, s, m, None,
      cfg.corpus, cfg.batch_size, cfg.model.vocab_size), in_axes=(0, None, 0)))
  # The baseline: one model, a stack of one (the unbatched body).
  take1 = lambda tree: jax.tree.map(lambda x: x[:1], tree)
  time = lambda one: harness.seconds_per_call(one, steps=_STEPS.value, warmup=5)
  single = time(harness.train_steps(
      pretrain.make_train_step(cfg, mesh),
      lambda s: take1(batch(keys, s, stacked)),
      pretrain.init_states(keys[:1], cfg), take1(hmms)))
  stacked_steps = lambda c: harness.train_steps(  # the K trials' under ``c``
      pretrain.make_train_step(c, mesh), lambda s: batch(keys, s, stacked),
      pretrain.init_states(keys, c), hmms)
  flops = transformer.train_flops_per_token(cfg.model, t) * cfg.batch_size * t
  peak = harness.peak_tflops(cfg.model.dtype, _PEAK.value)
  print(f"{_PRESET.value}, |H| {_STATES.value}, B {cfg.batch_size}, T {t}, "
        f"{cfg.model.dtype}, {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}); {flops / 1e9:.2f} GFLOP per "
        f"trial-step")
  print(f"single model            {single * 1e3:7.2f} ms/step (baseline; "
        f"{harness.describe(flops, single, peak)})")
  for m in per_vmap:
    name = {0: "one vmap", 1: "one trial at a time"}.get(m, f"vmaps of {m}")
    c = dataclasses.replace(cfg, trials_per_vmap=m)
    t = time(stacked_steps(c))
    print(f"{k} trials, {name:20s}{t * 1e3 / k:7.2f} ms per trial-step "
          f"({t / k / single:.2f}x the single model; "
          f"{harness.describe(flops * k, t, peak)})")
  if _PROFILE.value and per_vmap:
    one = stacked_steps(c)
    jax.block_until_ready(one())  # compile
    with jax.profiler.trace(_PROFILE.value, create_perfetto_trace=True):
      jax.block_until_ready([one() for _ in range(5)])
    print(f"top ops over 5 steps of {k} trials, {name} (ms, share):")
    for op, ms, share in harness.top_ops(_PROFILE.value):
      print(f"  {ms:9.2f} {100 * share:5.1f}%  {op[:100]}")


if __name__ == "__main__":
  app.run(main)
