r"""Throughput of hmmprompt's HMM sampler and posterior vs hmmlearn / dynamax.

Every number is measured in the same run on the same machine; ratios are
against the baselines measured here, never against remembered numbers.

  python -m experiments.bench_hmm            # needs the `bench` extra

Sampling: ``jax.jit(jax.vmap(lambda k: hmm.sample(k, model, T)))`` over
``--sample_batch`` keys vs hmmlearn's ``CategoricalHMM.sample`` (what the
authors used) and dynamax's ``CategoricalHMM.sample``.
Posterior: ``jax.jit(jax.vmap(hmm.posterior))`` vs dynamax's
``hmm_smoother`` vmapped the same way (its default arguments: its jitted signature makes
``compute_trans_probs`` a traced value, so it cannot be switched off) and
hmmlearn's ``predict_proba``.
Long sequences (issue 51): ``posterior`` with ``method="sequential"``,
``"parallel"`` and ``"blocked"`` vs dynamax's ``hmm_smoother`` and its
associative-scan ``parallel_hmm_smoother``, each ``jit(vmap)`` over ``--long_batch``
sequences, on the grid ``--long_lens`` x ``--long_states``; ratios are
times over our sequential path's in the same cell. Exact targets: one
pretraining batch's ``corpus.exact_targets`` with each kernel.
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import glibc
from hmmprompt import hmm as hmm_lib

_STATES = flags.DEFINE_integer("num_states", 30, "hidden states |H|")
_VOCAB = flags.DEFINE_integer("vocab_size", 10, "vocabulary |X|")
_SAMPLE_BATCH = flags.DEFINE_integer("sample_batch", 200, "sequences sampled")
_SAMPLE_LEN = flags.DEFINE_integer("sample_len", 10240, "tokens per sequence")
_POST_BATCH = flags.DEFINE_integer("post_batch", 1000, "posterior batch")
_POST_LEN = flags.DEFINE_integer("post_len", 129, "posterior sequence length")
_REPEATS = flags.DEFINE_integer("repeats", 7, "timed repeats (median)")
_LONG_BATCH = flags.DEFINE_integer("long_batch", 8,
                                   "long-sequence posterior batch")
_LONG_LENS = flags.DEFINE_list("long_lens", ["512", "10240"],
                               "long-sequence lengths T")
_LONG_STATES = flags.DEFINE_list("long_states", ["30", "100"],
                                 "long-sequence numbers of states |H|")
_LONG_REPEATS = flags.DEFINE_integer("long_repeats", 3,
                                     "timed repeats of a long cell (median)")
_TARGETS_SHAPE = flags.DEFINE_list(
    "targets_shape", ["64", "512", "30"],
    "exact targets' batch, length and |H| (the gpu preset's step)")
_SECTIONS = flags.DEFINE_list("sections",
                              ["sampling", "posterior", "long", "targets"],
                              "which benchmarks to run")
_HMMLEARN_SEQS = flags.DEFINE_integer(
    "hmmlearn_seqs", 5, "sequences for hmmlearn (it is slow; rates scale)")


def _median_time(fn, repeats):
  jax.block_until_ready(fn())  # compile / warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _hmmlearn_model(model):
  from hmmlearn.hmm import CategoricalHMM  # pylint: disable=g-import-not-at-top
  f64 = lambda a: np.asarray(a, np.float64) / np.asarray(
      a, np.float64).sum(-1, keepdims=True)
  m = CategoricalHMM(n_components=model.num_states, init_params="",
                     params="")
  m.n_features = model.vocab_size
  m.startprob_ = f64(model.initial)
  m.transmat_ = f64(model.transition)
  m.emissionprob_ = f64(model.emission)
  return m


def _report(name, tokens, seconds, baseline=None):
  rate = tokens / seconds
  line = f"  {name:<44s} {rate / 1e6:10.3f} M tokens/s"
  if baseline is not None:
    line += f"   hmmprompt is {seconds / baseline:7.1f}x faster"
  print(line)
  return seconds


def bench_sampling(model):
  b, t = _SAMPLE_BATCH.value, _SAMPLE_LEN.value
  print(f"Sampling: {b} x {t} tokens, |H|={model.num_states}, "
        f"|X|={model.vocab_size}")
  keys = jax.random.split(jax.random.PRNGKey(0), b)
  ours = jax.jit(jax.vmap(lambda k: hmm_lib.sample(k, model, t)))
  t_ours = _median_time(lambda: ours(keys), _REPEATS.value)
  _report("hmmprompt jit(vmap(sample))", b * t, t_ours)

  try:
    from dynamax.hidden_markov_model import CategoricalHMM  # pylint: disable=g-import-not-at-top
    dyn = CategoricalHMM(model.num_states, 1, model.vocab_size)
    params, _ = dyn.initialize(
        jax.random.PRNGKey(0), initial_probs=model.initial,
        transition_matrix=model.transition,
        emission_probs=model.emission[:, None, :])
    dyn_fn = jax.jit(jax.vmap(lambda k: dyn.sample(params, k, t)))
    t_dyn = _median_time(lambda: dyn_fn(keys), _REPEATS.value)
    _report("dynamax CategoricalHMM.sample (jit+vmap)", b * t, t_dyn, t_ours)
  except ImportError:
    print("  dynamax not installed (pip install -e '.[bench]')")

  try:
    hl = _hmmlearn_model(model)
  except ImportError:
    print("  hmmlearn not installed (pip install -e '.[bench]')")
    return
  n = _HMMLEARN_SEQS.value
  t0 = time.perf_counter()
  for i in range(n):
    hl.sample(t, random_state=i)
  t_hl = (time.perf_counter() - t0) / n * b  # per b sequences
  _report(f"hmmlearn CategoricalHMM.sample ({n} seqs)", b * t, t_hl, t_ours)


def bench_posterior(model):
  b, t = _POST_BATCH.value, _POST_LEN.value
  print(f"Posterior: {b} x {t} tokens, |H|={model.num_states}")
  tokens = jax.vmap(lambda k: hmm_lib.sample(k, model, t)[0])(
      jax.random.split(jax.random.PRNGKey(1), b))
  ours = jax.jit(jax.vmap(hmm_lib.posterior, in_axes=(None, 0)))
  post = ours(model, tokens)
  t_ours = _median_time(lambda: ours(model, tokens), _REPEATS.value)
  _report("hmmprompt jit(vmap(posterior))", b * t, t_ours)
  # As many users write it: the HMM closed over, so its arrays are
  # compile-time constants of the outer jit.
  closed = jax.jit(jax.vmap(lambda x: hmm_lib.posterior(model, x)))
  t_closed = _median_time(lambda: closed(tokens), _REPEATS.value)
  _report("  same, HMM closed over", b * t, t_closed)
  print(f"    closed over / argument time: {t_closed / t_ours:.2f}")
  # Our associative-scan kernel in the same run (method="parallel").
  par = jax.jit(jax.vmap(lambda m, x: hmm_lib.posterior(m, x,
                                                        method="parallel"),
                         in_axes=(None, 0)))
  err = float(jnp.max(jnp.abs(par(model, tokens) - post)))
  t_par = _median_time(lambda: par(model, tokens), _REPEATS.value)
  _report("hmmprompt posterior, method=parallel", b * t, t_par, t_ours)
  print(f"    max |difference| from the scan: {err:.2e}")

  try:
    from dynamax.hidden_markov_model import hmm_smoother  # pylint: disable=g-import-not-at-top
    def dyn(x):
      ll = jnp.log(model.emission.T[x])
      return hmm_smoother(model.initial, model.transition, ll).smoothed_probs
    dyn_fn = jax.jit(jax.vmap(dyn))
    err = float(jnp.max(jnp.abs(dyn_fn(tokens) - post)))
    t_dyn = _median_time(lambda: dyn_fn(tokens), _REPEATS.value)
    _report("dynamax hmm_smoother (jit+vmap)", b * t, t_dyn, t_ours)
    print(f"    max |difference| from hmmprompt: {err:.2e}")
  except ImportError:
    print("  dynamax not installed (pip install -e '.[bench]')")

  try:
    hl = _hmmlearn_model(model)
  except ImportError:
    return
  x = np.asarray(tokens).reshape(-1, 1)
  t0 = time.perf_counter()
  hl_post = hl.predict_proba(x, lengths=[t] * b)
  t_hl = time.perf_counter() - t0
  _report("hmmlearn predict_proba", b * t, t_hl, t_ours)
  err = float(np.max(np.abs(hl_post.reshape(b, t, -1) - np.asarray(post))))
  print(f"    max |difference| from hmmprompt: {err:.2e}")


def _dynamax_smoothers():
  """``{name: smoother}`` of dynamax's two smoothers (``{}`` without it)."""
  try:
    from dynamax.hidden_markov_model import hmm_smoother  # pylint: disable=g-import-not-at-top
    from dynamax.hidden_markov_model import parallel_hmm_smoother  # pylint: disable=g-import-not-at-top
  except ImportError:
    return {}
  return {"dynamax hmm_smoother": hmm_smoother,
          "dynamax parallel_hmm_smoother": parallel_hmm_smoother}


def bench_long(vocab_size):
  """Our two kernels and dynamax's two smoothers on each (T, |H|) cell."""
  b = _LONG_BATCH.value
  dyn = _dynamax_smoothers()
  if not dyn:
    print("  dynamax not installed (pip install -e '.[bench]')")
  for t in map(int, _LONG_LENS.value):
    for h in map(int, _LONG_STATES.value):
      model = hmm_lib.random_hmm(jax.random.PRNGKey(h), h, vocab_size)
      tokens = jax.vmap(lambda k: hmm_lib.sample(k, model, t)[0])(
          jax.random.split(jax.random.PRNGKey(2), b))
      print(f"Long posterior: {b} x {t} tokens, |H|={h}")
      fns = {f"hmmprompt method={m}": jax.jit(jax.vmap(
          lambda x, m=m: hmm_lib.posterior(model, x, method=m)))
             for m in ("sequential", "parallel", "blocked")}
      for name, smoother in dyn.items():
        fns[name] = jax.jit(jax.vmap(
            lambda x, s=smoother: s(model.initial, model.transition,
                                    jnp.log(model.emission.T[x])
                                    ).smoothed_probs))
      base = post = None
      for name, fn in fns.items():
        try:
          got = fn(tokens)
          secs = _median_time(lambda fn=fn: fn(tokens), _LONG_REPEATS.value)
        except jax.errors.JaxRuntimeError as e:  # e.g. [B, T, H, H] at 10 240
          print(f"  {name:<34s} failed: {str(e).splitlines()[0][:80]}")
          continue
        line = f"  {name:<34s} {b * t / secs / 1e6:9.3f} M tokens/s"
        if base is None:
          base, post = secs, got
        else:
          err = float(jnp.max(jnp.abs(got - post)))
          line += (f"   {secs / base:6.2f}x our sequential time, max "
                   f"|diff| {err:.1e}")
        print(line)


def bench_targets(vocab_size):
  """What the exact targets add to a training step: one batch's
  :func:`corpus.exact_targets` (BERT corruption at 15%), jitted alone,
  with each kernel (issue 51's goal: at most 1 ms at 64 x 512)."""
  from hmmprompt import corpus as corpus_lib  # pylint: disable=g-import-not-at-top
  b, t, h = map(int, _TARGETS_SHAPE.value)
  model = hmm_lib.random_hmm(jax.random.PRNGKey(h), h, vocab_size)
  tokens = jax.vmap(lambda k: hmm_lib.sample(k, model, t)[0])(
      jax.random.split(jax.random.PRNGKey(3), b))
  inputs, weights = corpus_lib.mask_tokens(jax.random.PRNGKey(4), tokens,
                                           0.15, vocab_size, bert=True)
  print(f"Exact targets: {b} x {t} tokens, |H|={h}")
  base = ref = None
  for method in ("sequential", "parallel", "blocked"):
    fn = jax.jit(jax.vmap(lambda x, w, m=method: corpus_lib.exact_targets(
        model, x, w, m)))
    got = fn(inputs, weights)
    secs = _median_time(lambda fn=fn: fn(inputs, weights), _REPEATS.value)
    line = f"  exact_targets, {method:<10s} {secs * 1e3:9.2f} ms per batch"
    if base is None:
      base, ref = secs, got
    else:
      line += (f"   {secs / base:6.2f}x the scan's time, max |diff| "
               f"{float(jnp.max(jnp.abs(got - ref))):.1e}")
    print(line)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  glibc.retain_freed_memory()  # XLA:CPU step temporaries
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{jax.device_count()} device(s)")
  model = hmm_lib.random_hmm(jax.random.PRNGKey(0), _STATES.value,
                             _VOCAB.value)
  sections = {"sampling": lambda: bench_sampling(model),
              "posterior": lambda: bench_posterior(model),
              "long": lambda: bench_long(_VOCAB.value),
              "targets": lambda: bench_targets(_VOCAB.value)}
  unknown = set(_SECTIONS.value) - set(sections)
  if unknown:
    raise app.UsageError(f"--sections: unknown {sorted(unknown)}; known "
                         f"{sorted(sections)}")
  for name in _SECTIONS.value:
    sections[name]()


if __name__ == "__main__":
  app.run(main)
