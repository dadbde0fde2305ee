r"""Forward against gradient time for each part of one ``cpu_capped`` block
(docs/performance.md, "The backward pass on XLA:CPU").

  taskset -c 0 env XLA_FLAGS=--xla_cpu_multi_thread_eigen=false \
      python -m experiments.bench.block_parts

Each part on a ``[32, 80]`` batch, then the whole block:
``jit(sum(tanh(part(x))))`` against its ``jit(grad)`` in every input.
"""

from absl import app
import flax.linen as nn
import jax
import jax.numpy as jnp

from hmmprompt import pretrain as pretrain_lib
from hmmprompt import protocol
from hmmprompt.backbones import transformer
from experiments.bench import harness


def fwd_and_grad_ms(f, *args, n: int = 40) -> tuple[float, float]:
  """Mean ms per call of ``sum(tanh(f(*args)))`` and of its gradient."""
  loss = lambda *a: jnp.sum(jnp.tanh(f(*a)))
  fwd, grad = (1e3 * harness.seconds_per_call(lambda g=g: g(*args), steps=n)
               for g in (jax.jit(loss), jax.jit(jax.grad(
                   loss, argnums=tuple(range(len(args)))))))
  return fwd, grad


def parts(b: int = 32, t: int = 80) -> dict:
  """``{name: (f, args)}``: the block's parts and the block."""
  cfg = pretrain_lib.configure("cpu_capped", protocol.VOCAB).model
  d, a = cfg.d_model, cfg.num_heads
  key = jax.random.PRNGKey(0)
  x_BxTxD = jax.random.normal(key, (b, t, d))
  q_BxAxTxE = jax.random.normal(key, (b, a, t, d // a))
  bias_AxTxT = jax.random.normal(key, (a, t, t))

  def attention(q, k, v, bias):
    logits = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) / 4.0 + bias
    return jnp.matmul(jax.nn.softmax(logits, -1), v)

  def module(m, x):
    return (lambda p, x: m.apply(p, x)), (m.init(key, x), x)

  return {
      "layernorm": module(nn.LayerNorm(), x_BxTxD),
      "dense qkv": module(transformer.TokenDense(3 * d), x_BxTxD),
      "attention (qk, softmax, av)": (attention, (
          q_BxAxTxE, q_BxAxTxE + 1, 2 * q_BxAxTxE, bias_AxTxT)),
      "softmax": (lambda z: jax.nn.softmax(z, -1),
                  (jax.random.normal(key, (b, a, t, t)),)),
      "gelu": (nn.gelu, (jax.random.normal(key, (b, t, cfg.d_ff)),)),
      "block": module(transformer.Block(cfg), x_BxTxD)}


@harness.main(retain_freed_memory=False)
def main():
  print("| part | forward (ms) | grad (ms) | grad / forward |\n|---|---|---|---|")
  for name, (f, args) in parts().items():
    fwd, grad = fwd_and_grad_ms(f, *args)
    print(f"| {name} | {fwd:.2f} | {grad:.2f} | {grad / fwd:.1f} |", flush=True)


if __name__ == "__main__":
  app.run(main)
