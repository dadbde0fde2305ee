"""hmmprompt.backbones.attention with a logit bias: the transformer's
relative positions through ``jax.nn.dot_product_attention`` (XLA's
implementation here on CPU), vmapped trials folded into the head axis."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference  # tests/reference.py

from hmmprompt.backbones import attention
from hmmprompt.backbones import transformer

_CFG = transformer.MLMConfig(vocab_size=10, d_model=16, num_heads=2,
                             d_ff=32, num_layers=2, max_len=12)
_K, _E, _B, _T, _N, _H = 3, 2, 3, 12, 2, 8  # trials, examples, batch, ...

# Tolerance, from float32 rounding (not fitted). Each product or sum of
# ``n`` terms rounds within ``gamma_n ~ n eps`` relative to the sum of its
# terms' magnitudes (Higham); the largest here is ``n = max(d_ff, B T)``
# (the MLP, or a weight gradient's sum over the batch's tokens; vmapped
# trials do not sum into each other). A forward pass chains ``6 L + 1``
# such stages (qkv, scores, values, out, MLP in and out per block; the
# output layer), which the LayerNorms and softmaxes pass on without
# amplifying at these weights (first order: conditions O(1)); reverse mode
# rounds through each stage twice more (the input and the weight
# products), so ``3 (6 L + 1)`` stages for a gradient; two paths that
# round differently are at most twice that apart. Relative to each
# leaf's largest magnitude (at least 1): 2 * 3 * 13 * 36 * 1.19e-7 =
# 3.3e-4 (the paths are ~4e-7 apart in fact), while dropping the bias
# moves the outputs by O(1) and a zeroed bias gradient misses by its
# whole scale (both asserted below).
_N_SUM = max(_CFG.d_ff, _B * _T)
_TOL = 2 * 3 * (6 * _CFG.num_layers + 1) * _N_SUM * np.finfo(np.float32).eps


def _assert_close(got, want):
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(
        x, y, rtol=0, atol=_TOL * max(1.0, float(np.abs(y).max())))


def _cfg(rel_pos, attention_):
  return dataclasses.replace(_CFG, rel_pos=rel_pos, attention=attention_)


def _logits(rel_pos, attention_):
  return lambda params, toks: transformer.MLM(_cfg(rel_pos, attention_)).apply(
      params, toks)


def _loss_and_logits(rel_pos, attention_):
  # A scalar weighing every logit differently (all of the backward counts).
  def f(params, toks):
    logits = _logits(rel_pos, attention_)(params, toks)
    return jnp.sum(jnp.sin(logits)), logits
  return jax.value_and_grad(f, has_aux=True)


def _trial_params(rel_pos):
  """``_K`` trials' params, each its own, far from the init (the learned
  offset table starts at 0, where dropping it would change nothing)."""
  init = jax.vmap(lambda k: transformer.init_params(k, _cfg(rel_pos,
                                                            "manual")))
  params = init(jax.random.split(jax.random.PRNGKey(0), _K))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def _stacked(f, stack):
  """``f(params, toks)`` over the stack: ``"one"`` (trial 0 alone),
  ``"vmap"`` (the trials), ``"nested"`` (trials, then examples inside),
  ``"nested_reverse"`` (examples, then trials inside), ``"lax_map"``
  (``lax.map`` in vmapped groups of 2, as ``train.map_trials``)."""
  if stack == "one":
    return lambda p, t: f(jax.tree.map(lambda x: x[0], p), t)
  if stack == "vmap":
    return jax.vmap(f, in_axes=(0, None))
  if stack == "nested":
    return jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))
  if stack == "nested_reverse":
    return jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(None, 0))
  assert stack == "lax_map"
  return lambda p, t: jax.lax.map(lambda q: f(q, t), p, batch_size=2)


def _tokens(stack):
  shape = (_E, _B, _T) if stack.startswith("nested") else (_B, _T)
  return jax.random.randint(jax.random.PRNGKey(2), shape, 0, 10)


def _attention_calls(jaxpr):
  """Input shapes of every ``custom_vmap`` call in ``jaxpr`` (sub-jaxprs
  included): the attention calls left after the fold rules ran."""
  return [tuple(v.aval.shape for v in eqn.invars)
          for eqn in reference.custom_vmap_calls(jaxpr)]


def _check_against_manual(rel_pos, stack):
  params, toks = _trial_params(rel_pos), _tokens(stack)
  got, want = (jax.jit(_stacked(_loss_and_logits(rel_pos, a), stack))(
      params, toks) for a in ("dot_product", "manual"))
  (_, logits), grads = want
  _assert_close(got, want)
  # The bias counts: the same model without it is far off.
  no_bias = {k: v for k, v in params["params"].items()}
  no_bias = {"params": {k: {n: w for n, w in v.items() if n != "rel_bias"}
                        if isinstance(v, dict) else v
                        for k, v in no_bias.items()}}
  plain = jax.jit(_stacked(_logits("none", "dot_product"), stack))(no_bias,
                                                                   toks)
  assert np.abs(plain - logits).max() > 100 * _TOL * np.abs(logits).max()
  if rel_pos == "bias":
    # Every trial's and layer's offset table gets its own, nonzero gradient
    # (the comparison above holds the dot_product path's to it).
    for i in range(_CFG.num_layers):
      g = np.asarray(grads["params"][f"block_{i}"]["rel_bias"])
      per_trial = np.abs(g.reshape(-1, g.shape[-2] * g.shape[-1]))
      assert (per_trial.max(1) > 0.1).all(), per_trial.max(1)
      if stack != "one":
        assert np.abs(g[1] - g[0]).max() > 0.1
  else:
    assert "rel_bias" not in grads["params"]["block_0"]
  return params, toks


# The folds each vmap level makes (the forward's attention calls, q's
# shape): trials, whose bias is theirs, into the heads; examples, which
# share it, into the batch.
_FOLDED_Q = {
    "one": [(_B, _T, _N, _H)],
    "vmap": [(_B, _T, _K * _N, _H)],
    "nested": [(_E * _B, _T, _K * _N, _H)],
    "nested_reverse": [(_E * _B, _T, _K * _N, _H)],
    "lax_map": [(_B, _T, 2 * _N, _H), (_B, _T, _N, _H)],
}


@pytest.mark.parametrize("stack", [
    pytest.param("vmap", marks=pytest.mark.slow),
    pytest.param("one", marks=pytest.mark.slow),
    pytest.param("nested", marks=pytest.mark.slow),
    pytest.param("nested_reverse", marks=pytest.mark.slow),
    pytest.param("lax_map", marks=pytest.mark.slow)])
def test_learned_offsets_through_dot_product_match_manual(stack):
  """``rel_pos="bias"``: logits and gradients (the offset tables' most of
  all) of ``attention="dot_product"`` are the manual path's, for one model
  and for trials with their own params vmapped, nested with a vmap over
  examples either way round, or ``lax.map``-ped in groups; the trials fold
  into the attention's head axis with their biases at batch 1."""
  params, toks = _check_against_manual("bias", stack)
  fwd = _attention_calls(jax.make_jaxpr(_stacked(
      _logits("bias", "dot_product"), stack))(params, toks))
  n_att = _CFG.num_layers * (2 if stack == "lax_map" else 1)
  assert sorted(c[0] for c in fwd) == sorted(_FOLDED_Q[stack]
                                             * _CFG.num_layers)
  assert len(fwd) == n_att
  for q, _, _, bias in fwd:
    assert bias == (1, q[2], _T, _T)  # batch 1, the queries' heads
  bwd = _attention_calls(jax.make_jaxpr(_stacked(
      _loss_and_logits("bias", "dot_product"), stack))(params, toks))
  # Each layer's forward and backward (q, k, v, bias, cotangent).
  assert len(bwd) == 2 * n_att
  backward = [c for c in bwd if len(c) == 5]
  assert len(backward) == n_att
  for q, _, _, bias, _ in backward:
    assert bias == (1, q[2], _T, _T)


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["one", "vmap", "nested", "nested_reverse",
                                   "lax_map"])
def test_alibi_through_dot_product_matches_manual(stack):
  """``rel_pos="alibi"`` (a fixed bias, no param) as the test above."""
  _check_against_manual("alibi", stack)


def test_rel_pos_no_longer_forces_manual_attention():
  """The runtime choice holds with relative positions: ``"auto"`` is
  manual on CPU, ``"dot_product"`` is honoured."""
  for rel_pos in transformer.REL_POS:
    assert _cfg(rel_pos, "dot_product").resolved_attention == "dot_product"
    assert _cfg(rel_pos, "manual").resolved_attention == "manual"
    if jax.default_backend() == "cpu":
      assert _cfg(rel_pos, "auto").resolved_attention == "manual"
    else:
      assert _cfg(rel_pos, "auto").resolved_attention == "dot_product"


def _loop_attention(q, k, v, bias):
  return jnp.stack([jax.nn.dot_product_attention(q[i], k[i], v[i], bias[i])
                    for i in range(q.shape[0])])


@pytest.mark.parametrize("in_axes", [
    (0, 0, 0, 0), (0, None, 0, 0),
    pytest.param((0, 0, 0, None), marks=pytest.mark.slow),
    pytest.param((None, None, None, 0), marks=pytest.mark.slow)])
def test_the_op_under_vmap_and_grad_is_the_per_member_loop(in_axes):
  """The op alone, any of q, k, v and the bias vmapped or shared (a
  shared bias's batch ``B``, not 1, tiled into the batch fold): values,
  ``grad`` of the vmap and ``vmap`` of ``grad`` (per-member bias
  cotangents where the bias is shared) against a loop over members of
  ``jax.nn.dot_product_attention``."""
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  qkv = [jax.random.normal(k, (2, _B, _T, _N, _H)) for k in keys[:3]]
  bias = jax.random.normal(keys[3], (2, 1 if in_axes[3] == 0 else _B, _N,
                                     _T, _T))
  args = [x if a == 0 else x[0] for x, a in zip([*qkv, bias], in_axes)]
  full = [x if a == 0 else jnp.broadcast_to(x, (2, *x.shape))
          for x, a in zip(args, in_axes)]
  vmapped = jax.vmap(attention.dot_product_attention, in_axes=in_axes)
  # One attention stage: products of H and T terms (XLA's einsums either
  # way, the same order): equal to a few eps. Everything jitted: eagerly,
  # each primitive is a program of its own (~150 for this test).
  tol = 4 * _T * np.finfo(np.float32).eps
  np.testing.assert_allclose(jax.jit(vmapped)(*args),
                             jax.jit(_loop_attention)(*full), rtol=0, atol=tol)
  loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
  argnums = (0, 1, 2, 3)
  got = jax.jit(jax.grad(loss(vmapped), argnums))(*args)
  want = jax.jit(jax.grad(loss(lambda *a: _loop_attention(*[
      x if ax == 0 else jnp.broadcast_to(x, (2, *x.shape))
      for x, ax in zip(a, in_axes)])), argnums))(*args)
  for x, y in zip(got, want, strict=True):
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=tol * max(1.0, float(np.abs(y).max())))
  per_member = jax.jit(jax.vmap(jax.grad(loss(
      attention.dot_product_attention), argnums), in_axes=in_axes))(*args)
  member = jax.jit(jax.grad(loss(jax.nn.dot_product_attention), argnums))
  want = [jnp.stack(g) for g in zip(*[member(*[x[i] for x in full])
                                      for i in range(2)])]
  for x, y in zip(per_member, want, strict=True):
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=tol * max(1.0, float(np.abs(y).max())))
  assert np.abs(got[3]).max() > 0.1  # the bias is trained


def test_uses_cudnn_reads_the_fmha_call_targets():
  text = ('%c = custom-call(%q), custom_call_target="__cudnn$fmhaScaleBias'
          'Softmax"\n%d = custom-call(), custom_call_target='
          '"__cudnn$fmhaScaleBiasSoftmaxBackward"')
  assert attention.uses_cudnn(text)
  assert attention.cudnn_fmha_targets(text) == [
      "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"]
  assert not attention.uses_cudnn("custom_call_target=\"__cublas$gemm\"")
  if jax.default_backend() == "cpu":
    q = jnp.zeros((1, 4, 1, 8))
    compiled = jax.jit(attention.dot_product_attention).lower(
        q, q, q, jnp.zeros((1, 1, 4, 4))).compile()
    assert not attention.uses_cudnn(compiled.as_text())
