"""hmmprompt.icl and the causal LM's pretraining: the exact in-context
predictor against brute force, the causal targets against the likelihood,
stacked causal pretraining against separate runs, and the experiment end
to end (resume, report, no NaN)."""

import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import corpus
from hmmprompt import files as files_lib
from hmmprompt import generative
from hmmprompt import ginc
from hmmprompt import hmm as hmm_lib
from hmmprompt import icl
from hmmprompt import pretrain
from hmmprompt.pretrain import evaluation
from hmmprompt.pretrain import train
from hmmprompt.backbones import transformer

SMALL = ginc.GincConfig(num_values=3, num_slots=4, num_symbols=8,
                        num_concepts=4)


def _tiny_concepts(zeros: bool) -> hmm_lib.HMM:
  """2 concepts of 3 states over 3 symbols: dense, or (``zeros``) each a
  lazy cycle (one clockwise, one not) emitting its state's own symbol, so
  that some prompts are impossible under both."""
  if zeros:
    eye, cycle = np.eye(3), np.roll(np.eye(3), 1, 1)
    return hmm_lib.HMM(jnp.full((2, 3), 1 / 3), jnp.asarray(
        [0.5 * eye + 0.5 * cycle, 0.5 * eye + 0.5 * cycle.T], jnp.float32),
                       jnp.asarray([eye, eye], jnp.float32))
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(3, 2, 3, 3)) + 0.05
  x /= x.sum(-1, keepdims=True)
  return hmm_lib.HMM(*(jnp.asarray(a, jnp.float32)
                       for a in (x[0, :, 0], x[1], x[2])))


def _brute_force(concepts, prompt):
  """``(next [X], P(prompt))`` summing every concept's every hidden path of
  ``T + 1`` states (the concepts apart: no mixture, no forward pass)."""
  init, trans, emit = (np.asarray(a, np.float64) for a in concepts)
  num, h = init.shape
  joint = np.zeros(emit.shape[-1])
  for c in range(num):
    for path in itertools.product(range(h), repeat=len(prompt) + 1):
      p = init[c, path[0]] / num
      for t, x in enumerate(prompt):
        p *= emit[c, path[t], x] * trans[c, path[t], path[t + 1]]
      joint += p * emit[c, path[-1]]
  return joint, joint.sum()


@pytest.mark.parametrize("zeros", [False, True])
def test_the_mixture_predictive_equals_brute_force_enumeration(zeros):
  """:func:`ginc.predict` on the block-diagonal mixture equals summing
  every path of every concept, prompt by prompt; an impossible prompt gives
  zeros and ``-inf``, no NaN."""
  concepts = _tiny_concepts(zeros)
  mix = ginc.mixture(concepts)
  prompts = np.asarray(list(itertools.product(range(3), repeat=4)))
  nxt_all = np.asarray(ginc.predict_all(mix, jnp.asarray(prompts, jnp.int32)))
  ll_all = np.asarray(jax.jit(jax.vmap(lambda t: ginc.predict(mix, t)[1]))(
      jnp.asarray(prompts, jnp.int32)))
  assert np.all(np.isfinite(nxt_all))
  seen_impossible = False
  for prompt, nxt, ll in zip(prompts, nxt_all, ll_all):
    joint, total = _brute_force(concepts, prompt)
    if total == 0:
      seen_impossible = True
      assert ll == -np.inf and np.all(nxt == 0)
    else:
      # float32 messages over 5 steps of 6 states: each normalised product
      # is off by a few ulps a step (~1e-6); 2e-5 is ten times that.
      np.testing.assert_allclose(nxt, joint / total, atol=2e-5)
      np.testing.assert_allclose(ll, np.log(total), rtol=1e-4)
  assert seen_impossible == zeros


def test_causal_targets_chain_to_the_documents_likelihood():
  """A causal model's held-out set reads ``[MASK, x_0, ..]`` at every
  position, and its exact targets chain to the likelihood: ``sum_t -log
  P[x_t | x_<t] = -log P(x)`` (forward-backward's, computed apart); the
  training batch is shifted the same way."""
  concepts, _ = ginc.concepts(jax.random.PRNGKey(1), SMALL)
  mix = ginc.mixture(jax.tree.map(lambda x: x[:2], concepts))
  cfg = pretrain.configure("tiny", SMALL.num_symbols,
                           model={"causal": True}, targets="exact")
  val = evaluation.validation_set(jax.random.PRNGKey(2), mix, cfg)
  seqs = np.asarray(val.targets)
  assert np.all(np.asarray(val.inputs)[:, 0] == hmm_lib.MASK)
  np.testing.assert_array_equal(np.asarray(val.inputs)[:, 1:], seqs[:, :-1])
  assert np.all(np.asarray(val.weights) == 1)
  chained = -np.log(np.take_along_axis(np.asarray(val.exact, np.float64),
                                       seqs[..., None], -1)[..., 0]).sum(-1)
  ll = np.asarray(jax.vmap(lambda t: hmm_lib.log_likelihood(mix, t))(
      val.targets))
  # Each float32 target is off by ~1e-6 relative, so each -log by ~1e-6
  # absolute; 32 of them sum to tens of nats: 1e-4 relative is >= 1e-3.
  np.testing.assert_allclose(chained, -ll, rtol=1e-4)
  inputs, tokens, weights = corpus.batch_at(
      jax.random.PRNGKey(3), 0, mix, None, cfg.corpus, 4, SMALL.num_symbols,
      causal=True)
  np.testing.assert_array_equal(np.asarray(inputs)[:, 1:],
                                np.asarray(tokens)[:, :-1])
  assert np.all(np.asarray(inputs)[:, 0] == hmm_lib.MASK)
  assert np.all(np.asarray(weights) == 1)


@pytest.mark.slow  # three pretraining runs (~15 s)
@pytest.mark.default_compiler
def test_stacked_causal_pretraining_equals_separate_runs(tmp_path):
  """Two stacked causal LMs on a GINC mixture equal the two runs alone bit
  for bit (trial 1 with seed + 1), and their CE gap falls."""
  concepts, _ = ginc.concepts(jax.random.PRNGKey(1), SMALL)
  mix = ginc.mixture(jax.tree.map(lambda x: x[:2], concepts))
  cfg = pretrain.configure("tiny", SMALL.num_symbols, model={"causal": True},
                           targets="exact", steps=20, eval_every=10)
  stacked = generative.stack([mix, mix])
  final = pretrain.run_trials(str(tmp_path / "both"), cfg, stacked,
                              log=lambda s: None)
  _, params_k, _ = pretrain.load_trials(str(tmp_path / "both"))
  for k in range(2):
    alone = str(tmp_path / f"alone{k}")
    m = pretrain.run(alone, dataclasses.replace(cfg, seed=cfg.seed + k), mix,
                     log=lambda s: None)
    assert m["ce_gap"] == final[k]["ce_gap"]
    for a, b in zip(jax.tree.leaves(params_k),
                    jax.tree.leaves(pretrain.load_backbone(alone)[1])):
      np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b))
  with open(os.path.join(alone, "metrics.jsonl")) as f:
    gaps = [json.loads(line)["ce_gap"] for line in f if "ce_gap" in line]
  assert gaps[-1] < gaps[0]


def _setup(**kw) -> icl.IclSetup:
  tiny = icl.get_setup("tiny")
  return dataclasses.replace(tiny, lengths=(3,), examples=(0, 2, 12),
                             prompts=8, pretrain=tiny.pretrain.with_overrides(
                                 steps=10, eval_every=10), **kw)


@pytest.mark.slow  # a pretraining and two backbones' cells (~20 s)
def test_the_experiment_runs_resumes_and_reports(tmp_path):
  """Every planned line is written once (the prompt of 12 examples only
  for the exact backbone: it is past the transformer's context); the exact
  lines are :func:`ginc.icl_accuracy` of the cell's prompts; nothing is NaN;
  a rerun adds nothing; another setup's workdir is refused."""
  setup, workdir = _setup(), str(tmp_path)
  lines = icl.run_icl(setup, workdir)
  keys = {r.key() for r in lines}
  assert len(keys) == len(lines) == sum(
      len(g.keys(setup)) for gs in icl.plan(setup).values() for g in gs)
  assert not any(r.backbone == "transformer" and r.examples == 12
                 for r in lines)
  assert {r.examples for r in lines if r.backbone == "exact"} == {0, 2, 12}
  concepts = {kind: icl.load_concepts(setup, kind) for kind in ("id", "ood")}
  for r in lines:
    assert all(np.isfinite([r.test_accuracy, r.impossible, r.label_prob,
                            r.ce_gap]))
    assert r.test_accuracy <= 1 - r.impossible
    if r.backbone == "exact":
      want = ginc.icl_accuracy(icl.exact_model(concepts["id"], r.variant),
                               icl.cell_prompts(setup, concepts, r.protocol,
                                                r.length, r.examples))
      assert (r.test_accuracy, r.impossible) == (want["accuracy"],
                                                 want["impossible"])
      assert r.kl == 0 if r.variant == icl.REFERENCE else (
          r.kl is None or r.kl >= 0)
    else:
      assert r.impossible == 0 and r.ce_gap > 0 and r.kl > 0
  assert any(r.impossible > 0 for r in lines)  # exact zeros at k = 12
  assert icl.run_icl(setup, workdir) == lines
  # Lines lost (a kill before their append) are made again, the same.
  path = icl.lines_path(workdir)
  with open(path) as f:
    kept = [line for line in f if '"transformer"' not in line]
  with open(path, "w") as f:
    f.writelines(kept)
  timeless = lambda rs: sorted(str(dataclasses.replace(r, seconds=0.0))
                               for r in rs)
  assert timeless(icl.run_icl(setup, workdir)) == timeless(lines)
  text = icl.write_report(workdir)
  assert "ID_sample" in text and "transformer" in text
  assert os.path.exists(os.path.join(workdir, "icl.png"))
  with pytest.raises(ValueError, match="prompts"):
    icl.run_icl(dataclasses.replace(setup, prompts=9), workdir)


def test_the_concept_posterior_concentrates_on_the_generating_concept():
  """Documents of the mixture: the posterior over concepts puts more mass
  on the generating concept as the document grows, over 0.99 at 512."""
  concepts, _ = ginc.concepts(jax.random.PRNGKey(5), SMALL)
  concepts = jax.tree.map(lambda x: x[:2], concepts)
  mix, h = ginc.mixture(concepts), concepts.initial.shape[1]
  docs = jax.vmap(lambda k: hmm_lib.sample(k, mix, 512))(
      jax.random.split(jax.random.PRNGKey(6), 8))
  post = jax.vmap(ginc.concept_posterior, in_axes=(None, 0))
  source = np.asarray(docs[1][:, 0]) // h
  on_source = {n: np.asarray(post(concepts, docs[0][:, :n]))[
      np.arange(8), source] for n in (4, 512)}
  assert on_source[512].min() > 0.99
  assert on_source[4].mean() < on_source[512].mean()


MID = ginc.GincConfig(num_values=6, num_slots=8, num_symbols=30,
                      num_concepts=8)


@pytest.mark.slow
def test_examples_sharpen_the_concept_belief_only_when_smoothed_per_concept():
  """GINC's prompts, each from one concept: smoothed inside each concept
  (``concept:1e-06``) the mixture keeps exact zeros between concepts, so
  the examples are evidence and the posterior mass on the prompt's concept
  (at its last symbol) grows from k = 0 to k = 8 in the mean over prompts;
  smoothed across concepts (``mixture:1e-06``), a delimiter's jump costs
  the same whether the concept changes or not, and it does not grow. (The
  old reference smoothed the mixture: its curve was flat in k.)"""
  concepts, _ = ginc.concepts(jax.random.PRNGKey(0), MID)
  ids = jax.tree.map(lambda x: x[:4], concepts)
  k_, h = ids.initial.shape
  memory = jnp.argmax(ids.emission[0], -1).reshape(6, 8)
  per_concept = icl.exact_model(ids, "concept:1e-06").transition
  blocks = np.kron(np.eye(k_), np.ones((h, h))) > 0
  assert np.all(np.asarray(per_concept)[~blocks] == 0)
  assert np.all(np.asarray(icl.exact_model(ids, "mixture:1e-06").transition
                           )[~blocks] > 0)
  mass = {}
  for variant in ("concept:1e-06", "mixture:1e-06"):
    model = icl.exact_model(ids, variant)
    for k in (0, 8):
      batch = ginc.prompts(jax.random.PRNGKey(k), ids, memory, "ID_sample",
                           k, 5, 96)
      post = jax.vmap(lambda t, m=model: hmm_lib.token_smooth(
          m, t).posterior[-1])(batch["tokens"])
      mass[variant, k] = np.asarray(post).reshape(-1, k_, h).sum(-1)[
          np.arange(96), np.asarray(batch["concept"])].mean()
  # Measured 0.940 -> 0.989 and 0.940 -> 0.855 (the same prompts at k = 0,
  # where no delimiter is crossed and both agree): margins of half the move.
  assert mass["concept:1e-06", 8] > mass["concept:1e-06", 0] + 0.025, mass
  assert mass["mixture:1e-06", 8] < mass["mixture:1e-06", 0] - 0.04, mass


def test_a_workdir_of_other_concepts_is_refused(tmp_path):
  """Lines of another mixture (a released file changed under its path)
  are refused before any work, naming both fingerprints."""
  setup, workdir = icl.get_setup("tiny"), str(tmp_path)
  icl.check_workdir(workdir, setup)
  line = icl.IclLine(
      backbone="exact", variant="0.0", protocol="ID_sample", length=3,
      examples=0, setup=setup.fingerprint(), hmm_fingerprint="0123abcd",
      test_accuracy=0.5, impossible=0.0, label_prob=0.3, ce_gap=0.0,
      kl=None, prompts=16, seconds=0.1)
  icl.check_workdir(workdir, setup)  # no lines yet: nothing to compare
  files_lib.append_lines(icl.lines_path(workdir), [line])
  with pytest.raises(ValueError, match="other concepts.*0123abcd"):
    icl.check_workdir(workdir, setup)


def test_bad_setups_are_refused_by_name():
  tiny = icl.get_setup("tiny")
  with pytest.raises(ValueError, match="causal"):
    dataclasses.replace(tiny, pretrain=tiny.pretrain.with_overrides(
        model=dataclasses.replace(tiny.pretrain.model, causal=False)))
  with pytest.raises(ValueError, match="vocab_size"):
    dataclasses.replace(tiny, ginc=ginc.GincConfig())
  with pytest.raises(ValueError, match="lengths"):
    dataclasses.replace(tiny, lengths=(1,))
  with pytest.raises(ValueError, match="protocol"):
    dataclasses.replace(tiny, protocols=("ID",))
  for bad in ("1e-06", "concept:0", "both:1e-3", "mixture:x"):
    with pytest.raises(ValueError, match=f"smoothings: '{bad}'"):
      dataclasses.replace(tiny, smoothings=("0", bad))
  missing = dataclasses.replace(icl.get_setup("cpu"), concepts="released",
                                released_path="/nonexistent/ginc.npz")
  with pytest.raises(FileNotFoundError, match="released_path"):
    icl.load_concepts(missing)
  with pytest.raises(ValueError, match="/nonexistent/ginc.npz"):
    icl.check_workdir("/nonexistent-workdir", missing)  # before any write


def test_kl_to_the_reference_on_hand_made_rows():
  """The mean of ``sum p log(p / q)`` over rows, a zero of ``p`` adding
  nothing; infinite (None) where ``q`` is 0 and ``p`` is not."""
  p = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
  q = np.array([[0.25, 0.25, 0.5], [0.5, 0.5, 0.0]])
  assert icl.kl_to(p, q) == pytest.approx(np.log(2), rel=1e-12)
  assert icl.kl_to(p, p) == 0
  assert icl.kl_to(q, p) is None


def test_scores_count_impossible_prompts_wrong():
  """Accuracy, the impossible share and the label's mean probability of
  hand-made rows: an all-zero row is impossible and wrong."""
  rows = np.array([[0.2, 0.8], [0.0, 0.0], [0.6, 0.4]])
  got = ginc.scores(rows, np.array([1, 0, 1]))
  assert got == pytest.approx({"accuracy": 1 / 3, "impossible": 1 / 3,
                               "label_prob": 0.4})


def test_causal_training_targets_are_the_tokens_next_conditionals():
  """The step's exact targets for a causal model are ``P[X_t | x_<t]`` of
  the true tokens (not of the shifted inputs): each row is the
  conditional of its prefix with ``MASK`` at ``t`` (computed apart)."""
  concepts, _ = ginc.concepts(jax.random.PRNGKey(1), SMALL)
  mix = ginc.mixture(jax.tree.map(lambda x: x[:2], concepts))
  cfg = pretrain.configure("tiny", SMALL.num_symbols, model={"causal": True},
                           targets="exact")
  inputs, tokens, weights = corpus.batch_at(
      jax.random.PRNGKey(3), 0, mix, None, cfg.corpus, 2, SMALL.num_symbols,
      causal=True)
  got = np.asarray(train.loss_targets(cfg, mix, inputs, tokens, weights))
  for b in range(2):
    for t in (0, 1, 7, 31):
      prefix = jnp.concatenate([tokens[b, :t], jnp.array([hmm_lib.MASK])])
      want = np.asarray(hmm_lib.conditionals(mix, prefix))[-1]
      np.testing.assert_allclose(got[b, t], want, atol=2e-5)


@pytest.mark.slow
def test_the_transformers_read_out_is_the_pretraining_position():
  """``next_symbol`` after a prompt is the model's prediction where the
  pretraining loss reads it: row ``n - 1`` of the document's
  ``next_token_inputs`` (start symbol and shift as in training); a
  causal model's read-out at ``fits``' boundary is allowed, one past not."""
  setup = icl.get_setup("tiny")
  cfg = setup.pretrain.model
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  docs = jax.random.randint(jax.random.PRNGKey(1), (3, 20), 0, cfg.vocab_size)
  want = transformer.MLM(cfg).apply(params, corpus.next_token_inputs(docs))
  got = icl.next_symbol(cfg, jax.tree.map(lambda x: x[None], params),
                        docs[:, :-1])[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(
      jax.nn.softmax(want[:, -1], -1)), atol=1e-6)
  # prompt_len(3, 7) = 30 symbols, 31 with the start symbol.
  assert icl.prompt_len(3, 7) == 30
  for context, fits in ((31, True), (30, False)):
    s = dataclasses.replace(setup, pretrain=pretrain.configure(
        "tiny", SMALL.num_symbols, context=context, model={"causal": True}))
    assert s.fits(3, 7, "transformer") is fits
  batch = ginc.prompts(jax.random.PRNGKey(2), *ginc.concepts(
      jax.random.PRNGKey(1), SMALL), "ID_sample", 7, 3, 2)
  assert batch["tokens"].shape == (2, icl.prompt_len(3, 7))


def test_the_committed_run_is_the_cpu_preset_on_gincs_release():
  """docs/icl.md's command for the committed run (`--preset=cpu
  --config.concepts=released`) is the setup its stamp and lines record;
  the preset alone draws its concepts (a clone needs no file)."""
  results = os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "docs", "results", "icl")
  setup = icl.get_setup("cpu", concepts="released")
  with open(os.path.join(results, "icl.json")) as f:
    stamp = json.load(f)
  assert {k: v for k, v in stamp.items() if k in setup.identity()} == (
      setup.identity())
  assert {r.setup for r in icl.read_icl_lines(results)} == {setup.fingerprint()}
  assert icl.get_setup("cpu").concepts == "drawn"


def test_a_smoke_runs_report_says_so_and_the_legend_covers_no_curve(
    tmp_path, monkeypatch):
  """The tiny preset's lines (4 concepts of 8 symbols, not GINC's
  settings) head the report as a smoke test's that calls them no GINC
  prompts, and title its plot; the committed run's lines are not its. The
  plot's legend lies outside every panel."""
  tiny = icl.get_setup("tiny")
  files_lib.append_lines(icl.lines_path(str(tmp_path)), [icl.IclLine(
      backbone=b, variant=v, protocol=p, length=n, examples=k,
      setup=tiny.fingerprint(), hmm_fingerprint="h", test_accuracy=acc,
      impossible=0.0, label_prob=0.5, ce_gap=0.1,
      kl=None if v == "0" else 0.1 * (k + 1), prompts=16, seconds=0.0)
      for b, vs in (("exact", tiny.smoothings), ("transformer", "01"))
      for v in vs for p in ginc.PROTOCOLS for n in (3, 5)
      for k, acc in zip(tiny.examples, (0.0, 0.5, 1.0))])
  figs = {}
  monkeypatch.setattr(files_lib, "atomic_write_png",
                      lambda path, fig, dpi: figs.setdefault("icl", fig))
  text = icl.write_report(str(tmp_path))
  assert text.split("\n\n")[1].startswith(
      "**A smoke test, not a result.** These lines are the `tiny` preset's "
      "(4 concepts of 8 symbols, not GINC's)")
  assert "these prompts" in text and "GINC's prompts" not in text
  fig = figs["icl"]
  fig.canvas.draw()
  assert fig._suptitle.get_text() == "A smoke test, not a result"
  (legend,) = fig.legends
  box = legend.get_window_extent()
  assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
  results = os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "docs", "results", "icl")
  assert tiny.fingerprint() not in {r.setup for r in icl.read_icl_lines(
      results)}
  with open(os.path.join(results, "icl.md")) as f:
    assert "GINC's prompts" in f.read()
