import jax
import numpy as np
import pytest

from hmmprompt import heads


def test_registries_are_named_interfaces():
  assert tuple(heads.HEADS) == ("linear", "attention")
  assert heads.FEATURES == tuple(heads.TRANSFORMS) == (
      "raw", "log", "standardized")
  for name, head in heads.HEADS.items():
    assert head.name == name
  for name, feats in heads.TRANSFORMS.items():
    assert feats.name == name
  assert [n for n, f in heads.TRANSFORMS.items() if f.needs_stats] == [
      "standardized"]


def test_heads_wrap_the_public_functions():
  assert heads.ATTENTION.init is heads.init_attention
  assert heads.ATTENTION.apply is heads.apply_attention
  assert heads.ATTENTION.reads_all_positions
  assert not heads.LINEAR.reads_all_positions
  lin = heads.LINEAR.init(jax.random.PRNGKey(0), 5, 3, 7)
  assert lin["w"].shape == (5, 2)
  lin = {"w": np.arange(10.0).reshape(5, 2), "bias": np.ones(2)}
  feats_V = np.linspace(0.0, 1.0, 5)
  np.testing.assert_array_equal(heads.LINEAR.apply(lin, feats_V, None),
                                heads.apply_linear(lin, feats_V))


def test_transform():
  probs = np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])
  np.testing.assert_array_equal(heads.transform(probs, "raw", None), probs)
  np.testing.assert_allclose(heads.transform(probs, "log", None),
                             np.log(np.asarray(probs) + 1e-6), rtol=1e-6)
  std = heads.transform(probs, "standardized", heads.feature_stats(probs))
  np.testing.assert_allclose(std.mean(0), 0.0, atol=1e-6)
  with pytest.raises(ValueError, match="unknown feature transform"):
    heads.transform(probs, "sqrt", None)


@pytest.mark.parametrize("name", ["linear", "attention"])
def test_every_head_gives_one_logit_per_class(name):
  """Tasks are binary (``heads.NUM_CLASSES``): a head's logits are ``[2]``
  whatever the sizes, on the inputs the head says it reads."""
  head = heads.HEADS[name]
  v, d, t = 5, 3, 7
  params = head.init(jax.random.PRNGKey(0), v, d, t)
  probs_TxV = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (t, v)))
  if head.reads_all_positions:
    logits = head.apply(params, probs_TxV, np.ones((t, d)))
  else:
    logits = head.apply(params, probs_TxV[0], None)
  assert logits.shape == (heads.NUM_CLASSES,)


def test_attention_init_sizes_and_scales():
  """Eq. 4.1's sizes: keys of ``|H| + 1`` dimensions (``embed_dim + 1``:
  Theorem 4.6's construction needs one more than the states), a position
  bias per input position, and every random matrix at fan-in scale
  (std ``1 / sqrt(fan_in)``: scores and values start O(1), the softmax
  neither saturated nor flat whatever ``V`` and ``D``)."""
  v, d, t = 400, 300, 9
  p = heads.init_attention(jax.random.PRNGKey(0), v, d, t)
  assert p["theta_k"].shape == (d + 1, v) and p["beta"].shape == (t, d + 1)
  assert p["q"].shape == (d + 1,) and p["theta_v"].shape == (d, v)
  assert p["b"].shape == (d, heads.NUM_CLASSES)
  for name, fan_in in (("theta_k", v), ("q", d + 1), ("theta_v", v),
                       ("b", d)):
    np.testing.assert_allclose(np.std(p[name]), fan_in ** -0.5, rtol=0.1,
                               err_msg=name)
  assert not np.any(p["beta"]) and float(p["log_temp"]) == 0.0


def test_attention_reads_the_first_positions_of_its_bias():
  """An input shorter than the head was built for (a truncated example)
  uses the first ``T`` position biases: the same as a head built for
  ``T``, with those rows."""
  v, d = 5, 3
  long = heads.init_attention(jax.random.PRNGKey(0), v, d, 9)
  long["beta"] = jax.random.normal(jax.random.PRNGKey(2), long["beta"].shape)
  short = dict(long, beta=long["beta"][:6])
  feats_TxV = jax.random.uniform(jax.random.PRNGKey(1), (6, v))
  emb_TxD = jax.random.uniform(jax.random.PRNGKey(3), (6, d))
  np.testing.assert_allclose(heads.apply_attention(long, feats_TxV, emb_TxD),
                             heads.apply_attention(short, feats_TxV, emb_TxD),
                             rtol=1e-6)
