"""``jax.nn.dot_product_attention`` as the transformer calls it: on cuDNN
where it can, never batched by JAX's own vmap rules (a vmapped trial axis
is folded into the batch axis), differentiable (comments below)."""

from __future__ import annotations

import functools

import jax
from jax import custom_batching
import jax.numpy as jnp


# ``jax.nn.dot_product_attention`` never batched by JAX's own vmap rules.
#
# Pretraining vmaps the whole model over a leading trial axis (train.py
# ``map_trials``, ``trials_per_vmap=0``), and the batching rules under
# dot_product_attention (cuDNN's custom call in particular) have had bugs
# across jax versions. ``_folding_vmap`` wraps a function of ``[B, ...]``
# arrays in ``jax.custom_batching.custom_vmap`` whose rule folds the vmapped
# axis into the batch axis instead: ``[K, B, T, N, H] -> [K*B, T, N, H]``
# (operands the vmap does not batch are broadcast to ``[K, ...]`` first),
# calls the wrapped function on that and unfolds its outputs to ``[K, B,
# ...]``. The rule calls the *wrapped* function, so under a second vmap the
# fold's result is batched again and that level folds once more (``[K2, K1,
# B, ...]`` -> ``[K2*K1*B, ...]``): the attention call only ever sees one
# plain batch axis.
#
# Gradients: custom_vmap functions have a JVP rule but no transpose, so
# reverse mode through one fails (jax 0.10.2: jax.grad raises "Linearization
# failed to produce known values for all output primals"; the custom_vmap
# docstring: "custom_vmap functions do not support reverse-mode autodiff").
# The op is therefore a ``jax.custom_vjp`` (outermost, as that docstring
# prescribes) whose primal and fwd call the folding forward
# (``_folding_vmap(dpa)``) and whose bwd calls a folding backward
# (``_folding_vmap`` of ``jax.vjp(dpa, q, k, v)[1](g)``). Under vmap, JAX
# batches a custom_vjp by batching its fwd and bwd, which binds our
# custom_vmaps, so both directions fold at every vmap level, in either order
# (vmap of grad, as pretraining does, or grad of vmap). The residuals are
# just ``(q, k, v)``: bwd recomputes the forward inside ``jax.vjp`` (cuDNN's
# own residuals have layouts we could not fold generically); that costs one
# more attention forward per step on cuDNN (~3% of a step's FLOPs at the
# paper's shapes); on the XLA path XLA's CSE merges it with the forward (the
# compiled gradient has the 6 dots of plain dot_product_attention's).
# Forward-mode (jax.jvp) through the op is unsupported, as for any
# custom_vjp; nothing here uses it. With the batch split over several
# devices, merging the replicated K into the sharded B may make XLA reshard
# around the call (one device: the reshapes are free).


def _folding_vmap(fn):
  """``custom_vmap(fn)`` for ``fn`` of arrays with a leading batch axis that
  returns such arrays (or a tuple of them): vmapped, it folds the vmapped
  axis into the batch axis and calls itself on the folded arrays."""
  op = custom_batching.custom_vmap(fn)

  @op.def_vmap
  def fold(axis_size, in_batched, *args):
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched)]
    out = op(*[x.reshape(axis_size * x.shape[1], *x.shape[2:])
               for x in args])
    out = jax.tree.map(lambda y: y.reshape(
        axis_size, y.shape[0] // axis_size, *y.shape[1:]), out)
    return out, jax.tree.map(lambda _: True, out)

  return op


def dot_product_implementation(dtype, head_dim: int) -> str | None:
  """``jax.nn.dot_product_attention``'s ``implementation`` for the default
  backend: ``"cudnn"`` (flash attention) on GPUs for bf16 / fp16 inputs
  with a head dim cuDNN takes (a multiple of 8, <= 128), else ``None``
  (XLA's einsums: in jax 0.10 ``None`` never picks cuDNN by itself, and
  cuDNN refuses fp32)."""
  if (jax.default_backend() == "gpu"
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0 and head_dim <= 128):
    return "cudnn"
  return None


@functools.lru_cache(maxsize=None)
def _attention_op(implementation: str | None):
  def dpa(q, k, v):
    if implementation is not None:
      try:
        return jax.nn.dot_product_attention(q, k, v,
                                            implementation=implementation)
      except (NotImplementedError, RuntimeError, ValueError):
        pass  # refused at trace time (cuDNN version, shape): XLA instead
    return jax.nn.dot_product_attention(q, k, v)

  def dpa_vjp(q, k, v, g):
    return jax.vjp(dpa, q, k, v)[1](g)

  forward, backward = _folding_vmap(dpa), _folding_vmap(dpa_vjp)

  @jax.custom_vjp
  def attention(q, k, v):
    return forward(q, k, v)

  attention.defvjp(lambda q, k, v: (forward(q, k, v), (q, k, v)),
                   lambda qkv, g: backward(*qkv, g))
  return attention


def dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH):
  """``jax.nn.dot_product_attention(q, k, v)`` (scale ``1/sqrt(H)``, no
  mask) whose ``vmap`` folds the vmapped axes into ``B`` (see above) and
  which ``jax.grad`` differentiates; ``[B, T, N, H]`` out."""
  return _attention_op(dot_product_implementation(
      q_BxTxNxH.dtype, q_BxTxNxH.shape[-1]))(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
