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
