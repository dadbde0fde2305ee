"""The recipe options of issue 30's hard set (experiments/hard_set.py):
named, off by default, and out of the identity while off."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import pretrain
from hmmprompt.backbones import transformer
from hmmprompt.pretrain import train

TINY = pretrain.preset_config("tiny")


def test_added_fields_leave_the_identity_until_set():
  for name in set(pretrain.PRESETS) - {"cpu_capped"}:  # it sets them
    ident = pretrain.preset_config(name).identity()
    assert "rel_pos" not in ident["model"]
    assert "state_readout" not in ident["model"]
    assert "train_mask_rate" not in ident["corpus"]
    for key in ("optimizer", "state_loss", "state_loss_steps"):
      assert key not in ident
  moved = TINY.with_overrides(model=dataclasses.replace(TINY.model,
                                                        rel_pos="bias"))
  assert moved.identity()["model"]["rel_pos"] == "bias"
  assert moved.identity() != TINY.identity()
  capped = pretrain.preset_config("cpu_capped").identity()
  assert (capped["model"]["rel_pos"], capped["corpus"]["train_mask_rate"],
          capped["optimizer"]) == ("bias", 0.4, "muon")
  assert "state_loss" not in capped  # MLM pretraining: no latent state


@pytest.mark.parametrize("t", [1, 2, 5, 32])
def test_rel_bias_is_the_toeplitz_of_the_table(t):
  cfg = dataclasses.replace(TINY.model, rel_pos="bias")
  table = jax.random.normal(jax.random.PRNGKey(0),
                            (cfg.num_heads, 2 * cfg.max_len - 1))
  off = np.arange(t)[None, :] - np.arange(t)[:, None]
  np.testing.assert_array_equal(transformer.rel_bias(cfg, t, table),
                                np.asarray(table)[:, off + cfg.max_len - 1])
  alibi = transformer.rel_bias(dataclasses.replace(cfg, rel_pos="alibi"), t)
  slope = 2.0 ** (-8.0 / cfg.num_heads)  # the first head's
  np.testing.assert_allclose(alibi[0], -slope * np.abs(off), rtol=1e-6)


def test_zero_bias_is_the_model_without_it():
  """``rel_pos="bias"`` starts at 0: the same logits as without it."""
  params = transformer.init_params(jax.random.PRNGKey(0), TINY.model)
  cfg = dataclasses.replace(TINY.model, rel_pos="bias")
  with_bias = transformer.init_params(jax.random.PRNGKey(0), cfg)
  toks = jnp.array([[hmm_lib.MASK, 1, 2, 9, 3]], jnp.int32)
  logits = lambda c, p: jax.jit(transformer.MLM(c).apply)(p, toks)
  np.testing.assert_allclose(logits(cfg, with_bias),
                             logits(TINY.model, params), rtol=1e-5, atol=1e-6)


def test_train_mask_rate_masks_training_batches_only():
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(0), 4, 10)
  cfg = TINY.corpus
  dense = dataclasses.replace(cfg, train_mask_rate=0.6)
  key = jax.random.PRNGKey(1)
  _, _, w = corpus_lib.batch_at(key, 0, hmm, None, cfg, 64, 10)
  _, _, w_dense = corpus_lib.batch_at(key, 0, hmm, None, dense, 64, 10)
  assert float(w.mean()) < 0.25 < 0.45 < float(w_dense.mean())
  base = pretrain.evaluation.validation_set(key, hmm, TINY)
  other = pretrain.evaluation.validation_set(
      key, hmm, TINY.with_overrides(corpus=dense))
  np.testing.assert_array_equal(base.weights, other.weights)


@pytest.mark.slow
def test_state_loss_steps_and_needs_a_readout():
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(0), 4, 10)
  cfg = TINY.with_overrides(state_loss=1.0, targets="exact")
  with pytest.raises(ValueError, match="^PretrainConfig.state_loss needs "
                     "model.state_readout = the generating HMM's number of "
                     "states$"):
    train.make_train_step(cfg, pretrain.loop.sharding_lib.data_mesh())
  cfg = cfg.with_overrides(model=dataclasses.replace(cfg.model,
                                                     state_readout=4))
  step = train.make_train_step(cfg, pretrain.loop.sharding_lib.data_mesh())
  states = train.init_states(jax.random.split(jax.random.PRNGKey(0), 1), cfg)
  inputs, tokens, weights = corpus_lib.batch_at(
      jax.random.PRNGKey(2), 0, hmm, None, cfg.corpus, cfg.batch_size, 10)
  hmms = jax.tree.map(lambda x: x[None], hmm)
  states, loss = step(states, inputs[None], tokens[None], weights[None],
                      hmms)
  assert np.isfinite(np.asarray(loss)).all()
  post = corpus_lib.exact_state_posterior(hmm, inputs[0], weights[0])
  np.testing.assert_allclose(post.sum(-1), 1.0, rtol=1e-5)


_STATE_LOSS = TINY.with_overrides(state_loss=1.0, targets="exact", model=(
    dataclasses.replace(TINY.model, state_readout=4)))


def test_exact_method_is_runtime_and_refused_by_name():
  """``exact_method`` is out of the identity, and refused by name when
  unknown."""
  cfg = _STATE_LOSS
  assert cfg.with_overrides(exact_method="parallel").identity() == (
      cfg.identity())
  with pytest.raises(ValueError, match=r"^PretrainConfig.exact_method must "
                     r"be one of \(.sequential., .parallel., .blocked., .auto.\), "
                     r"got "
                     r"'fast'$"):
    cfg.with_overrides(exact_method="fast")


@pytest.mark.slow  # 2.0 s; the kernels' agreement is test_hmm's
def test_the_kernels_give_the_same_step():
  """``exact_method`` picks the kernel of the exact targets and the state
  loss's posterior: one training step's loss is the same with either
  kernel to the targets' rounding (each target ~H log2(T) eps from the
  other, tests/test_hmm.py; the CE moves by at most V times that times the
  largest -log p, < 1e-4)."""
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(0), 4, 10)
  cfg = _STATE_LOSS
  inputs, tokens, weights = corpus_lib.batch_at(
      jax.random.PRNGKey(2), 0, hmm, None, cfg.corpus, cfg.batch_size, 10)
  hmms = jax.tree.map(lambda x: x[None], hmm)
  losses = {}
  for method in ("sequential", "parallel", "blocked", "auto"):
    step = train.make_train_step(cfg.with_overrides(exact_method=method),
                                 pretrain.loop.sharding_lib.data_mesh())
    # A fresh stack each time: the step donates its states.
    states = train.init_states(jax.random.split(jax.random.PRNGKey(0), 1),
                               cfg)
    _, losses[method] = step(states, inputs[None], tokens[None],
                             weights[None], hmms)
  for method in ("parallel", "blocked"):
    np.testing.assert_allclose(losses[method], losses["sequential"],
                               atol=1e-4)
  # auto is the scan on a CPU at this length: bit for bit.
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(losses["auto"], losses["sequential"])


def test_state_loss_is_the_mlm_loss_plus_its_weight_times_the_readout_ce():
  """``(total, mlm)``: ``mlm`` is :func:`train.mlm_loss` on the same
  distributions (its mean over the weighted positions: one weighted
  position gives that position's CE), and ``total - mlm`` is
  ``state_weight`` times the readout's CE to the posterior, averaged over
  every position, computed here in float64 from the model's own logits."""
  cfg = dataclasses.replace(TINY.model, state_readout=3)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  rng = np.random.default_rng(0)
  b, t = 2, 6
  inputs = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
  targets = rng.dirichlet(np.ones(cfg.vocab_size), (b, t)).astype(np.float32)
  posterior = rng.dirichlet(np.ones(3), (b, t)).astype(np.float32)
  # Jitted: one program each, not a compile per op.
  logits, states = jax.jit(lambda p: transformer.MLM(cfg).apply(
      p, inputs, method=transformer.MLM.logits_and_states))(params)
  both = jax.jit(train.mlm_and_state_loss, static_argnums=1)
  mlm_loss = jax.jit(train.mlm_loss, static_argnums=1)
  log_softmax = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))
  ce = lambda z, p: -(p * log_softmax(np.asarray(z, np.float64))).sum(-1)
  one = np.zeros((b, t), np.float32)
  one[1, 4] = 1.0
  for weights in ((rng.random((b, t)) < 0.5).astype(np.float32), one):
    total, mlm = both(params, cfg, inputs, targets, weights, posterior, 0.3)
    np.testing.assert_allclose(
        mlm, mlm_loss(params, cfg, inputs, targets, weights), rtol=1e-6)
    want = (ce(logits, targets) * weights).sum() / weights.sum()
    np.testing.assert_allclose(mlm, want, rtol=1e-5)
    # float32 sums of O(1) terms (~1e-7 each), then the difference of two
    # float32 values ~10x the aux term: ~1e-6 of it; 1e-4 leaves room.
    np.testing.assert_allclose(total - mlm, 0.3 * ce(states, posterior).mean(),
                               rtol=1e-4)


@pytest.mark.slow
def test_the_state_loss_moves_the_step_until_state_loss_steps():
  """Two steps from the same state: a state loss moves the params
  otherwise than none does (the readout learns only from it), and with
  ``state_loss_steps = S`` its weight falls linearly to 0 at step ``S``:
  the steps are then those without it (float rounding: the two programs
  compute the logits through different methods)."""
  hmm = hmm_lib.random_hmm(jax.random.PRNGKey(0), 4, 10)
  # Sampled targets: the step still needs the HMMs, for the posterior.
  base = TINY.with_overrides(model=dataclasses.replace(TINY.model,
                                                       state_readout=4))
  assert base.targets == "sampled"
  inputs, tokens, weights = corpus_lib.batch_at(
      jax.random.PRNGKey(2), 0, hmm, None, base.corpus, base.batch_size, 10)
  hmms = jax.tree.map(lambda x: x[None], hmm)

  def state_after(at_step, steps, **overrides):
    # A fresh state each time: the step donates (consumes) its input.
    start = train.init_states(jax.random.split(jax.random.PRNGKey(0), 1),
                              base)
    start = dataclasses.replace(start, step=start.step + at_step)
    step = train.make_train_step(base.with_overrides(**overrides),
                                 pretrain.loop.sharding_lib.data_mesh())
    for _ in range(steps):
      start, _ = step(start, inputs[None], tokens[None], weights[None], hmms)
    return start

  # Two steps: the warmup's first learning rate is 0.
  params_after = lambda at, **kw: state_after(at, 2, **kw).params

  constant = 0.5 * 4 / 7  # the ramp's weight at step 3 of 7 (below)
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)),
                       params_after(0, state_loss=constant), params_after(0))
  assert all(jax.tree.leaves(moved["params"]["state_head"])), moved
  close = lambda a, b: jax.tree.map(
      lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7),
      a, b)
  close(params_after(7, state_loss=0.5, state_loss_steps=7), params_after(7))
  # Mid-ramp, at step 3 of 7, the weight is 0.5 * 4 / 7: the first step's
  # gradients (in the optimizer's moments) are those of that constant.
  close(state_after(3, 1, state_loss=0.5, state_loss_steps=7).opt_state,
        state_after(3, 1, state_loss=constant).opt_state)


@pytest.mark.slow  # two optimizer programs: ~5 CPU-s cold
def test_muon_orthogonalises_matrix_updates_and_both_optimizers_decay():
  """``optimizer="muon"`` (cpu_capped's): a matrix's update is near
  orthogonal (Newton-Schulz's few iterations: its singular values within
  1.8x of each other here, AdamW's sign-like first update of the same
  32 x 64 matrix 4.7x, on jax 0.10 / optax's muon), and with zero
  gradients every leaf, matrix or not, decays by lr x weight_decay under
  either optimizer."""
  params = transformer.init_params(jax.random.PRNGKey(0), TINY.model)
  grads = jax.tree.map(
      lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params)
  zeros = jax.tree.map(jnp.zeros_like, params)

  spread = {}
  for name in ("muon", "adamw"):
    cfg = TINY.with_overrides(optimizer=name, weight_decay=0.1)
    opt = train.make_optimizer(cfg)

    @jax.jit  # one program per optimizer, not a compile per op
    def second_update(g, opt=opt):
      _, state = opt.update(g, opt.init(params), params)  # warmup's lr 0
      return opt.update(g, state, params)[0]

    s = np.linalg.svd(np.asarray(second_update(grads)["params"]["block_0"]
                                 ["mlp_in"]["kernel"]), compute_uv=False)
    spread[name] = s.max() / s.min()
    lr_wd = float(train.lr_schedule(cfg)(1)) * 0.1
    jax.tree.map(lambda u, p: np.testing.assert_allclose(
        u, -lr_wd * p, rtol=1e-5, atol=1e-9), second_update(zeros), params)
  assert spread["muon"] < 3.0 < spread["adamw"], spread
