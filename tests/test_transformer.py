"""hmmprompt.backbones.transformer: the Flax masked LM and its backbone."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference  # tests/reference.py

from hmmprompt import hmm as hmm_lib
from hmmprompt import pretrain
from hmmprompt.backbones import transformer

TINY = pretrain.preset_config("tiny")


def test_model_shapes_and_split_forward():
  cfg = TINY.model
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  toks = jnp.array([[hmm_lib.MASK, 1, 2, 9]], jnp.int32)
  mlm = transformer.MLM(cfg)
  logits = mlm.apply(params, toks)
  assert logits.shape == (1, 4, 10) and logits.dtype == jnp.float32
  emb = mlm.apply(params, toks, method=transformer.MLM.embed)
  np.testing.assert_allclose(
      mlm.apply(params, emb, method=transformer.MLM.encode), logits,
      rtol=1e-6)
  # MASK (-1) and the explicit mask id V share one embedding row.
  alt = mlm.apply(params, toks.at[0, 0].set(cfg.mask_id),
                  method=transformer.MLM.embed)
  np.testing.assert_array_equal(alt, emb)
  bb = transformer.make_backbone(cfg)
  probs, full = jax.jit(bb.outputs)(params, toks[0],
                                    jnp.zeros((3, cfg.d_model)))
  assert probs.shape == (7, 10) and full.shape == (7, cfg.d_model)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="exceeds the model's context"):
    bb.apply(params, jnp.zeros((cfg.max_len + 1, cfg.d_model)))
  with pytest.raises(ValueError, match="out of range"):
    bb.embed(params, jnp.array([0, 10]))


@pytest.mark.parametrize("rel_pos,attention,layers", [
    pytest.param("none", "manual", 2, marks=pytest.mark.slow),
    ("bias", "manual", 2),
    pytest.param("alibi", "manual", 1, marks=pytest.mark.slow),
    pytest.param("none", "dot_product", 2, marks=pytest.mark.slow),
    pytest.param("alibi", "dot_product", 1, marks=pytest.mark.slow)])
def test_output_at_one_position_is_that_row_of_all(rel_pos, attention,
                                                   layers):
  """The linear head's path: the last block computes the MASK's row alone
  (``apply_at``), and equals the row of the full forward. The two differ
  only in the shapes of the same sums, so in float32 rounding: a dot
  product of ``n`` terms is within ``n * eps`` relative of its value
  (Higham's gamma_n), ``n`` <= ``d_ff`` = 64 here; probabilities <= 1."""
  cfg = dataclasses.replace(TINY.model, rel_pos=rel_pos, attention=attention,
                            num_layers=layers)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  # Weights far from the init, so every term (the offset bias too) counts.
  params = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(
      jax.random.PRNGKey(1), x.shape), params)
  bb = transformer.build_backbone(cfg)
  tokens_T = jax.random.randint(jax.random.PRNGKey(2), (9,), 0, 10)
  prompt = jax.random.normal(jax.random.PRNGKey(3), (3, cfg.d_model))
  full, _ = jax.jit(bb.outputs)(params, tokens_T, prompt)
  tol = cfg.d_ff * np.finfo(np.float32).eps
  for index in (0, 3, 11):
    row = jax.jit(bb.output_at, static_argnums=3)(params, tokens_T, prompt,
                                                  index)
    np.testing.assert_allclose(row, full[index], rtol=0, atol=tol)
    assert not np.allclose(full[index], full[(index + 1) % 12], atol=1e-3)
  with pytest.raises(ValueError, match="exceeds the model's context"):
    bb.apply_at(params, jnp.zeros((cfg.max_len + 1, cfg.d_model)), 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=30, num_heads=4), "divisible by num_heads"),
    (dict(dtype="float16"), "float32 or bfloat16"),
    (dict(num_layers=0), "num_layers must be >= 1"),
    (dict(pos_init="rope"), "pos_init must be one of"),
    (dict(attention="flash"), "MLMConfig.attention must be one of"),
])
def test_bad_model_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    transformer.MLMConfig(**kwargs)



@pytest.mark.slow
def test_train_flops_per_token_matches_xla_cost_analysis():
  # Two independent counts of one training step's FLOPs: our formula
  # (used for MFU) and XLA's cost analysis of the compiled gradient.
  cfg = transformer.MLMConfig(vocab_size=10, d_model=128, num_heads=4,
                              d_ff=512, num_layers=2, max_len=64)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  x_BxT = jnp.zeros((4, 64), jnp.int32)
  grad = jax.jit(jax.grad(lambda p: pretrain.mlm_loss(
      p, cfg, x_BxT, x_BxT, jnp.ones((4, 64)))))
  cost = grad.lower(params).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  ours = transformer.train_flops_per_token(cfg, 64) * 4 * 64
  assert 0.97 < cost["flops"] / ours < 1.1


def test_backbone_is_cached_per_config():
  # One Backbone object per config: it is a static jit argument of tuning,
  # so a second model of the same config reuses the compiled programs.
  a = transformer.make_backbone(TINY.model)
  b = transformer.make_backbone(transformer.MLMConfig(**{
      **TINY.model.__dict__}))
  assert a is b
  assert transformer.make_backbone(
      TINY.model.__class__(**{**TINY.model.__dict__, "d_model": 16})) is not a


def test_sinusoid_positions_are_relative_from_the_start():
  """``pos_init="sinusoid"``: the table's Gram matrix is Toeplitz (``t``
  with ``t + k`` depends on ``k`` alone), at BERT's init RMS; ``normal``
  has no such structure."""
  cfg = transformer.MLMConfig(vocab_size=10, d_model=16, num_heads=2, d_ff=32,
                              num_layers=1, max_len=12, pos_init="sinusoid")
  pos = np.asarray(transformer.init_params(jax.random.PRNGKey(0),
                                           cfg)["params"]["pos_embed"])
  assert pos.shape == (12, 16)
  np.testing.assert_allclose(np.sqrt(np.mean(pos ** 2)), 0.02, rtol=1e-5)
  gram = pos @ pos.T
  for k in range(12):
    diag = np.diagonal(gram, k)
    np.testing.assert_allclose(diag, diag[0], atol=1e-7)
  normal = np.asarray(transformer.init_params(
      jax.random.PRNGKey(0), transformer.MLMConfig(
          vocab_size=10, d_model=16, num_heads=2, d_ff=32, num_layers=1,
          max_len=12))["params"]["pos_embed"])
  assert np.ptp(np.diagonal(normal @ normal.T, 1)) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("pos_init", transformer.POS_INITS)
def test_jitted_init_equals_the_op_by_op_init(pos_init):
  """``init_params`` is one jitted program; the committed results were
  drawn from flax's op-by-op (eager) init with flax's normal initializer.
  The two agree bit for bit, stacked over trials as ``init_states`` does
  (without the barriers in the initializers, XLA's simplifier moves the
  embeddings' last bits)."""
  cfg = dataclasses.replace(TINY.model, pos_init=pos_init, max_len=12)
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  ids = jnp.zeros((1, 8), jnp.int32)
  op_by_op = jax.vmap(lambda k: transformer.MLM(cfg).init(k, ids))(keys)
  jitted = jax.vmap(lambda k: transformer.init_params(k, cfg))(keys)
  chex.assert_trees_all_equal(jitted, op_by_op)
  key, shape = jax.random.PRNGKey(1), (11, 16)
  chex.assert_trees_all_equal(transformer.normal_init(0.02)(key, shape),
                              jax.nn.initializers.normal(0.02)(key, shape))


# --- attention="dot_product": jax.nn.dot_product_attention, vmaps folded.

_ATT_CFG = transformer.MLMConfig(vocab_size=10, d_model=16, num_heads=2,
                                 d_ff=32, num_layers=2, max_len=12)
_B, _T, _N, _H = 3, 12, 2, 8


def _folded_attention_shapes(jaxpr):
  """Output shapes of every ``custom_vmap`` call in ``jaxpr`` (sub-jaxprs
  included): the attention calls left after the fold rules ran."""
  return [v.aval.shape for eqn in reference.custom_vmap_calls(jaxpr)
          for v in eqn.outvars]


def _apply(attention):
  cfg = dataclasses.replace(_ATT_CFG, attention=attention)
  return lambda params, toks: transformer.MLM(cfg).apply(params, toks)


def _loss(attention):
  # A scalar that weighs every logit differently, so all of the attention's
  # backward matters.
  return lambda params, toks: jnp.sum(jnp.sin(_apply(attention)(params,
                                                                 toks)))


def _assert_trees_close(a, b):
  # fp32 rounding of two orders of summation: 1e-5 of each leaf's scale
  # (the gradients reach ~200; the paths differ by ~3e-7 of that).
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
        x, y, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(y).max())))


# One vmap level is the inner level of the nested case (both fold).
@pytest.mark.slow
@pytest.mark.parametrize("stack", [(), (2, 2)], ids=["one", "nested_vmap"])
def test_dot_product_attention_matches_manual(stack):
  """Same logits and gradients (fp32) for one model, a vmapped stack of two
  and a 2 x 2 nested vmap (as pretraining's ``map_trials`` vmaps the step
  over trials); and the vmapped calls fold the stack into the batch: each
  attention call (2 layers: forward, and backward under grad) sees one
  ``[K*B, T, N, H]`` batch, never JAX's own batching of the op."""
  num = int(np.prod(stack, dtype=int))
  keys = jax.random.split(jax.random.PRNGKey(0), num).reshape(*stack, 2)
  init = lambda k: transformer.init_params(k, _ATT_CFG)
  for _ in stack:
    init = jax.vmap(init)
  params = init(keys)
  toks = jax.random.randint(jax.random.PRNGKey(1), (_B, _T), 0, 10)

  def over_stack(f):
    for _ in stack:
      f = jax.vmap(f, in_axes=(0, None))
    return f

  logits = {a: jax.jit(over_stack(_apply(a)))(params, toks)
            for a in ("manual", "dot_product")}
  assert logits["manual"].shape == (*stack, _B, _T, 10)
  _assert_trees_close(logits["dot_product"], logits["manual"])
  grads = {a: jax.jit(over_stack(jax.value_and_grad(_loss(a))))(params, toks)
           for a in ("manual", "dot_product")}
  _assert_trees_close(grads["dot_product"], grads["manual"])

  batch = num * _B
  fwd = _folded_attention_shapes(jax.make_jaxpr(over_stack(
      _apply("dot_product")))(params, toks))
  assert fwd == [(batch, _T, _N, _H)] * _ATT_CFG.num_layers
  bwd = _folded_attention_shapes(jax.make_jaxpr(over_stack(
      jax.grad(_loss("dot_product"))))(params, toks))
  # Per layer: the forward (out) and the backward (dq, dk, dv).
  assert sorted(bwd) == [(batch, _T, _N, _H)] * (4 * _ATT_CFG.num_layers)
  assert not _folded_attention_shapes(jax.make_jaxpr(over_stack(
      _apply("manual")))(params, toks))


@pytest.mark.slow
def test_dot_product_attention_folds_partly_batched_operands():
  """Unbatched operands are broadcast into the fold; ``grad`` of a vmap
  (cotangents of the unbatched ``k`` summed over the stack) and a vmap of
  ``grad`` both match the per-member loop."""
  q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 2, _B, _T, _N, _H))
  k = k[0]
  att = transformer.dot_product_attention
  vmapped = jax.vmap(att, in_axes=(0, None, 0))
  looped = lambda q, k, v: jnp.stack([att(q[i], k, v[i]) for i in range(2)])
  np.testing.assert_allclose(vmapped(q, k, v), looped(q, k, v), rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_allclose(
      vmapped(q, k, v), jnp.stack([jax.nn.dot_product_attention(
          q[i], k, v[i]) for i in range(2)]), rtol=1e-6, atol=1e-6)
  loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))
  _assert_trees_close(jax.grad(loss(vmapped), argnums=(0, 1, 2))(q, k, v),
                      jax.grad(loss(looped), argnums=(0, 1, 2))(q, k, v))
  per_member = jax.vmap(jax.grad(loss(att), argnums=(0, 1, 2)),
                        in_axes=(0, None, 0))(q, k, v)
  _assert_trees_close(per_member, [jnp.stack(g) for g in zip(*[
      jax.grad(loss(att), argnums=(0, 1, 2))(q[i], k, v[i])
      for i in range(2)])])
  assert _folded_attention_shapes(jax.make_jaxpr(vmapped)(q, k, v)) == [
      (2 * _B, _T, _N, _H)]


def test_auto_attention_is_manual_on_cpu():
  """On CPU ``"auto"`` traces the hand-written path, op for op."""
  if jax.default_backend() != "cpu":
    pytest.skip("CPU default")
  params = transformer.init_params(jax.random.PRNGKey(0), _ATT_CFG)
  toks = jnp.zeros((_B, _T), jnp.int32)
  assert _ATT_CFG.attention == "auto"
  assert _ATT_CFG.resolved_attention == "manual"
  assert (str(jax.make_jaxpr(_apply("auto"))(params, toks))
          == str(jax.make_jaxpr(_apply("manual"))(params, toks)))


def test_attention_is_left_out_of_the_pretraining_identity():
  """A runtime choice: directory names and fingerprints do not change."""
  cfg = pretrain.configure("tiny")
  ids = {a: cfg.with_overrides(model=dataclasses.replace(
      cfg.model, attention=a)) for a in transformer.ATTENTIONS}
  assert len({str(c.identity()) for c in ids.values()}) == 1
  assert "attention" not in cfg.identity()["model"]
  assert ids["dot_product"].to_json()["model"]["attention"] == "dot_product"


# --- An independent forward pass: the textbook pre-LN encoder in float64.


def _layer_norm(x, p):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def _dense(x, p):
  return x @ p["kernel"] + p["bias"]


def _gelu(x):  # flax's default, the tanh approximation
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _reference_forward(params, cfg, tokens_BxT):
  """``(logits [B, T, V], features [B, T, D])`` in float64 numpy, from the
  paper's description (Appendix D, BERT): the MASK id ``V`` for ``-1``,
  token plus absolute position embeddings, pre-LayerNorm blocks of
  softmax(Q K^T / sqrt(E) + relative term) V and a GELU MLP, each added to
  its input, a final LayerNorm, a linear output layer."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)["params"]
  b, t = tokens_BxT.shape
  d, a = cfg.d_model, cfg.num_heads
  e = d // a
  ids = np.where(tokens_BxT == hmm_lib.MASK, cfg.vocab_size, tokens_BxT)
  x = p["tok_embed"]["embedding"][ids] + p["pos_embed"][:t]
  offset_TxT = np.arange(t)[None, :] - np.arange(t)[:, None]  # j - i
  for i in range(cfg.num_layers):
    blk = p[f"block_{i}"]
    qkv = _dense(_layer_norm(x, blk["ln_attn"]), blk["qkv"])
    q, k, v = (qkv[..., s * d:(s + 1) * d].reshape(b, t, a, e)
               for s in range(3))
    logits_BxAxTxT = np.einsum("bqae,bkae->baqk", q, k) / np.sqrt(e)
    if cfg.rel_pos == "bias":
      logits_BxAxTxT += blk["rel_bias"][:, offset_TxT + cfg.max_len - 1]
    elif cfg.rel_pos == "alibi":
      slope_A = 2.0 ** (-8.0 * np.arange(1, a + 1) / a)
      logits_BxAxTxT -= slope_A[:, None, None] * np.abs(offset_TxT)
    w = np.exp(logits_BxAxTxT - logits_BxAxTxT.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("baqk,bkae->bqae", w, v).reshape(b, t, d)
    x = x + _dense(out, blk["attn_out"])
    h = _gelu(_dense(_layer_norm(x, blk["ln_mlp"]), blk["mlp_in"]))
    x = x + _dense(h, blk["mlp_out"])
  features = _layer_norm(x, p["ln_final"])
  return _dense(features, p["head"]), features


@pytest.mark.parametrize("rel_pos,attention,readout", [
    pytest.param("none", "manual", 0, marks=pytest.mark.slow),
    pytest.param("none", "dot_product", 0, marks=pytest.mark.slow),
    ("bias", "manual", 3),
    pytest.param("alibi", "manual", 0, marks=pytest.mark.slow),
    pytest.param("bias", "dot_product", 0, marks=pytest.mark.slow)])
def test_the_forward_pass_is_the_textbook_encoder(rel_pos, attention,
                                                  readout):
  """The model's float32 logits against :func:`_reference_forward` in
  float64, on weights far from their init (every LayerNorm, bias and
  offset term counts) and a batch with MASKs. Bound: each of a block's
  six dot-product stages (qkv, scores, values, out, MLP in, MLP out) and
  the output layer rounds within ``n * eps`` relative (Higham's
  gamma_n, ``n`` <= d_ff), so ``(6 L + 1) n eps`` on the output
  probabilities, which are at most 1; the LayerNorms renormalise what
  reaches each stage. The state readout reads the same features."""
  cfg = dataclasses.replace(TINY.model, num_layers=2, rel_pos=rel_pos,
                            attention=attention, state_readout=readout)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])
  tokens_BxT = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 9),
                                             -1, cfg.vocab_size))
  assert (tokens_BxT == hmm_lib.MASK).any()
  want_logits, features = _reference_forward(params, cfg, tokens_BxT)
  mlm = transformer.MLM(cfg)
  got = np.asarray(jax.jit(mlm.apply)(params, tokens_BxT), np.float64)
  softmax = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(
      z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
  tol = (6 * cfg.num_layers + 1) * cfg.d_ff * np.finfo(np.float32).eps
  np.testing.assert_allclose(softmax(got), softmax(want_logits), rtol=0,
                             atol=tol)
  assert np.abs(softmax(want_logits) - 1 / cfg.vocab_size).max() > 100 * tol
  if readout:
    _, states = jax.jit(lambda p, x: mlm.apply(
        p, x, method=transformer.MLM.logits_and_states))(params, tokens_BxT)
    want = _dense(features, jax.tree.map(
        lambda x: np.asarray(x, np.float64), params)["params"]["state_head"])
    np.testing.assert_allclose(softmax(np.asarray(states, np.float64)),
                               softmax(want), rtol=0, atol=tol)
  # The backbone interface gives the same probabilities, one sequence,
  # every row or one.
  bb = transformer.build_backbone(cfg)
  emb = jax.jit(bb.embed)(params, tokens_BxT[1])
  np.testing.assert_allclose(jax.jit(bb.apply)(params, emb),
                             softmax(want_logits[1]), rtol=0, atol=tol)
  for index in (0, 4, 8):
    np.testing.assert_allclose(
        jax.jit(bb.apply_at, static_argnums=2)(params, emb, index),
        softmax(want_logits[1, index]), rtol=0, atol=tol)


def test_relative_positions_on_short_inputs_are_the_textbook_ones():
  """The offset bias's two code paths (one position; a Toeplitz build for
  more) against the reference, at every length up to 5."""
  cfg = dataclasses.replace(TINY.model, num_layers=1, rel_pos="bias")
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  table = jax.random.normal(jax.random.PRNGKey(4), (cfg.num_heads,
                                                   2 * cfg.max_len - 1))
  params["params"]["block_0"]["rel_bias"] = table
  for t in range(1, 6):
    got = np.asarray(transformer.rel_bias(cfg, t, table))
    offsets = np.arange(t)[None, :] - np.arange(t)[:, None]
    np.testing.assert_array_equal(
        got, np.asarray(table)[:, offsets + cfg.max_len - 1])
    tokens = np.arange(t)[None] % cfg.vocab_size
    want, _ = _reference_forward(params, cfg, tokens)
    got_logits = np.asarray(jax.jit(transformer.MLM(cfg).apply)(
        params, tokens), np.float64)
    # The bound of the test above, one block.
    np.testing.assert_allclose(
        jax.nn.softmax(got_logits), jax.nn.softmax(want), rtol=0,
        atol=7 * cfg.d_ff * np.finfo(np.float32).eps)


def test_the_backbone_interface_describes_the_model():
  cfg = dataclasses.replace(TINY.model, dtype="bfloat16")
  bb = transformer.build_backbone(cfg)
  assert (bb.name, bb.embed_dim, bb.vocab_size, bb.finetunable) == (
      "transformer", cfg.d_model, cfg.vocab_size, True)
  assert transformer.make_backbone(cfg) is transformer.make_backbone(
      dataclasses.replace(cfg, dtype="float32"))  # tuning computes in fp32
  raw = jnp.ones((2, cfg.d_model))
  assert bb.prompt_embedding(raw) is raw
  params = transformer.init_params(jax.random.PRNGKey(0), TINY.model)
  # The context: max_len positions are accepted, one more is refused.
  bb.apply(params, jnp.zeros((cfg.max_len, cfg.d_model)))
  for call in (lambda e: bb.apply(params, e),
               lambda e: bb.apply_at(params, e, 0)):
    with pytest.raises(ValueError, match="^" + re.escape(
        f"input of {cfg.max_len + 1} positions exceeds the model's context "
        f"max_len = {cfg.max_len}") + "$"):
      call(jnp.zeros((cfg.max_len + 1, cfg.d_model)))
  with pytest.raises(ValueError, match="out of range"):
    bb.embed(params, jnp.array([0, cfg.vocab_size]))
  bb.embed(params, jnp.array([hmm_lib.MASK, cfg.vocab_size - 1]))


def test_the_paper_model_is_bert_base_width_with_six_layers():
  cfg = transformer.paper_config()
  assert (cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.d_ff,
          cfg.num_layers, cfg.max_len) == (10, 768, 12, 3072, 6, 512)
  assert transformer.paper_config(7, rel_pos="alibi") == dataclasses.replace(
      cfg, vocab_size=7, rel_pos="alibi")


def test_param_and_flop_counts_read_the_params_tree():
  """num_params is every leaf's size; the FLOPs per token are 6 x the
  matmul kernels' sizes (counted from the params, not from the formula's
  terms) plus 12 L T d for the score and value products."""
  cfg = dataclasses.replace(TINY.model, num_layers=2, vocab_size=7)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  flat = {jax.tree_util.keystr(p): x.size for p, x in
          jax.tree_util.tree_leaves_with_path(params)}
  assert transformer.num_params(params) == sum(flat.values())
  kernels = sum(n for name, n in flat.items() if name.endswith("['kernel']"))
  t = 20
  assert transformer.train_flops_per_token(cfg, t) == (
      6 * kernels + 12 * cfg.num_layers * t * cfg.d_model)


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "num_heads",
                                   "d_ff", "num_layers", "max_len"])
def test_every_size_is_refused_below_one_by_name(field):
  with pytest.raises(ValueError, match="^" + re.escape(
      f"MLMConfig.{field} must be >= 1, got 0") + "$"):
    transformer.MLMConfig(**{field: 0})


def test_the_config_refuses_unknown_choices_whole():
  for kwargs, message in (
      (dict(rel_pos="rope"), "MLMConfig.rel_pos must be one of ('none', "
       "'bias', 'alibi'), got 'rope'"),
      (dict(state_readout=-1), "MLMConfig.state_readout must be an int >= "
       "0, got -1"),
      (dict(state_readout=1.5), "MLMConfig.state_readout must be an int >= "
       "0, got 1.5"),
      (dict(dtype="float16"), "MLMConfig.dtype must be float32 or bfloat16, "
       "got 'float16'")):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
      transformer.MLMConfig(**kwargs)
  assert transformer.MLMConfig(dtype="bfloat16").compute_dtype == jnp.bfloat16
  assert transformer.MLMConfig(state_readout=0).state_readout == 0


@pytest.mark.slow  # 2.3 s: the full suite's
def test_bfloat16_computes_in_bfloat16_and_returns_float32():
  """``dtype="bfloat16"`` (accelerators): every matmul reads bf16 operands
  (an fp32 one would run at a fraction of the MXU's rate), the residual
  stream and the final LayerNorm are bf16, and the logits (and state
  logits) come back fp32, whichever entry point; the backbone interface
  computes in fp32 (tuning), as a float32 model does, unless asked for
  bf16 (a tuning arm's ``backbone_dtype``)."""
  cfg = dataclasses.replace(TINY.model, num_layers=2, dtype="bfloat16",
                            state_readout=3)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  tokens = jnp.array([[hmm_lib.MASK, 1, 2, 9]], jnp.int32)
  mlm = transformer.MLM(cfg)

  def dot_operand_dtypes(jaxpr):
    found = set()
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found |= {str(v.aval.dtype) for v in eqn.invars}
      for value in eqn.params.values():
        sub = getattr(value, "jaxpr", value)
        if hasattr(sub, "eqns"):
          found |= dot_operand_dtypes(sub)
    return found

  for method in (None, transformer.MLM.logits_and_states):
    jaxpr = jax.make_jaxpr(lambda p: mlm.apply(p, tokens, method=method))(
        params)
    assert dot_operand_dtypes(jaxpr.jaxpr) == {"bfloat16"}
  logits, inter = mlm.apply(params, tokens, capture_intermediates=True)
  assert logits.dtype == jnp.float32
  inter = inter["intermediates"]
  for i in range(cfg.num_layers):
    assert inter[f"block_{i}"]["__call__"][0].dtype == jnp.bfloat16
  assert inter["ln_final"]["__call__"][0].dtype == jnp.bfloat16
  both = mlm.apply(params, tokens, method=transformer.MLM.logits_and_states)
  assert [x.dtype for x in both] == [jnp.float32, jnp.float32]
  emb = mlm.apply(params, tokens, method=transformer.MLM.embed)
  assert mlm.apply(params, emb, 2, method=transformer.MLM.encode_at
                   ).dtype == jnp.float32
  assert mlm.apply(params, emb, method=transformer.MLM.encode
                   ).dtype == jnp.float32
  fp32 = dataclasses.replace(cfg, dtype="float32")
  in_bf16 = jax.nn.softmax(mlm.apply(params, emb, method=transformer.MLM.encode
                                     )[0], -1)
  for build in (transformer.build_backbone, transformer.make_backbone):
    got = build(cfg).apply(params, emb[0])
    np.testing.assert_array_equal(got, transformer.build_backbone(fp32).apply(
        params, emb[0]))
    assert not np.array_equal(got, in_bf16)
    # (The cached backbone once dropped the dtype asked for: float32.)
    np.testing.assert_array_equal(build(fp32, "bfloat16").apply(
        params, emb[0]), in_bf16)


@pytest.mark.parametrize("query", [pytest.param(None, marks=pytest.mark.slow),
                                   3])
def test_a_causal_model_reads_no_later_position(query):
  """With ``causal``, changing the tokens after position t leaves every
  output at positions <= t unchanged bit for bit (the masked logits'
  softmax weights are exact zeros), the single-row path included; the
  bidirectional model's outputs move."""
  cfg = dataclasses.replace(TINY.model, causal=True, num_layers=2,
                            rel_pos="bias", attention="auto")
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  params = jax.tree.map(lambda x: x + 0.1, params)  # a nonzero rel bias
  a = jnp.array([[1, 2, 3, 4, 5, 6]])
  b = a.at[0, 4:].set(jnp.array([9, 0]))
  for c, moved in ((cfg, False), (dataclasses.replace(cfg, causal=False),
                                  True)):
    mlm = transformer.MLM(c)
    if query is None:
      out_a, out_b = (mlm.apply(params, x)[:, :4] for x in (a, b))
    else:
      out_a, out_b = (mlm.apply(params, mlm.apply(
          params, x, method=transformer.MLM.embed), query,
                                method=transformer.MLM.encode_at)
                      for x in (a, b))
    same = np.array_equal(np.asarray(out_a), np.asarray(out_b))
    assert same != moved, c.causal


@pytest.mark.slow
def test_a_causal_models_logits_have_zero_gradient_in_later_inputs():
  """``d logits[t] / d embedding[s]`` is exactly zero for every ``s > t``
  (and not for ``s <= t``): no path from a later token, prefix keys aside."""
  cfg = dataclasses.replace(TINY.model, causal=True, num_layers=2)
  params = transformer.init_params(jax.random.PRNGKey(1), cfg)
  mlm = transformer.MLM(cfg)
  emb = mlm.apply(params, jnp.array([[1, 2, 3, 4, 5, 6]]),
                  method=transformer.MLM.embed)
  jac = jax.jacrev(lambda e: mlm.apply(params, e, method=transformer.MLM.encode)
                   )(emb)  # [1, T, V, 1, T, D]
  reach = np.abs(np.asarray(jac)[0, :, :, 0]).sum((1, 3))  # [t, s]
  later = np.triu(np.ones_like(reach, bool), 1)
  assert np.all(reach[later] == 0) and np.all(reach[~later] > 0)
