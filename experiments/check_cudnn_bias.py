r"""Does the learned relative-position bias train through cuDNN?

  python -m experiments.check_cudnn_bias [--trials=4] [--num_layers=1] \
      [--also_xla] [--tiny]

A gradient step of paper models (``rel_pos="bias"``) through dot_product and
manual attention (docs/figure3_gpu.md); exits 1 if the bias gradient is
missing, zero, not finite or over ``--max_rel_diff``.
"""

import dataclasses
import sys
from unittest import mock

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt.backbones import attention
from hmmprompt.backbones import transformer
from experiments.bench import harness

_TRIALS = flags.DEFINE_integer("trials", 4, "trials vmapped", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 8, "per trial", lower_bound=1)
_SEQ = flags.DEFINE_integer("seq_len", 512, "<= max_len", lower_bound=2)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"],
                           "compute dtype (cuDNN takes bfloat16)")
_TINY = flags.DEFINE_bool("tiny", False, "2 layers, width 32, T <= 16 (CPU)")
_LAYERS = flags.DEFINE_integer("num_layers", 0, "layers (0: the model's "
                               "own: 6, or --tiny's 2)", lower_bound=0)
_ALSO_XLA = flags.DEFINE_bool("also_xla", False, "also time XLA's dot_product")
_MAX_REL = flags.DEFINE_float("max_rel_diff", 0.1, "fail above this bias-"
                              "gradient difference from the manual path")
_REPEATS = 5


def grad_step(cfg: transformer.MLMConfig):
  """Jitted ``(params [K, ...], tokens, targets [K, B, T]) -> grads``."""
  model = transformer.MLM(cfg)
  def loss(params, tokens, targets):
    logits = model.apply(params, tokens)
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)
  return jax.jit(jax.vmap(jax.grad(loss)))


def main(argv):
  harness.start(argv, retain_freed_memory=False)
  kw = {"rel_pos": "bias", "dtype": _DTYPE.value, "attention": "manual"}
  cfg = (transformer.MLMConfig(vocab_size=10, d_model=32, num_heads=2,
                               d_ff=64, num_layers=2, max_len=16, **kw)
         if _TINY.value else transformer.paper_config(10, **kw))
  cfg = dataclasses.replace(cfg, num_layers=_LAYERS.value or cfg.num_layers)
  bias_grads = lambda grads: [  # each layer's [K, A, 2 L - 1] (or KeyError)
      np.asarray(grads["params"][f"block_{i}"]["rel_bias"], np.float64)
      for i in range(cfg.num_layers)]
  k, b, t = _TRIALS.value, _BATCH.value, min(_SEQ.value, cfg.max_len)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; "
        f"{cfg.num_layers} layers, d {cfg.d_model}, {cfg.num_heads} heads; "
        f"{k} trials x batch {b} x T {t}, {cfg.dtype}")
  params = jax.jit(jax.vmap(lambda key: transformer.init_params(key, cfg)))(
      jax.random.split(jax.random.PRNGKey(0), k))
  for i in range(cfg.num_layers):  # each trial its own, nonzero table
    block = params["params"][f"block_{i}"]
    block["rel_bias"] = 0.5 * jax.random.normal(jax.random.PRNGKey(100 + i),
                                                block["rel_bias"].shape)
  args = (params, *(jax.random.randint(key, (k, b, t), 0, cfg.vocab_size)
                    for key in jax.random.split(jax.random.PRNGKey(1))))
  dp = dataclasses.replace(cfg, attention="dot_product")
  compiled = (lowered := grad_step(dp).lower(*args)).compile()
  for name, step in (("lowered", lowered), ("compiled", compiled)):
    print(f"cuDNN fMHA calls, {name}:",
          attention.cudnn_fmha_targets(step.as_text()) or "none")
  print("cuDNN in the compiled step:",
        "yes" if attention.uses_cudnn(compiled.as_text()) else "absent")
  failures, manual_step = [], grad_step(cfg)
  want = bias_grads(manual_step(*args))
  try:
    got = bias_grads(compiled(*args))
  except KeyError:
    failures.append("the dot_product path gave no rel_bias gradient")
  else:
    rel = [float(np.abs(g - w).max() / np.abs(w).max())
           for g, w in zip(got, want)]
    smallest = min(float(np.abs(g).reshape(k, -1).max(1).min()) for g in got)
    print("max |dbias| relative difference vs manual, per layer:",
          " ".join(f"{r:.2e}" for r in rel))
    print(f"smallest per-trial max |dbias| (dot_product): {smallest:.3e}; "
          f"manual: {min(float(np.abs(w).max()) for w in want):.3e}")
    if not all(np.isfinite(g).all() for g in got):
      failures.append("the bias gradient is not finite")
    if smallest == 0.0:
      failures.append("the bias gradient is zero for some trial and layer")
    if max(rel) > _MAX_REL.value:
      failures.append(f"the bias gradient is {max(rel):.2e} from manual's "
                      f"(> --max_rel_diff={_MAX_REL.value})")
  steps = {"dot_product": compiled, "manual": manual_step}
  if _ALSO_XLA.value:
    with mock.patch.object(attention, "dot_product_implementation",
                           lambda *_: None):
      steps["dot_product (XLA)"] = grad_step(dp).lower(*args).compile()
  for name, step in steps.items():
    sec = harness.seconds_per_call(lambda s=step: s(*args), _REPEATS, warmup=2)
    print(f"step time, {name}: {1e3 * sec:.2f} ms (median of {_REPEATS})")
  if failures:
    print("FAILED:", "; ".join(failures))
    sys.exit(1)
  print("OK: the bias gradient is nonzero and matches the manual path")


if __name__ == "__main__":
  app.run(main)
