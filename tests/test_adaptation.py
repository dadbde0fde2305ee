"""The adaptation methods beyond head and prompt (issue 67): prompt
initialised from tokens, prefix, LoRA; each on a frozen backbone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmmprompt import hmm as hmm_lib
from hmmprompt import pretrain
from hmmprompt import protocol
from hmmprompt import tasks
from hmmprompt import tuning
from hmmprompt.backbones import exact
from hmmprompt.figure3 import adaptation
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep
from hmmprompt.backbones import transformer

TINY = pretrain.preset_config("tiny").model
CFG = tuning.TuneConfig(epochs=1, batch_size=16, prompt_len=3, eval_chunk=32)


@pytest.fixture(scope="module")
def setup():
  """A tiny transformer and a task of an HMM."""
  model = hmm_lib.random_hmm(jax.random.PRNGKey(0), 6, 10)
  params = transformer.init_params(jax.random.PRNGKey(1), TINY)
  task = tasks.make_task(jax.random.PRNGKey(2), model, tasks.TaskConfig(
      num_train=32, num_val=8, num_test=16, seq_len=10))
  return model, transformer.make_backbone(TINY), params, task


def _tune(setup, **kw):
  _, bb, params, task = setup
  cfg = dataclasses.replace(CFG, **kw)
  return tuning.tune(jax.random.PRNGKey(3), bb, params,
                     tuning.data_from_task(task, cfg), cfg)


@pytest.mark.parametrize("kw,own", [
    pytest.param(dict(method="prefix"), "prefix", marks=pytest.mark.slow),
    (dict(method="lora", lora_r=2), "lora"),
    pytest.param(dict(method="prompt", prompt_init_mode="tokens"), "prompt",
                 marks=pytest.mark.slow)])
def test_only_the_methods_pytree_and_the_head_move(setup, kw, own):
  """The frozen backbone's params are bit for bit unchanged; the tunable
  pytree is the head and the method's own entry, and both were trained."""
  _, bb, params, task = setup
  frozen = jax.tree.map(lambda a: np.array(a, copy=True), params)
  cfg = dataclasses.replace(CFG, **kw)
  data = tuning.data_from_task(task, cfg)
  init = tuning.init_tunable(jax.random.split(jax.random.PRNGKey(3))[0], bb,
                             params, cfg, data.train_tokens)
  res, tunable = tuning.tune(jax.random.PRNGKey(3), bb, params, data, cfg)
  assert set(tunable) == {"head", own}
  for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))
  for part in ("head", own):
    moved = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(tunable[part]), jax.tree.leaves(init[part]))]
    assert max(moved) > 0, part
  assert np.isfinite(res.final_loss)


def test_lora_at_init_is_the_backbone_and_counts_its_parameters(setup):
  """B starts at zero: the merged params equal the backbone's exactly, so
  its outputs do; rank r on q and v of L layers of width D is 2 L (2 D r)
  parameters."""
  _, bb, params, task = setup
  r, d, layers = 3, TINY.d_model, TINY.num_layers
  lora = transformer.lora_init(jax.random.PRNGKey(0), params, r)
  assert transformer.num_params(lora) == layers * 2 * (2 * d * r)
  merged = transformer.with_lora(params, lora, scale=2.0)
  for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  tokens = jnp.asarray(task.test.tokens[0])
  np.testing.assert_array_equal(bb.outputs(merged, tokens)[0],
                                bb.outputs(params, tokens)[0])
  # A nonzero B changes exactly its projection's columns, by scale A B.
  lora["block_0"]["v"]["B"] = jnp.ones((r, d))
  moved = transformer.with_lora(params, lora, 0.5)
  delta = (moved["params"]["block_0"]["qkv"]["kernel"]
           - params["params"]["block_0"]["qkv"]["kernel"])
  np.testing.assert_allclose(delta[:, 2 * d:],
                             0.5 * lora["block_0"]["v"]["A"] @ jnp.ones((r, d)),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(delta[:, :2 * d], 0)


@pytest.mark.parametrize("rel_pos", [
    "none", pytest.param("bias", marks=pytest.mark.slow)])
def test_a_prefix_given_no_attention_weight_is_the_backbone(rel_pos):
  """Queries made to share a large component (a big bias on one query
  coordinate of every head) and prefix keys far negative along it: the
  prefix's attention weights underflow to 0, and the outputs are the
  backbone's to float rounding (the same sums, other shapes)."""
  cfg = dataclasses.replace(TINY, rel_pos=rel_pos, attention="manual",
                            num_layers=2)
  bb = transformer.make_backbone(cfg)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  e = cfg.d_model // cfg.num_heads
  inner = dict(params["params"])
  for name in ("block_0", "block_1"):
    qkv = inner[name]["qkv"]
    bias = qkv["bias"].at[jnp.arange(cfg.num_heads) * e].set(30.0)
    inner[name] = {**inner[name], "qkv": {**qkv, "bias": bias}}
  params = {**params, "params": inner}
  prefix = transformer.prefix_init(jax.random.PRNGKey(1), params, 4)
  for blk in prefix["prefix"].values():  # keys: -1e4 on each head's coord 0
    blk["kv"] = blk["kv"].at[0, :, jnp.arange(cfg.num_heads) * e].set(-1e4)
  tokens = jnp.array([hmm_lib.MASK, 1, 2, 3, 4, 5])
  plain = bb.outputs(params, tokens)[0]
  prefixed = bb.outputs({**params, **prefix}, tokens)[0]
  np.testing.assert_allclose(prefixed, plain, rtol=1e-5, atol=1e-6)
  # ... and a prefix that is attended to changes them.
  loud = jax.tree.map(lambda x: x.at[0].set(0.0).at[1].set(5.0), prefix)
  assert float(jnp.max(jnp.abs(bb.outputs({**params, **loud}, tokens)[0]
                               - plain))) > 1e-3


def test_tokens_init_draws_real_tokens_embeddings(setup):
  """Each ``"tokens"`` prompt row is the embedding of a token of the
  training text: a row of the transformer's token table; on the exact
  backbone, through its sigmoid, the evidence vector of one, to its clip
  of [1e-3, 1 - 1e-3]."""
  model, bb, params, task = setup
  cfg = dataclasses.replace(CFG, method="prompt", prompt_init_mode="tokens",
                            prompt_len=12)
  train = jnp.asarray(task.train.tokens)
  prompt = tuning.init_tunable(jax.random.PRNGKey(5), bb, params, cfg,
                               train)["prompt"]
  table = params["params"]["tok_embed"]["embedding"][:10]
  drawn = np.unique(np.asarray(train[:, 1:]))
  for row in np.asarray(prompt):
    hits = np.flatnonzero(np.all(np.asarray(table) == row, axis=1))
    assert len(hits) == 1 and hits[0] in drawn
  assert len({tuple(r) for r in np.asarray(prompt)}) > 1
  ebb, hmm = exact.make(model)
  evid = np.asarray(hmm_lib.token_evidence(hmm, jnp.arange(10)))  # [V, H]
  raw = tuning.init_tunable(jax.random.PRNGKey(5), ebb, hmm, cfg,
                            train)["prompt"]
  for row in np.asarray(ebb.prompt_embedding(raw)):
    dist = np.max(np.abs(evid - row), axis=1)
    assert dist.min() <= 1e-3 + 1e-6 and np.argmin(dist) in drawn


@pytest.mark.slow  # 2.7 s: the full suite's
@pytest.mark.parametrize("kw", [dict(method="prefix"),
                                dict(method="lora", lora_r=1,
                                     lora_targets="q,k,v")])
def test_stacked_lanes_equal_separate_runs(setup, kw):
  """Trials x tasks stacked as lanes give each lane its own run's lines."""
  model, bb, params, task = setup
  cfg = dataclasses.replace(CFG, **kw)
  other = tasks.make_task(jax.random.PRNGKey(7), model, tasks.TaskConfig(
      num_train=32, num_val=8, num_test=16, seq_len=10))
  params2 = jax.tree.map(lambda x: -x, params)
  datas = [[tuning.data_from_task(t, cfg)] for t in (task, other)]
  keys = [[jax.random.PRNGKey(11)], [jax.random.PRNGKey(12)]]
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, params2)
  res, _ = tuning.tune_trials(keys, bb, stacked, datas, cfg)
  for i, p in enumerate((params, params2)):
    one, _ = tuning.tune(keys[i][0], bb, p, datas[i][0], cfg)
    np.testing.assert_allclose(res.test_accuracy[i, 0], one.test_accuracy,
                               atol=1 / 16 + 1e-6)
    np.testing.assert_allclose(res.final_loss[i, 0], one.final_loss,
                               rtol=1e-4, atol=1e-5)


def test_arms_name_their_settings_and_keep_figure3s_lines():
  """An arm's line is named by its settings; the prompt of the preset's own
  length and init is Figure 3's ``prompt_linear`` line (the same draws,
  tasks and fingerprint as ``cpu_paper``'s); the exact backbone plans only
  the arms that have a meaning on it."""
  setup = configs.get_setup("adaptation")
  assert setup.fingerprint("transformer") == configs.get_setup(
      "cpu_paper").fingerprint("transformer")
  names = lambda b: [g.method_name for g in configs.plan(setup, "left", b)[
      protocol.vanilla(8)]]
  assert names("transformer") == [
      "head_linear", "prompt_linear_p1", "prompt_linear_p5", "prompt_linear",
      "prompt_linear_p1_tokens", "prompt_linear_p5_tokens",
      "prompt_linear_tokens", "prefix_linear_p5", "lora_linear_r1",
      "lora_linear_r4", "finetune_linear"]
  assert names("exact") == names("transformer")[:7]
  (memory,) = [g for g in configs.plan(setup, "right", "exact")]
  assert {g.head for g in configs.plan(setup, "right", "exact")[memory]} == {
      "attention"}
  g = configs.plan(setup, "left", "transformer")[protocol.vanilla(8)][8]
  cfg = g.tune_config(setup.tune)
  assert (cfg.method, cfg.lora_r, cfg.prompt_len) == ("lora", 1, 20)
  # Only transformer arms on the exact backbone plan nothing there.
  only = dataclasses.replace(setup, arms=("lora-2",))
  assert configs.plan(only, "left", "exact") == {}


@pytest.mark.parametrize("arms,match", [
    ("lorax-1", "'lorax-1' is not an arm"),
    ("prompt-0", "'prompt-0': TuneConfig.prompt_len must be >= 1"),
    ("prompt-3-random", "'prompt-3-random': TuneConfig.prompt_init_mode"),
    ("lora-x", r"'lora-x': lora_r must be a whole number \(the form: "
     r"lora-RANK\)"),
    ("prompt-3.5", r"prompt_len must be a whole number \(the form: "
     r"prompt-LEN\)"),
    ("head-1", "'head-1' is not an arm")])
def test_a_bad_arm_is_refused_by_name(arms, match):
  with pytest.raises(ValueError, match=match):
    configs.get_setup("adaptation", {"arms": arms})


def test_transformer_arms_need_the_transformer_before_any_work():
  setup = configs.get_setup("adaptation")
  with pytest.raises(ValueError, match="--config.arms prefix-5,lora-1,lora-4,"
                     "finetune: no meaning on the exact backbone"):
    configs.check_run(setup, ["exact"])
  configs.check_run(setup, ["exact", "transformer"])
  # An arm's prompt past the context: refused by name before pretraining.
  long = configs.get_setup("tiny", {"arms": "head,prompt-30,prefix-30"})
  with pytest.raises(ValueError, match=r"--config.arms prompt-30: its prompt "
                     r"\+ 1 \+ seq_len = 47 positions exceed the pretrained "
                     r"context of 32"):
    configs.check_run(long, ["exact", "transformer"])
  configs.check_run(configs.get_setup("tiny", {"arms": "head,prefix-30"}),
                    ["transformer"])  # a prefix takes no position


@pytest.mark.slow  # 2.2 s: the full suite's
def test_a_sweep_of_arms_records_settings_and_trainable_parameters(tmp_path):
  """End to end on the exact backbone: each line records its arm's
  settings and its trainable parameters (a linear head on V = 10 is 2 x 10
  + 2; a prompt adds P x |H|); the report has the arms' section and plot."""
  setup = configs.get_setup("tiny", features=("raw",), left_sizes=(4,),
                            arms=("head", "prompt-1-tokens", "prompt-3"))
  workdir = str(tmp_path)
  sweep.run_sweep(setup, workdir, "left", "exact")
  lines = {(r.method, r.trial): r for r in schema.read_results(workdir)}
  assert sorted({m for m, _ in lines}) == [
      "head_linear", "prompt_linear_p1_tokens", "prompt_linear_p3"]
  for (method, _), r in lines.items():
    assert r.trainable_params == {"head_linear": 22,
                                  "prompt_linear_p1_tokens": 26,
                                  "prompt_linear_p3": 34}[method]
  r = lines["prompt_linear_p1_tokens", 0]
  assert (r.tune_config["prompt_len"], r.tune_config["prompt_init_mode"]) == (
      1, "tokens")
  reporting.write_figure3_report(workdir)
  with open(tmp_path / "figure3.md") as f:
    report = f.read()
  assert "## Adaptation arms" in report
  assert "| exact | left | 4 | prompt 1 tokens | 26 |" in report
  assert (tmp_path / "adaptation.png").stat().st_size > 0


def test_no_adaptation_cell_mixes_raw_and_log_features():
  """Each features transform is its own arm in every column: an arm's
  paired difference is from the head on its own features, and the exact
  prompt arm it is set beside is its features' too; a blank exact prompt
  column is said why."""
  acc = {("head_linear", "raw"): [0.8, 0.8], ("head_linear", "log"): [0.6, 0.6],
         ("prompt_linear", "raw"): [0.9, 0.9],
         ("prompt_linear", "log"): [0.7, 0.7],
         ("prompt_linear_p1", "raw"): [0.85, 0.85],
         ("prompt_linear_p1", "log"): [0.65, 0.65]}
  lines = [schema.ResultLine(
      backbone="exact", panel="left", hmm="vanilla", num_states=4,
      memory_size=0, trial=k, task=0, method=m, features=f, setup="fp",
      hmm_fingerprint="h", size=4, test_accuracy=a[k], val_accuracy=0.5,
      train_accuracy=0.5, final_loss=0.1, steps=1, seconds=0.0,
      task_redraws=0, assumptions={}, tune_config={"prompt_len": (
          1 if m.endswith("p1") else 4)}, task_config={})
           for (m, f), a in acc.items() for k in range(2)]
  text = adaptation.section(lines)
  rows = {r.split("|")[4].strip(): [c.strip() for c in r.split("|")[5:-1]]
          for r in text.splitlines() if r.startswith("| exact")}
  # (accuracy, arm - head, ..., exact prompt - arm)
  assert (rows["head (log)"][2], rows["head (log)"][-1]) == (
      "0.0 ± 0.0 (2)", "10.0")
  assert (rows["prompt 1 (log)"][2], rows["prompt 1 (log)"][-1]) == (
      "5.0 ± 0.0 (2)", "5.0")
  assert (rows["prompt 1"][2], rows["prompt 1"][-1]) == (
      "5.0 ± 0.0 (2)", "5.0")
  assert "A blank exact prompt - arm: no exact prompt arm of Figure 3" in text


# --- Through the tuning path: the params the backbone computes with.


def _float_bound(cfg) -> float:
  """The float32 forward's rounding bound on output probabilities against
  a float64 one (tests/test_transformer.py's derivation): each of a
  block's six dot-product stages and the output layer rounds within
  ``n eps`` relative, ``n <= d_ff`` (Higham's gamma_n), so ``(6 L + 1) n
  eps`` on probabilities, which are at most 1."""
  return (6 * cfg.num_layers + 1) * cfg.d_ff * float(np.finfo(np.float32).eps)


def _merged_by_hand(params, lora, scale):
  """``params`` with ``W + scale A B`` on each adapted projection's ``D``
  columns of its layer's ``qkv`` kernel (q, k, v at columns 0, D, 2 D),
  summed in float64 and rounded once to float32."""
  out = jax.tree.map(lambda x: np.array(x, np.float64), params)
  for name, adapters in lora.items():
    kernel = out["params"][name]["qkv"]["kernel"]
    d = kernel.shape[0]
    for j, t in enumerate("qkv"):
      if t in adapters:
        a, b = (np.array(adapters[t][m], np.float64) for m in "AB")
        kernel[:, j * d:(j + 1) * d] += scale * (a @ b)
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), out)


def test_lora_through_tuning_adds_alpha_over_r_times_a_b(setup):
  """What tuning's LoRA method hands the head (``METHODS["lora"]
  .head_inputs`` on the tunable ``init_tunable`` makes, its ``B`` set
  nonzero) is the backbone's output on kernels merged by hand,
  ``W + (alpha / r) A B`` on each target's columns, at every position
  (the attention head reads all). alpha = 5, r = 2: a scale of 2.5, not
  1 (alpha ignored) nor r / alpha. The two sides differ only in the
  merged kernels' rounding (a sum of r = 2 products, a few ulps), within
  :func:`_float_bound`; a wrong scale moves the outputs by over 100 times
  that, checked here."""
  _, bb, params, task = setup
  cfg = dataclasses.replace(CFG, method="lora", head="attention", lora_r=2,
                            lora_alpha=5.0, lora_targets="q,k,v")
  data = tuning.data_from_task(task, cfg)
  tunable = tuning.init_tunable(jax.random.PRNGKey(4), bb, params, cfg,
                                data.train_tokens)
  leaves, tree = jax.tree.flatten(tunable["lora"])
  keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
  # B ~ N(0, 1), each its own draw; A as LoRA draws it.
  tunable["lora"] = jax.tree.unflatten(tree, [
      jax.random.normal(k, x.shape) if x.shape[0] == cfg.lora_r else x
      for x, k in zip(leaves, keys)])
  assert all(float(jnp.abs(ab["B"]).min()) > 0
             for adapters in tunable["lora"].values()
             for ab in adapters.values())
  tokens = data.test_tokens[0]
  got, _ = jax.jit(lambda p, tu, t: tuning.METHODS["lora"].head_inputs(
      bb, p, tu, cfg, t))(params, tunable, tokens)
  backbone = jax.jit(lambda p, t: tuning.backbone_head_inputs(bb, p, cfg, t)[0])
  outputs = lambda scale: np.asarray(backbone(
      _merged_by_hand(params, tunable["lora"], scale), tokens))
  tol = _float_bound(TINY)
  np.testing.assert_allclose(np.asarray(got), outputs(5.0 / 2), rtol=0,
                             atol=tol)
  for wrong in (1.0, 2 / 5.0):
    assert np.abs(outputs(wrong) - outputs(5.0 / 2)).max() > 100 * tol


def _prefixed_forward(params, cfg, tokens_T, kv_by_block, slices):
  """``logits [T, V]`` in float64 numpy: the textbook pre-LN encoder
  (tests/test_transformer.py's) with each block's heads also attending to
  its prefix, ``slices(kv [2, P, D]) -> (keys [A, P, E], values [A, P,
  E])``, before the tokens' keys and values, without a position."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)["params"]
  norm = lambda x, q: ((x - x.mean(-1, keepdims=True)) / np.sqrt(
      x.var(-1, keepdims=True) + 1e-6) * q["scale"] + q["bias"])
  dense = lambda x, q: x @ q["kernel"] + q["bias"]
  gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (
      x + 0.044715 * x ** 3)))
  t, d, a = len(tokens_T), cfg.d_model, cfg.num_heads
  e = d // a
  ids = np.where(np.asarray(tokens_T) == hmm_lib.MASK, cfg.vocab_size,
                 tokens_T)
  x = p["tok_embed"]["embedding"][ids] + p["pos_embed"][:t]
  for i in range(cfg.num_layers):
    blk = p[f"block_{i}"]
    qkv = dense(norm(x, blk["ln_attn"]), blk["qkv"])
    q, k, v = (qkv[:, s * d:(s + 1) * d].reshape(t, a, e).transpose(1, 0, 2)
               for s in range(3))
    pk, pv = slices(np.asarray(kv_by_block[f"block_{i}"], np.float64))
    k, v = np.concatenate([pk, k], 1), np.concatenate([pv, v], 1)
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(e)  # [A, T, P + T]
    w = np.exp(logits - logits.max(-1, keepdims=True))
    out = (w / w.sum(-1, keepdims=True)) @ v  # [A, T, E]
    x = x + dense(out.transpose(1, 0, 2).reshape(t, d), blk["attn_out"])
    x = x + dense(gelu(dense(norm(x, blk["ln_mlp"]), blk["mlp_in"])),
                  blk["mlp_out"])
  return dense(norm(x, p["ln_final"]), p["head"])


def test_prefix_position_and_head_read_their_own_slice():
  """Tuning's prefix method (``METHODS["prefix"].head_inputs``) on 3
  positions, 2 heads and 2 layers, every key and value its own N(0, 1)
  draw, is a float64 attention computed by hand in which prefix position
  ``j`` and head ``a`` read keys ``kv[0, j, a E:(a + 1) E]`` and values
  ``kv[1, j, a E:(a + 1) E]`` (heads concatenated, as the qkv kernel's
  columns), block ``i`` its own; at every position, to the float32
  forward's :func:`_float_bound`. Weights far from init (+ 0.3 N(0, 1)) so
  that queries are large and the keys decide the weights. Reading the
  prefix heads-major (``[A, P, E]`` row-major) or keys for values moves
  the hand computation by over 100 times the bound: checked here."""
  cfg = dataclasses.replace(TINY, num_layers=2, attention="manual")
  bb = transformer.make_backbone(cfg)
  params = transformer.init_params(jax.random.PRNGKey(0), cfg)
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])
  tune = dataclasses.replace(CFG, method="prefix", head="attention",
                             prompt_len=3)
  tokens = jnp.array([hmm_lib.MASK, 1, 2, 3, 4, 5, 0, 9])
  tunable = tuning.init_tunable(jax.random.PRNGKey(2), bb, params, tune,
                                tokens[None])
  blocks = tunable["prefix"]["prefix"]
  assert sorted(blocks) == ["block_0", "block_1"]
  for i, name in enumerate(sorted(blocks)):
    assert blocks[name]["kv"].shape == (2, 3, cfg.d_model)
    blocks[name]["kv"] = jax.random.normal(jax.random.PRNGKey(10 + i),
                                           (2, 3, cfg.d_model))
  a, e = cfg.num_heads, cfg.d_model // cfg.num_heads
  own = lambda kv: tuple(np.array([[kv[s, j, h * e:(h + 1) * e]
                                    for j in range(kv.shape[1])]
                                   for h in range(a)]) for s in (0, 1))
  softmax = lambda z: np.exp(z - z.max(-1, keepdims=True)) / np.exp(
      z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)
  want = lambda slices: softmax(_prefixed_forward(
      params, cfg, tokens, {n: b["kv"] for n, b in blocks.items()}, slices))
  got, _ = jax.jit(lambda p, tu, t: tuning.METHODS["prefix"].head_inputs(
      bb, p, tu, tune, t))(params, tunable, tokens)
  tol = _float_bound(cfg)
  np.testing.assert_allclose(np.asarray(got, np.float64), want(own), rtol=0,
                             atol=tol)
  heads_major = lambda kv: (kv[0].reshape(a, -1, e), kv[1].reshape(a, -1, e))
  swapped = lambda kv: own(kv)[::-1]
  for wrong in (heads_major, swapped):
    assert np.abs(want(wrong) - want(own)).max() > 100 * tol


def _recording_backbone(bb, frozen, lora_targets, rank, log):
  """``bb`` whose ``embed``, ``apply`` and ``apply_at`` report to ``log``,
  from inside the jitted program (``jax.debug.callback``), how far the
  ``"params"`` they were given are from ``frozen``'s: the count of
  entries not equal bit for bit, the adapted columns of each ``qkv``
  kernel (``lora_targets``) aside, and the count of those adapted blocks
  whose change is not of rank <= ``rank`` (its (rank + 1)-th singular
  value above 1e-4 of the first, plus 1e-6: float32 rounding of ``W +
  s A B`` leaves entries within 2^-24 of |W + s A B| < 1, a spectral
  norm under D 2^-24 < 1e-5 / 4 at D = 32)."""
  want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(
      frozen["params"])

  def record(changed, *deltas):
    bad = 0
    for delta in deltas:
      for m in np.asarray(delta, np.float64).reshape(-1, *delta.shape[-2:]):
        sv = np.linalg.svd(m, compute_uv=False)
        bad += int(sv[rank] > 1e-4 * sv[0] + 1e-6)
    log.append(int(np.sum(changed)) + bad)

  def check(p):
    got, tree = jax.tree.flatten(p["params"])
    assert tree == want_tree  # at trace time: no entry added or lost
    changed, deltas = 0, []
    for (path, want), have in zip(want_leaves, got):
      differs = have != want
      if jax.tree_util.keystr(path[-2:]) == "['qkv']['kernel']":
        d = want.shape[0]
        for j, t in enumerate("qkv"):
          if t in lora_targets:
            differs = differs.at[:, j * d:(j + 1) * d].set(False)
            deltas.append(have[:, j * d:(j + 1) * d] - want[:, j * d:
                                                            (j + 1) * d])
      changed = changed + jnp.sum(differs)
    jax.debug.callback(record, changed, *deltas)
    return p

  return dataclasses.replace(
      bb, name="recording", embed=lambda p, t: bb.embed(check(p), t),
      apply=lambda p, x: bb.apply(check(p), x),
      apply_at=lambda p, x, i: bb.apply_at(check(p), x, i))


@pytest.mark.parametrize("kw", [
    pytest.param(dict(method="head"), marks=pytest.mark.slow),
    dict(method="prompt"),
    pytest.param(dict(method="prefix"), marks=pytest.mark.slow),
    pytest.param(dict(method="lora", lora_r=2), marks=pytest.mark.slow),
    pytest.param(dict(method="finetune"), marks=pytest.mark.slow)],
                         ids=lambda kw: kw["method"])
def test_the_backbone_computes_with_the_frozen_params_in_every_method(
    setup, kw):
  """docs/adaptation.md's promise, checked where it matters: inside the
  jitted tuning program, every call of the backbone (embedding, every
  training step's forward, the accuracies) is given the frozen params bit
  for bit (a prefix's own entries beside them); for LoRA the kernels'
  un-adapted columns are the frozen ones bit for bit and the adapted ones
  the frozen ones plus a change of rank <= r. A tunable that carries a
  copy of the backbone and trains it would pass a check of the caller's
  arrays (a jax program cannot change them) but not this one: fine-tuning,
  which does that by design, is flagged here (the check can fail)."""
  _, bb, params, task = setup
  cfg = dataclasses.replace(CFG, **kw)
  log = []
  targets = cfg.lora_targets.split(",") if cfg.method == "lora" else ()
  rec = _recording_backbone(bb, jax.tree.map(np.asarray, params), targets,
                            cfg.lora_r, log)
  res, _ = tuning.tune(jax.random.PRNGKey(3), rec, params,
                       tuning.data_from_task(task, cfg), cfg)
  assert np.isfinite(res.final_loss)
  assert len(log) >= 2, log  # the callback ran inside the program
  if cfg.method == "finetune":
    assert max(log) > 0
  else:
    assert max(log) == 0, [n for n in log if n]
