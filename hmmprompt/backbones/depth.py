"""Depth surgery on an ``MLM``'s params (any leading axes, such as a trial
stack): blocks appended as the identity (:func:`pad_layers`), taken off
again (:func:`take_layers`), or grown for further training
(:func:`grow_layers`). The fallbacks of pretraining use them
(``PretrainConfig.fallback_layers``, :mod:`hmmprompt.pretrain.workdir`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _num_blocks(inner) -> int:
  return sum(1 for name in inner if name.startswith("block_"))


def pad_layers(params, num_layers: int):
  """``params`` (an ``MLM``'s, any leading axes such as a trial stack)
  with identity blocks appended up to ``num_layers``: the deeper model
  computes the same function (the same logits, up to float rounding).

  A block adds ``attn_out(.)`` and ``mlp_out(.)`` to its input (pre-norm
  residual); with both projections' kernels and biases zero it adds
  exactly 0, whatever its other parameters (zeros here too: every value
  stays finite). Stacks with another deeper model's params of the same
  width (:func:`~hmmprompt.pretrain.workdir.load_trials`' fallbacks).
  """
  inner = params["params"]
  have = _num_blocks(inner)
  if num_layers < have:
    raise ValueError(f"pad_layers: the params have {have} layers, more than "
                     f"num_layers = {num_layers}")
  zero_block = jax.tree.map(jnp.zeros_like, inner["block_0"])
  return {**params, "params": {
      **inner, **{f"block_{i}": zero_block for i in range(have, num_layers)}}}


def grow_layers(params, fresh):
  """``fresh`` (a deeper ``MLM``'s params of the same width, any leading
  axes) started from the shallower ``params``: their embeddings, output
  layer and blocks, then ``fresh``'s further blocks with both output
  projections (``attn_out``, ``mlp_out``) zero. Such a block adds exactly
  0 (:func:`pad_layers`), so the grown model computes ``params``'
  function; unlike :func:`pad_layers`' all-zero blocks, its other
  weights keep their init, so its gradients do not vanish and training
  grows it (a fallback warm-started, ``PretrainConfig.fallback_init``)."""
  inner, deep = params["params"], fresh["params"]
  have, want = _num_blocks(inner), _num_blocks(deep)
  if want <= have:
    raise ValueError(f"grow_layers: fresh has {want} layers, not more than "
                     f"the {have} of params")
  zero_out = lambda block: {
      name: (jax.tree.map(jnp.zeros_like, leaf)
             if name in ("attn_out", "mlp_out") else leaf)
      for name, leaf in block.items()}
  return {**fresh, "params": {
      **deep, **inner,
      **{f"block_{i}": zero_out(deep[f"block_{i}"])
         for i in range(have, want)}}}


def take_layers(params, num_layers: int):
  """``params`` (any leading axes) with only the first ``num_layers``
  blocks: :func:`pad_layers` undone, the padded model's own params back
  (tuned at their own depth, the padding's backward costs nothing)."""
  inner = params["params"]
  have = _num_blocks(inner)
  if not 0 < num_layers <= have:
    raise ValueError(f"take_layers: num_layers = {num_layers} not in "
                     f"[1, {have}] (the params' layers)")
  return {**params, "params": {
      name: leaf for name, leaf in inner.items()
      if not name.startswith("block_")
      or int(name.split("_")[1]) < num_layers}}
