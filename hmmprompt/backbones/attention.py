"""``jax.nn.dot_product_attention`` on cuDNN where it can, folded under vmap."""

import functools
import re

import jax
from jax import custom_batching
import jax.numpy as jnp


# Pretraining vmaps the model over trials, and JAX's batching rules under
# dot_product_attention (cuDNN's in particular) have had bugs. So
# ``_folding_vmap``'s custom_vmap rule folds each vmapped axis into the batch
# (``[K, B, ...] -> [K*B, ...]``), or into the heads where the bias is
# batched (:func:`_fold_heads`: cuDNN computes the bias gradient only for a
# bias of batch 1 whose heads are the query's), and calls the function again.
# custom_vmap has no transpose, so the op is a ``jax.custom_vjp`` (outermost,
# as custom_vmap's docstring prescribes) whose fwd and bwd (a recomputing
# ``jax.vjp(dpa)``: cuDNN's residuals could not be folded) both fold at every
# vmap level. No forward mode. Merging a replicated K into a sharded B may
# make XLA reshard. cuDNN wants the bias in the queries' dtype.


def _fold_heads(axis_size, in_batched, args, roles):
  """One vmap level's head fold: ``"qkv"`` ``[K, B, T, N, H] -> [B, T, K*N,
  H]``, ``"bias"`` ``[K, Bb, N, T, T] -> [Bb, K*N, T, T]``."""
  folded = []
  for x, batched, role in zip(args, in_batched, roles, strict=True):
    if not batched:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    if role == "qkv":
      _, b, t, n, h = x.shape
      x = jnp.moveaxis(x, 0, 2).reshape(b, t, axis_size * n, h)
    else:
      _, bb, n, t, s = x.shape
      x = jnp.moveaxis(x, 0, 1).reshape(bb, axis_size * n, t, s)
    folded.append(x)
  return folded


def _unfold_heads(axis_size, y, role):
  """:func:`_fold_heads`'s inverse for one output of role ``role``."""
  if role == "qkv":
    b, t, kn, h = y.shape
    return jnp.moveaxis(y.reshape(b, t, axis_size, kn // axis_size, h), 2, 0)
  bb, kn, t, s = y.shape
  return jnp.moveaxis(y.reshape(bb, axis_size, kn // axis_size, t, s), 1, 0)


def _fold_batch(axis_size, in_batched, args, roles):
  """One vmap level's ``[K, B, ...] -> [K*B, ...]``; a bias of batch 1 kept."""
  folded = []
  for x, batched, role in zip(args, in_batched, roles, strict=True):
    assert not (batched and role == "bias")
    if role == "bias" and x.shape[0] == 1:
      folded.append(x)
      continue
    if not batched:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
  return folded


def _folding_vmap(fn, in_roles, out_roles, heads_always: bool):
  """``custom_vmap(fn)``, ``fn`` of ``"qkv"`` ``[B, T, N, H]`` and ``"bias"``
  ``[Bb, N, T, T]`` operands to a tuple (``out_roles``), folding into the
  heads where a bias is batched (or ``heads_always``), else the batch."""
  op = custom_batching.custom_vmap(fn)
  @op.def_vmap
  def fold(axis_size, in_batched, *args):
    bias_batched = any(b for b, r in zip(in_batched, in_roles) if r == "bias")
    if heads_always or bias_batched:
      out = op(*_fold_heads(axis_size, in_batched, args, in_roles))
      out = tuple(_unfold_heads(axis_size, y, r)
                  for y, r in zip(out, out_roles, strict=True))
    else:
      assert "bias" not in out_roles
      out = op(*_fold_batch(axis_size, in_batched, args, in_roles))
      out = tuple(y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])
                  for y in out)
    return out, tuple(True for _ in out)
  return op


def dot_product_implementation(dtype, head_dim: int) -> str | None:
  """``"cudnn"`` on GPUs for bf16 / fp16 and a head dim cuDNN takes (a
  multiple of 8, <= 128), else ``None`` (XLA's; ``None`` never picks cuDNN
  itself): ``jax.nn.dot_product_attention``'s ``implementation``."""
  if (jax.default_backend() == "gpu"
      and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
      and head_dim % 8 == 0 and head_dim <= 128):
    return "cudnn"
  return None


@functools.lru_cache(maxsize=None)
def _attention_op(implementation: str | None, biased: bool):
  def dpa(*qkv_bias, training=False):
    # cuDNN gives a bias a gradient at batch 1 and the query's heads alone.
    cudnn_trains = not (training and biased) or (
        qkv_bias[3].shape[:2] == (1, qkv_bias[0].shape[2]))
    if implementation is not None and cudnn_trains:
      try:
        return jax.nn.dot_product_attention(*qkv_bias,
                                            implementation=implementation)
      except (NotImplementedError, RuntimeError, ValueError):
        pass  # refused at trace time (cuDNN version, shape): XLA instead
    return jax.nn.dot_product_attention(*qkv_bias)
  def dpa_vjp(*qkv_bias_g):
    return jax.vjp(functools.partial(dpa, training=True),
                   *qkv_bias_g[:-1])[1](qkv_bias_g[-1])
  roles = ("qkv", "qkv", "qkv") + (("bias",) if biased else ())
  forward = _folding_vmap(lambda *a: (dpa(*a),), roles, ("qkv",),
                          heads_always=False)
  backward = _folding_vmap(dpa_vjp, (*roles, "qkv"), roles, heads_always=biased)
  @jax.custom_vjp
  def attention(*qkv_bias):
    return forward(*qkv_bias)[0]
  attention.defvjp(lambda *a: (forward(*a)[0], a),
                   lambda res, g: backward(*res, g))
  return attention


def dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, bias_1xNxTxT=None):
  """``jax.nn.dot_product_attention(q, k, v, bias)`` -> ``[B, T, N, H]`` (bias
  batch 1 or ``B``, or None), folded under vmap, differentiable (bias too)."""
  args = (q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
  if bias_1xNxTxT is not None:
    args += (bias_1xNxTxT.astype(q_BxTxNxH.dtype),)
  return _attention_op(dot_product_implementation(
      q_BxTxNxH.dtype, q_BxTxNxH.shape[-1]), bias_1xNxTxT is not None)(*args)


CUDNN_FMHA = "__cudnn$fmha"
"""The prefix of cuDNN's fused-attention custom-call targets in HLO
(``__cudnn$fmhaScaleBiasSoftmax``, ``...Backward``, ...)."""


def cudnn_fmha_targets(hlo_text: str) -> list[str]:
  """The sorted distinct cuDNN fMHA custom-call targets in ``hlo_text``."""
  return sorted(set(re.findall(re.escape(CUDNN_FMHA) + r"\w*", hlo_text)))


def uses_cudnn(compiled_text: str) -> bool:
  """Whether a program's HLO text holds a cuDNN fMHA call."""
  return bool(cudnn_fmha_targets(compiled_text))
