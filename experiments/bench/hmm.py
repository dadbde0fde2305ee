r"""Throughput of hmmprompt's HMM sampler and posterior vs hmmlearn / dynamax
(the `bench` extra), each ratio against a baseline of the same run.

  python -m experiments.bench.hmm [--sections=sampling,posterior,long,targets]
"""

import functools
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import hmm as hmm_lib
from experiments.bench import harness

_STATES = flags.DEFINE_integer("num_states", 30, "hidden states |H|")
_VOCAB = flags.DEFINE_integer("vocab_size", 10, "vocabulary |X|")
_SAMPLE_BATCH = flags.DEFINE_integer("sample_batch", 200, "sequences sampled")
_SAMPLE_LEN = flags.DEFINE_integer("sample_len", 10240, "tokens per sequence")
_POST_BATCH = flags.DEFINE_integer("post_batch", 1000, "posterior batch")
_POST_LEN = flags.DEFINE_integer("post_len", 129, "posterior sequence length")
_REPEATS = flags.DEFINE_integer("repeats", 7, "timed repeats (median)")
_LONG_BATCH = flags.DEFINE_integer("long_batch", 8, "long posterior batch")
_LONG_LENS = flags.DEFINE_list("long_lens", ["512", "10240"], "long: the Ts")
_LONG_STATES = flags.DEFINE_list("long_states", ["30", "100"], "long: the |H|s")
_LONG_REPEATS = flags.DEFINE_integer("long_repeats", 3, "long: timed repeats")
_TARGETS_SHAPE = flags.DEFINE_list("targets_shape", ["64", "512", "30"],
                                   "exact targets' B, T, |H| (gpu preset's)")
_TARGETS_WINDOWS = flags.DEFINE_list("targets_windows", ["16"], "steps' "
                                     "targets in one call (exact_window)")
_SECTIONS = flags.DEFINE_list("sections", ["sampling", "posterior", "long",
                                           "targets"], "which to run")
_HMMLEARN_SEQS = flags.DEFINE_integer("hmmlearn_seqs", 5, "hmmlearn's (slow)")

_METHODS = ("sequential", "parallel", "blocked")


def _tokens(model, t: int, b: int, seed: int):
  return jax.vmap(lambda k: hmm_lib.sample(k, model, t)[0])(
      jax.random.split(jax.random.PRNGKey(seed), b))


def _hmmlearn_model(model):
  try:
    from hmmlearn.hmm import CategoricalHMM  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  f64 = lambda a: (a := np.asarray(a, np.float64)) / a.sum(-1, keepdims=True)
  m = CategoricalHMM(n_components=model.num_states, init_params="", params="")
  m.n_features = model.vocab_size
  m.startprob_, m.transmat_, m.emissionprob_ = map(f64, (
      model.initial, model.transition, model.emission))
  return m


def _dynamax_smoothers(model) -> dict:
  """``{name: jit(vmap(smoother))}`` of dynamax's (``{}`` without it), at
  their defaults (``compute_trans_probs`` is traced: it cannot be off)."""
  try:
    from dynamax.hidden_markov_model import hmm_smoother  # pylint: disable=g-import-not-at-top
    from dynamax.hidden_markov_model import parallel_hmm_smoother  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  return {f"dynamax {name}": jax.jit(jax.vmap(
      lambda x, s=s: s(model.initial, model.transition,
                       jnp.log(model.emission.T[x])).smoothed_probs))
          for name, s in (("hmm_smoother", hmm_smoother),
                          ("parallel_hmm_smoother", parallel_hmm_smoother))}


def _report(name, tokens, seconds, baseline=None) -> float:
  """Prints the rate of ``tokens`` in ``seconds`` (a function: timed)."""
  if callable(seconds):
    seconds = harness.seconds_per_call(seconds, _REPEATS.value)
  print(f"  {name:<44s} {tokens / seconds / 1e6:10.3f} M tokens/s" + (
      "" if baseline is None else
      f"   hmmprompt is {seconds / baseline:7.1f}x faster"))
  return seconds


def bench_sampling(model):
  b, t = _SAMPLE_BATCH.value, _SAMPLE_LEN.value
  print(f"Sampling: {b} x {t} tokens, |H|={model.num_states}, "
        f"|X|={model.vocab_size}")
  keys = jax.random.split(jax.random.PRNGKey(0), b)
  ours = jax.jit(jax.vmap(lambda k: hmm_lib.sample(k, model, t)))
  t_ours = _report("hmmprompt jit(vmap(sample))", b * t, lambda: ours(keys))
  try:
    from dynamax.hidden_markov_model import CategoricalHMM  # pylint: disable=g-import-not-at-top
    dyn = CategoricalHMM(model.num_states, 1, model.vocab_size)
    params, _ = dyn.initialize(
        jax.random.PRNGKey(0), emission_probs=model.emission[:, None, :],
        initial_probs=model.initial, transition_matrix=model.transition)
    dyn_fn = jax.jit(jax.vmap(lambda k: dyn.sample(params, k, t)))
    _report("dynamax CategoricalHMM.sample (jit+vmap)", b * t,
            lambda: dyn_fn(keys), t_ours)
  except ImportError:
    print("  dynamax", harness.NO_BENCH)
  if (hl := _hmmlearn_model(model)) is None:
    return print("  hmmlearn", harness.NO_BENCH)
  n, t0 = _HMMLEARN_SEQS.value, time.perf_counter()
  for i in range(n):
    hl.sample(t, random_state=i)
  t_hl = (time.perf_counter() - t0) / n * b  # per b sequences
  _report(f"hmmlearn CategoricalHMM.sample ({n} seqs)", b * t, t_hl, t_ours)


def bench_posterior(model):
  b, t = _POST_BATCH.value, _POST_LEN.value
  print(f"Posterior: {b} x {t} tokens, |H|={model.num_states}")
  tokens = _tokens(model, t, b, 1)
  ours = jax.jit(jax.vmap(hmm_lib.posterior, in_axes=(None, 0)))
  post = ours(model, tokens)
  t_ours = _report("hmmprompt jit(vmap(posterior))", b * t,
                   lambda: ours(model, tokens))
  # As many write it: the HMM closed over, its arrays the jit's constants.
  closed = jax.jit(jax.vmap(lambda x: hmm_lib.posterior(model, x)))
  t_closed = _report("  same, HMM closed over", b * t, lambda: closed(tokens))
  print(f"    closed over / argument time: {t_closed / t_ours:.2f}")
  par = jax.jit(jax.vmap(functools.partial(hmm_lib.posterior,
                                            method="parallel"), (None, 0)))
  err = float(jnp.max(jnp.abs(par(model, tokens) - post)))
  _report("hmmprompt posterior, method=parallel", b * t,
          lambda: par(model, tokens), t_ours)
  print(f"    max |difference| from the scan: {err:.2e}")
  if (dyn := _dynamax_smoothers(model).get("dynamax hmm_smoother")) is None:
    print("  dynamax", harness.NO_BENCH)
  else:
    err = float(jnp.max(jnp.abs(dyn(tokens) - post)))
    _report("dynamax hmm_smoother (jit+vmap)", b * t, lambda: dyn(tokens),
            t_ours)
    print(f"    max |difference| from hmmprompt: {err:.2e}")
  if (hl := _hmmlearn_model(model)) is None:
    return
  t0 = time.perf_counter()
  hl_post = hl.predict_proba(np.asarray(tokens).reshape(-1, 1), [t] * b)
  _report("hmmlearn predict_proba", b * t, time.perf_counter() - t0, t_ours)
  err = float(np.max(np.abs(hl_post.reshape(b, t, -1) - np.asarray(post))))
  print(f"    max |difference| from hmmprompt: {err:.2e}")


def bench_long(base):
  """Our kernels and dynamax's two smoothers per (T, |H|), |X| as base's."""
  b, vocab_size = _LONG_BATCH.value, base.vocab_size
  if not _dynamax_smoothers(None):  # (the model is only read in a call)
    print("  dynamax", harness.NO_BENCH)
  for t in map(int, _LONG_LENS.value):
    for h in map(int, _LONG_STATES.value):
      model = hmm_lib.random_hmm(jax.random.PRNGKey(h), h, vocab_size)
      tokens = _tokens(model, t, b, 2)
      print(f"Long posterior: {b} x {t} tokens, |H|={h}")
      fns = {f"hmmprompt method={m}": jax.jit(jax.vmap(lambda x, m=m:
          hmm_lib.posterior(model, x, method=m))) for m in _METHODS}
      harness.against_first(
          fns | _dynamax_smoothers(model), (tokens,), _LONG_REPEATS.value,
          lambda name, secs: f"  {name:<34s} {b * t / secs / 1e6:9.3f} M "
          "tokens/s", "our sequential time")


def bench_targets(base):
  """Per kernel, :func:`corpus.exact_targets` of 1 and of each of
  ``--targets_windows`` batches in one call, per batch (|X| as base's)."""
  from hmmprompt import corpus as corpus_lib  # pylint: disable=g-import-not-at-top
  b, t, h = map(int, _TARGETS_SHAPE.value)
  model = hmm_lib.random_hmm(jax.random.PRNGKey(h), h, base.vocab_size)
  for n in sorted({1, *map(int, _TARGETS_WINDOWS.value)}):
    inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(4), _tokens(
        model, t, n * b, 3), 0.15, base.vocab_size, bert=True)
    print(f"Exact targets: {n} x {b} x {t} tokens, |H|={h}, in one call")
    harness.against_first(
        {m: jax.jit(jax.vmap(lambda x, w, m=m: corpus_lib.exact_targets(
            model, x, w, m))) for m in _METHODS}, (inputs, weights),
        _REPEATS.value, lambda m, secs, n=n: f"  exact_targets, {m:<10s} "
        f"{secs * 1e3 / n:9.2f} ms per batch of {b}", "the scan's time")


def main(argv):
  harness.start(argv)
  model = hmm_lib.random_hmm(jax.random.PRNGKey(0), _STATES.value, _VOCAB.value)
  sections = {"sampling": bench_sampling, "posterior": bench_posterior,
              "long": bench_long, "targets": bench_targets}
  if unknown := set(_SECTIONS.value) - set(sections):
    raise app.UsageError(f"--sections: unknown {sorted(unknown)}; known "
                         f"{sorted(sections)}")
  for name in _SECTIONS.value:
    sections[name](model)


if __name__ == "__main__":
  app.run(main)
