"""hmmprompt.backbones.transformer: the Flax masked LM and its backbone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
  probs, full = bb.outputs(params, toks[0], jnp.zeros((3, cfg.d_model)))
  assert probs.shape == (7, 10) and full.shape == (7, cfg.d_model)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="exceeds the model's context"):
    bb.apply(params, jnp.zeros((cfg.max_len + 1, cfg.d_model)))
  with pytest.raises(ValueError, match="out of range"):
    bb.embed(params, jnp.array([0, 10]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=30, num_heads=4), "divisible by num_heads"),
    (dict(dtype="float16"), "float32 or bfloat16"),
    (dict(num_layers=0), "num_layers must be >= 1"),
    (dict(pos_init="rope"), "pos_init must be one of"),
])
def test_bad_model_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    transformer.MLMConfig(**kwargs)



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
