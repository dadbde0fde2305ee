"""``jax.nn.dot_product_attention`` as the transformer calls it: on cuDNN
where it can, never batched by JAX's own vmap rules (a vmapped trial axis
is folded into the batch axis, or into the head axis where each trial has
its own logit bias), differentiable (comments below)."""

from __future__ import annotations

import functools
import re

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


def _fold_heads(axis_size, in_batched, args, roles):
  """The head fold of one vmap level: every operand batched (unbatched ones
  broadcast to ``[K, ...]``), ``K`` moved beside the head axis and merged
  into it: ``"qkv"`` ``[K, B, T, N, H] -> [B, T, K*N, H]``, ``"bias"``
  ``[K, Bb, N, T, T] -> [Bb, K*N, T, T]``."""
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


def _fold_batch_with_bias(axis_size, in_batched, args, roles):
  """The batch fold of one vmap level whose ``"bias"`` operand is not
  batched: ``"qkv"`` operands ``[K, B, ...] -> [K*B, ...]`` (unbatched
  ones broadcast first); the bias as it is where its batch is 1, else
  tiled to ``[K*Bb, N, T, T]`` beside the queries' fold."""
  folded = []
  for x, batched, role in zip(args, in_batched, roles, strict=True):
    if role == "bias":
      assert not batched
      if x.shape[0] == 1:
        folded.append(x)
        continue
    if not batched:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    folded.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
  return folded


def _folding_vmap_with_bias(fn, in_roles, out_roles, heads_always: bool):
  """``custom_vmap(fn)`` for ``fn`` of ``[B, T, N, H]`` (role ``"qkv"``)
  and ``[Bb, N, T, T]`` (role ``"bias"``) arrays returning a tuple of such
  arrays (roles ``out_roles``). Vmapped, it folds the vmapped axis into the
  head axis where the bias is batched at that level (or always, with
  ``heads_always``), else into the batch axis, and calls itself on the
  folded arrays; outputs are unfolded to ``[K, ...]``."""
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
      out = op(*_fold_batch_with_bias(axis_size, in_batched, args, in_roles))
      out = tuple(y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])
                  for y in out)
    return out, tuple(True for _ in out)

  return op


# With a bias (the transformer's relative positions, ``[1, N, T, T]`` per
# model): the same custom_vjp around two custom_vmaps, but a vmap level
# whose *bias* is batched (pretraining's trials: each has its own bias
# table) folds into the HEAD axis instead of the batch: ``[K, B, T, N, H]
# -> [B, T, K*N, H]`` and the bias ``[K, 1, N, T, T] -> [1, K*N, T, T]``.
# cuDNN (measured on an H100, jax 0.11.2) computes the bias gradient only
# for a bias of batch 1 whose heads are the query's, and JAX's batching rule
# for a per-trial bias fails; trials folded into heads keep the bias at
# batch 1 (7.2 ms vs 19.5 ms for XLA's path at 4 trials x batch 64, T=512,
# 12 heads of 64). A level whose bias is *not* batched (a vmap over examples
# sharing one model, as tuning's) folds the forward into the batch axis as
# without a bias, the batch-1 bias untouched. The backward folds every
# level into the heads, the bias broadcast where it is not batched: its
# cotangent must be one per vmapped member (vmap of grad wants each
# member's; under grad of vmap JAX sums them), which a batch fold around a
# batch-1 bias cannot give. Nested vmaps compose level by level as above
# (trials then examples: ``[B*E, T, K*N, H]`` forward; examples then
# trials: ``[E*B, T, K*N, H]``). The bias reaches the op in the queries'
# dtype (cuDNN requires it); its cotangent is cast back by the cast's
# transpose.


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


def _cudnn_trains(bias, query) -> bool:
  """Whether cuDNN gives ``bias`` a gradient: batch 1, the query's heads."""
  return bias.shape[0] == 1 and bias.shape[1] == query.shape[2]


@functools.lru_cache(maxsize=None)
def _biased_attention_op(implementation: str | None):
  def dpa(q, k, v, bias, training=False):
    if implementation is not None and (not training
                                       or _cudnn_trains(bias, q)):
      try:
        return jax.nn.dot_product_attention(q, k, v, bias,
                                            implementation=implementation)
      except (NotImplementedError, RuntimeError, ValueError):
        pass  # refused at trace time (cuDNN version, shape): XLA instead
    return jax.nn.dot_product_attention(q, k, v, bias)

  def dpa_vjp(q, k, v, bias, g):
    return jax.vjp(functools.partial(dpa, training=True),
                   q, k, v, bias)[1](g)

  qkv, bias = "qkv", "bias"
  forward = _folding_vmap_with_bias(lambda *a: (dpa(*a),),
                                    (qkv, qkv, qkv, bias), (qkv,),
                                    heads_always=False)
  backward = _folding_vmap_with_bias(dpa_vjp, (qkv, qkv, qkv, bias, qkv),
                                     (qkv, qkv, qkv, bias),
                                     heads_always=True)

  @jax.custom_vjp
  def attention(q, k, v, bias):
    return forward(q, k, v, bias)[0]

  attention.defvjp(lambda *a: (forward(*a)[0], a),
                   lambda res, g: backward(*res, g))
  return attention


def dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, bias_1xNxTxT=None):
  """``jax.nn.dot_product_attention(q, k, v, bias)`` (scale ``1/sqrt(H)``,
  no mask; ``bias_1xNxTxT`` added to the ``[B, N, T, T]`` logits, batch 1
  or ``B``, or None) whose ``vmap`` folds the vmapped axes into ``B``, or
  into ``N`` where the bias is vmapped (see above), and which ``jax.grad``
  differentiates, the bias included; ``[B, T, N, H]`` out."""
  implementation = dot_product_implementation(q_BxTxNxH.dtype,
                                              q_BxTxNxH.shape[-1])
  if bias_1xNxTxT is None:
    return _attention_op(implementation)(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
  return _biased_attention_op(implementation)(
      q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, bias_1xNxTxT.astype(q_BxTxNxH.dtype))


CUDNN_FMHA = "__cudnn$fmha"
"""The prefix of cuDNN's fused-attention custom-call targets in HLO
(``__cudnn$fmhaScaleBiasSoftmax``, ``...Backward``, ...)."""


def cudnn_fmha_targets(hlo_text: str) -> list[str]:
  """The distinct cuDNN fMHA custom-call targets in ``hlo_text`` (a
  lowered or compiled program's ``as_text()``), sorted."""
  return sorted(set(re.findall(re.escape(CUDNN_FMHA) + r"\w*", hlo_text)))


def uses_cudnn(compiled_text: str) -> bool:
  """Whether a program's HLO text holds a cuDNN fMHA call."""
  return bool(cudnn_fmha_targets(compiled_text))
