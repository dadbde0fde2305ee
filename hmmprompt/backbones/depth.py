"""Depth surgery on an ``MLM``'s params (any leading axes) for pretraining's
fallbacks (``fallback_layers``, :mod:`hmmprompt.pretrain.workdir`)."""

import jax
import jax.numpy as jnp


def _num_blocks(params) -> int:
  return sum(1 for name in params["params"] if name.startswith("block_"))


def pad_layers(params, num_layers: int):
  """``params`` with zero blocks up to ``num_layers`` (the same function: a
  pre-norm block with zero ``attn_out`` and ``mlp_out`` adds exactly 0)."""
  inner, have = params["params"], _num_blocks(params)
  if num_layers < have:
    raise ValueError(f"pad_layers: the params have {have} layers, more than "
                     f"num_layers = {num_layers}")
  zero_block = jax.tree.map(jnp.zeros_like, inner["block_0"])
  return {**params, "params": {
      **inner, **{f"block_{i}": zero_block for i in range(have, num_layers)}}}


def grow_layers(params, fresh):
  """``fresh`` (a deeper ``MLM``'s params of the same width) started from
  ``params``, its further blocks' ``attn_out`` and ``mlp_out`` zeroed: it
  computes ``params``' function (:func:`pad_layers`), yet the rest keeps its
  init, so gradients do not vanish (``PretrainConfig.fallback_init``)."""
  inner, deep = params["params"], fresh["params"]
  have, want = _num_blocks(params), _num_blocks(fresh)
  if want <= have:
    raise ValueError(f"grow_layers: fresh has {want} layers, not more than "
                     f"the {have} of params")
  zero_out = lambda block: {n: (jax.tree.map(jnp.zeros_like, leaf) if n in (
      "attn_out", "mlp_out") else leaf) for n, leaf in block.items()}
  return {**fresh, "params": {**deep, **inner, **{
      f"block_{i}": zero_out(deep[f"block_{i}"]) for i in range(have, want)}}}


def take_layers(params, num_layers: int):
  """``params``' first ``num_layers`` blocks: :func:`pad_layers` undone."""
  inner, have = params["params"], _num_blocks(params)
  if not 0 < num_layers <= have:
    raise ValueError(f"take_layers: num_layers = {num_layers} not in "
                     f"[1, {have}] (the params' layers)")
  return {**params, "params": {
      name: leaf for name, leaf in inner.items()
      if not name.startswith("block_") or int(name.split("_")[1]) < num_layers}}
