"""The results pages' findings by a second path (docs/conventions.md): the
small cases recomputed by brute force or float64 numpy, and the numbers the
pages quote read back from the committed lines with plain json + numpy,
never through the reporting code that printed them."""

import itertools
import json
import os

import numpy as np
import pytest

from experiments import bayes_ceiling
from hmmprompt import generative
from hmmprompt import memory
from hmmprompt import probes
from hmmprompt import protocol
from hmmprompt.figure3 import adaptation
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import schema

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULTS = os.path.join(_ROOT, "docs", "results")


def _jsonl(*parts) -> list[dict]:
  with open(os.path.join(_RESULTS, *parts)) as f:
    return [json.loads(line) for line in f if line.strip()]


# The small cases.

def test_the_float64_first_posterior_is_every_paths_sum():
  """``P[H_0 | x_1..T]`` of the Bayes ceiling's backward pass, against the
  sum over every hidden path of a 3-state HMM (position 0 masked)."""
  rng = np.random.default_rng(0)
  init, trans, emit = (rng.dirichlet(np.ones(n), size=m)
                       for n, m in ((3, None), (3, 3), (4, 3)))
  tokens = rng.integers(0, 4, size=(5, 5))
  tokens[:, 0] = -1  # never read: the masked position
  want = np.zeros((5, 3))
  for n, x in enumerate(tokens):
    for path in itertools.product(range(3), repeat=5):
      p = init[path[0]]
      for t in range(1, 5):
        p *= trans[path[t - 1], path[t]] * emit[path[t], x[t]]
      want[n, path[0]] += p
  want /= want.sum(-1, keepdims=True)
  got = bayes_ceiling.posterior_first(init, trans, emit, tokens)
  np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("states", [3, 6])
def test_the_output_holds_the_posterior_only_when_h_is_at_most_x(states):
  """The probes page's tasks finding in closed form: a masked LM's output
  at ``MASK`` is ``P[x_0 | x_1..T] = P[H_0 | x] @ emission``, an affine
  image of the posterior in ``|X|`` dimensions: its affine probe recovers
  the posterior (R² 1) when ``|H| <= |X|`` (a full-rank emission), and not
  when ``|H| > |X|``. The posterior is the float64 backward pass (checked
  against every path above); probes' ridge-0 fit and R² against numpy's
  least squares on the same rows."""
  rng = np.random.default_rng(states)
  vocab, n = 4, 900
  init, trans, emit = (rng.dirichlet(np.ones(k), size=m) for k, m in (
      (states, None), (states, states), (vocab, states)))
  tokens = np.full((n, 6), -1)
  h = np.array([rng.choice(states, p=init) for _ in range(n)])
  for t in range(1, 6):
    h = np.array([rng.choice(states, p=trans[i]) for i in h])
    tokens[:, t] = [rng.choice(vocab, p=emit[i]) for i in h]
  post = bayes_ceiling.posterior_first(init, trans, emit, tokens)
  out = post @ emit
  probe = probes.fit(out[None, :600], post[None, :600], out[None, 600:750],
                     post[None, 600:750], ridges=(0.0,))
  got = probes.r2(probe, out[None, 750:], post[None, 750:])[0]
  w = np.linalg.lstsq(np.c_[out[:600], np.ones(600)], post[:600], rcond=None)[0]
  resid = post[750:] - np.c_[out[750:], np.ones(150)] @ w
  want = 1 - (resid ** 2).sum() / ((post[750:] - post[750:].mean(0)) ** 2).sum()
  assert got == pytest.approx(want, abs=1e-9)
  if states <= vocab:
    assert got == pytest.approx(1.0, abs=1e-9)
  else:  # the posterior's variance off the emission's row space is lost
    assert got < 1 - 1e-3, got


@pytest.mark.parametrize("mid", [
    pytest.param(protocol.vanilla(12), marks=pytest.mark.slow),
    protocol.memory(2)])
def test_the_bayes_classifier_scores_every_label(mid):
  """The task's Bayes classifier (its label rule on the exact posterior,
  recomputed in float64) scores 100% on every test split: the adaptation
  page's ceiling. The slips it guards against score less: a posterior one
  position late (vanilla), the memory read as the trailing index of the
  product states (memory)."""
  setup = configs.get_setup("tiny")
  stack = protocol.draw_stack(setup, mid, 2, 1)
  for k, (task,) in enumerate(stack.tasks):
    model = generative.trial(stack.models_K, k)
    assert bayes_ceiling.bayes_accuracy(model, task) == 1.0
  tokens, mu = np.asarray(task.test.tokens), np.asarray(task.mu)
  if mid.hmm == "vanilla":
    post = bayes_ceiling.posterior_first(*model, tokens[:, 1:])
  else:
    post = bayes_ceiling.posterior_first(*memory.to_hmm(model), tokens)
    post = post.reshape(len(tokens), -1, mu.shape[1]).sum(1)
  slip = np.argmax(post @ mu.T, -1) == np.asarray(task.test.labels)
  assert slip.mean() < 0.97


def _result(method, trial, acc, backbone="exact"):
  return schema.ResultLine(
      backbone=backbone, panel="left", hmm="vanilla", num_states=12,
      memory_size=0, trial=trial, task=0, method=method, features="raw",
      setup="abc", hmm_fingerprint="f", size=12, test_accuracy=acc,
      val_accuracy=0.5, train_accuracy=0.5, final_loss=0.1, steps=3,
      seconds=1.0, task_redraws=0, assumptions={}, tune_config={
          "prompt_len": 1, "lora_r": 1}, task_config={})


def test_the_adaptation_counts_use_each_pairs_floor():
  """Above, within and below the floor sum to the draws; a difference at
  the floor counts as within only; the floor is the pair's own,
  ``2 sqrt(sd_arm^2 + sd_head^2)``; an arm with no floor counts nothing."""
  head = [0.80] * 5
  # differences 10 (above), +-5 (at the floor), 2 (within), -6 (below)
  arm = [0.90, 0.85, 0.75, 0.82, 0.74]
  lines = ([_result("head_linear", k, a) for k, a in enumerate(head)]
           + [_result("prompt_linear_p1", k, a) for k, a in enumerate(arm)]
           + [_result("lora_linear_r1", k, a, "transformer")
              for k, a in enumerate(arm)]
           + [_result("head_linear", k, a, "transformer")
              for k, a in enumerate(head)])
  floor = {("exact", "head"): {"seed_sd": 1.5},
           ("exact", "prompt_linear_p1"): {"seed_sd": 2.0}}
  assert adaptation.pair_floor(floor, "exact", "prompt_linear_p1",
                              "head_linear") == pytest.approx(5.0)
  rows = {r.split("|")[4].strip(): [c.strip() for c in r.split("|")[1:-1]]
          for r in adaptation.section(lines, floor).splitlines()
          if r.startswith("| exact") or r.startswith("| transformer")}
  assert rows["prompt 1"][7:9] == ["5.0", "1 / 3 / 1"]
  lora = [r for k, r in rows.items() if k.startswith("lora")]
  assert lora[0][7:9] == ["", ""]  # no floor measured: nothing called


def test_each_arms_floor_is_its_pooled_seed_sd():
  """:func:`noise.arm_floor`'s ``seed_sd``: the root mean over draws and
  sizes of each draw's sample variance over seeds, recomputed in numpy."""
  rng = np.random.default_rng(1)
  acc = rng.uniform(0.6, 1.0, size=(2, 3, 4))  # sizes x draws x seeds
  lines = [noise.ReplicateLine("exact", size, k, 0, "prompt_linear_p1", r,
                               "abc", float(acc[i, k, r]), 0.1)
           for i, size in enumerate((12, 30)) for k in range(3)
           for r in range(4)]
  floor = noise.arm_floor(noise.summarize(lines))
  want = np.sqrt(np.mean(np.var(100 * acc, axis=-1, ddof=1)))
  assert floor["exact", "prompt_linear_p1"]["seed_sd"] == pytest.approx(
      want, rel=1e-9)


# The committed runs, read back.

def test_the_committed_icl_lines_hold_the_per_concept_finding():
  """docs/results/icl: smoothed per concept (1e-6), `ID_sample` at length
  3 rises from 54.2% at k = 0 to 65.6-73.0% for every k >= 1 and at
  length 5 from 95.0% to 97.4-99.8%; smoothed across concepts it stays
  at 47.2-54.2% and 87.2-95.0%."""
  acc = {(d["variant"], d["length"], d["examples"]): 100 * d["test_accuracy"]
         for d in _jsonl("icl", "icl.jsonl")
         if d["backbone"] == "exact" and d["protocol"] == "ID_sample"}
  for length, k0, (lo, hi), (mlo, mhi) in ((3, 54.2, (65.6, 73.0),
                                            (47.2, 54.2)),
                                           (5, 95.0, (97.4, 99.8),
                                            (87.2, 95.0))):
    assert acc["concept:1e-06", length, 0] == pytest.approx(k0)
    rest = [v for (var, n, k), v in acc.items()
            if var == "concept:1e-06" and n == length and k > 0]
    assert (min(rest), max(rest)) == pytest.approx((lo, hi))
    mixed = [v for (var, n, _), v in acc.items()
             if var == "mixture:1e-06" and n == length]
    assert (min(mixed), max(mixed)) == pytest.approx((mlo, mhi))


def test_the_committed_adaptation_floors_and_ceiling():
  """docs/results/adaptation: each arm's floor in noise_floor.json is the
  pooled seed sd of its replicate lines (numpy, not noise.arm_floor), and
  the Bayes classifier scored 100% at every size."""
  by: dict = {}
  for d in _jsonl("adaptation", "noise", "replicates.jsonl"):
    by.setdefault((d["backbone"], d["method"]), {}).setdefault(
        (d["size"], d["trial"], d["task"]), []).append(100 * d["test_accuracy"])
  with open(os.path.join(_RESULTS, "adaptation", "noise_floor.json")) as f:
    floors = {(d["backbone"], d["method"]): d["seed_sd"] for d in json.load(f)}
  assert set(floors) == set(by) and len(by) == 18
  for key, cells in by.items():
    want = np.sqrt(np.mean([np.var(v, ddof=1) for v in cells.values()]))
    assert floors[key] == pytest.approx(want, rel=1e-9), key
  assert [d["accuracy"] for d in _jsonl("adaptation", "bayes.jsonl")] == [
      100.0] * 5


def _icl_cells(protocol="ID_sample"):
  """``{(curve, length, k): (accuracy %, KL)}`` from docs/results/icl,
  the transformers' curve the mean over their seeds."""
  cells, seeds = {}, {}
  for d in _jsonl("icl", "icl.jsonl"):
    if d["protocol"] != protocol:
      continue
    key = (d["length"], d["examples"])
    if d["backbone"] == "exact":
      cells[(d["variant"],) + key] = (100 * d["test_accuracy"], d["kl"])
    else:
      seeds.setdefault(key, []).append((100 * d["test_accuracy"], d["kl"]))
  for key, v in seeds.items():
    cells[("transformer",) + key] = tuple(np.mean(v, axis=0))
  return cells


def _span(values):
  return (round(min(values), 3), round(max(values), 3))


def test_the_icl_page_quotes_its_lines():
  """docs/icl.md's findings: the transformers' accuracy gap to the
  per-concept curve and their KL from it, each smoothing's spread, the
  `OOD_sample` ranges."""
  c = _icl_cells()
  ref, tr = "concept:1e-06", "transformer"
  ks = lambda n: [k for (v, m, k) in c if v == tr and m == n]
  gap = lambda n, k: c[ref, n, k][0] - c[tr, n, k][0]
  assert gap(3, 0) == pytest.approx(9.5, abs=0.05)
  for n, want in ((3, (17.8, 22.0)), (5, (28.2, 32.8)), (8, (20.3, 25.8)),
                  (10, (19.0, 21.6))):
    got = _span([gap(n, k) for k in ks(n) if n != 3 or k > 0])
    assert got == pytest.approx(want, abs=0.05), n
  every = [gap(n, k) for n in (3, 5, 8, 10) for k in ks(n) if k > 0]
  assert _span(every) == pytest.approx((17.8, 32.8), abs=0.05)  # README
  kl = lambda v, n, k: c[v, n, k][1]
  assert kl(tr, 3, 0) == pytest.approx(0.161, abs=5e-4)
  assert _span([kl(tr, 3, k) for k in ks(3) if k]) == pytest.approx(
      (0.839, 1.052), abs=5e-4)
  assert _span([kl("mixture:1e-06", 3, k) for k in ks(3) if k]) == (
      pytest.approx((0.383, 0.839), abs=5e-4))
  for n, start, end in ((5, 0.302, 0.262), (8, 0.163, 0.125),
                        (10, 0.141, 0.105)):
    assert (kl(tr, n, 0), kl(tr, n, max(ks(n)))) == pytest.approx(
        (start, end), abs=5e-4)
  moves = [c[tr, n, k][0] - c[tr, n, 0][0] for n in (5, 8, 10) for k in ks(n)]
  assert _span(moves) == pytest.approx((-4.8, 4.4), abs=0.05)
  assert max(c[tr, 3, k][0] - c[tr, 3, 0][0] for k in ks(3)) == (
      pytest.approx(8.3, abs=0.05))
  every_k = [0, 1, 2, 4, 8, 16, 32, 64]
  span = lambda v, n, k0=1: _span([c[v, n, k][0] for k in every_k[k0:]])
  assert span("concept:0.001", 3) == pytest.approx((78.8, 89.6))
  assert span("mixture:1e-06", 3) == pytest.approx((47.2, 52.6))
  assert _span([c[ref, 5, k][0] - c["mixture:1e-06", 5, k][0]
                for k in every_k[1:]]) == pytest.approx((5.2, 11.6), abs=0.05)
  assert _span([c[v, n, k][0] for v in (ref, "concept:0.001",
                                        "mixture:1e-06")
                for n in (8, 10) for k in every_k[1:]]) == (
                    pytest.approx((98.8, 100.0)))
  for n in (3, 5, 8, 10):  # no delimiter jump at k = 0: smoothing moves none
    assert c[ref, n, 0][0] == c["0", n, 0][0]
  ood = _icl_cells("OOD_sample")
  assert _span([a for (v, _, _), (a, _) in ood.items()
                if v.startswith(("concept", "mixture"))]) == pytest.approx(
                    (3.6, 13.6))
  assert _span([a for (v, _, _), (a, _) in ood.items() if v == tr]) == (
      pytest.approx((7.9, 11.9), abs=0.05))


def _draws():
  """``{(backbone, panel, method, size): [5]}``: each draw's accuracy (%),
  the mean over its tasks, from docs/results/adaptation/results.jsonl."""
  acc: dict = {}
  for d in _jsonl("adaptation", "results.jsonl"):
    acc.setdefault((d["backbone"], d["panel"], d["method"], d["size"]),
                   {}).setdefault(d["trial"], []).append(100 * d["test_accuracy"])
  return {k: np.array([np.mean(v[t]) for t in sorted(v)])
          for k, v in acc.items()}


def _t4_two_sided(t: float) -> float:
  """The two-sided p of Student's t with 4 degrees of freedom (5 paired
  draws), in closed form: ``F(t) = 1/2 + 3/8 x (1 - t^2 / (12 (1 +
  t^2 / 4)))``, ``x = t / sqrt(1 + t^2 / 4)``."""
  t = abs(t)
  x = t / np.sqrt(1 + t * t / 4)
  return 2 * (1 - (0.5 + 3 / 8 * x * (1 - t * t / (12 * (1 + t * t / 4)))))


def test_the_adaptation_page_quotes_its_lines():
  """docs/adaptation.md's findings: one vector's share of 20's gain, the
  prefix against the prompt of 5 (paired t over draws, and per draw
  against the pair's floor), LoRA r1 against the exact prompt arm, the
  `tokens` start against its twin per draw."""
  a = _draws()
  with open(os.path.join(_RESULTS, "adaptation", "noise_floor.json")) as f:
    sd = {(d["backbone"], d["method"]): d["seed_sd"] for d in json.load(f)}
  floor = lambda b, m, n: 2 * np.hypot(sd[b, m], sd[b, n])
  arm = lambda b, m, s: a[b, "left", m, s]
  sizes = (8, 12, 20, 30)
  for b, want in (("exact", (0.99, 0.21, 0.22, 0.61)),
                  ("transformer", (0.32, 0.50, 0.35, 0.46))):
    head = [arm(b, "head_linear", s) for s in sizes]
    share = [np.mean(arm(b, "prompt_linear_p1", s) - h)
             / np.mean(arm(b, "prompt_linear", s) - h)
             for s, h in zip(sizes, head)]
    assert share == pytest.approx(want, abs=0.005), b
  f = floor("transformer", "prefix_linear_p5", "prompt_linear_p5")
  assert f == pytest.approx(2.6, abs=0.05)
  for s, mean, p, below in ((8, -3.3, 0.37, 1), (12, -5.1, 0.17, 2),
                            (20, -0.9, 0.33, 1), (30, -8.0, 0.03, 4)):
    d = (arm("transformer", "prefix_linear_p5", s)
         - arm("transformer", "prompt_linear_p5", s))
    t = d.mean() / (d.std(ddof=1) / np.sqrt(len(d)))
    assert d.mean() == pytest.approx(mean, abs=0.05), s
    assert _t4_two_sided(t) == pytest.approx(p, abs=0.005), s
    assert ((d < -f).sum(), (d > f).sum()) == (below, 0), s
  margin = [arm("transformer", "lora_linear_r1", s)
            - arm("exact", "prompt_linear", s) for s in sizes]
  assert [m.mean() for m in margin] == pytest.approx([2.7, 10.9, 10.7, 9.7],
                                                     abs=0.05)
  assert margin[0].max() == pytest.approx(13.9, abs=0.05)
  assert np.sort(np.abs(margin[0]))[:4].max() <= 0.2
  for b, passed, lo, hi in (("exact", 7, -15.2, 17.4),
                            ("transformer", 5, -11.8, 14.3)):
    out = []
    for u in ("prompt_linear_p1", "prompt_linear_p5", "prompt_linear"):
      for s in sizes:
        d = arm(b, u + "_tokens", s) - arm(b, u, s)
        out += list(d[np.abs(d) > floor(b, u + "_tokens", u)])
    assert len(out) == passed, b
    assert _span(out) == pytest.approx((lo, hi), abs=0.05), b


def _best(d: dict, field: str = "r2") -> float:
  """A probe line's ``field`` at its best block by R² (not the embedding,
  not the output; within the trial's own depth)."""
  return d[field][1 + int(np.argmax(d["r2"][1:d["layers"] + 1]))]


def test_the_probes_page_quotes_its_lines():
  """docs/probes.md's Mess3 and tasks findings from the committed probe
  lines and the adaptation lines they are joined to, by plain json +
  numpy: each layer's R² and TV, the output against the best block, the
  controls, and the draw-by-draw correlations."""
  lines = _jsonl("probes", "probes.jsonl")
  pick = lambda **w: [d for d in lines if all(d[k] == v for k, v in w.items())]
  mean = lambda ds, f: np.mean([f(d) for d in ds])
  mess = {c: pick(study="mess3", control=c) for c in ("trained", "random")}
  for i, want in ((0, (0.828, 0.151, 0.828, 0.151)),
                  (1, (0.987, 0.034, 0.955, 0.063)),
                  (2, (0.999, 0.012, 0.960, 0.059)),
                  (4, (0.999, 0.010, 0.958, 0.061)),
                  (5, (1.000, 0.003, 0.422, 0.334))):
    got = [mean(mess[c], lambda d, f=f: d[f][i])
           for c in ("trained", "random") for f in ("r2", "tv")]
    assert got == pytest.approx(want, abs=5e-4), i
  tasks = pick(study="tasks", control="trained")
  for tag, want in (("vanilla-h8", (0.909, 0.996, 0.755)),
                    ("vanilla-h12", (0.717, 0.980, 0.505)),
                    ("vanilla-h20", (0.483, 0.977, 0.572)),
                    ("vanilla-h30", (0.307, 0.845, 0.093)),
                    ("memory-h4-m3", (0.817, 0.998, 0.994))):
    got = (mean(pick(study="tasks", model=tag, control="trained"),
                lambda d: d["r2"][-1]),
           mean(pick(study="tasks", model=tag, control="trained"), _best),
           mean(pick(study="tasks", model=tag, control="random"), _best))
    assert got == pytest.approx(want, abs=5e-4), tag
  first = [max(d["r2"][1:d["layers"] + 1]) - d["r2"][1] <= 0.01 for d in tasks]
  last = [np.argmax(d["r2"][1:d["layers"] + 1]) + 1 == d["layers"]
          for d in tasks]
  assert (sum(first), sum(last), len(tasks)) == (19, 12, 25)


def test_the_probes_page_quotes_its_labels_and_ginc():
  """docs/probes.md's label and GINC numbers, and the draw-by-draw
  correlations with the adaptation arms joined by HMM fingerprint."""
  lines = _jsonl("probes", "probes.jsonl")
  pick = lambda **w: [d for d in lines if all(d[k] == v for k, v in w.items())]
  mean = lambda ds, f: np.mean([f(d) for d in ds])
  for tag, want in (("vanilla-h20", (0.344, 0.980, 0.666, 0.689)),
                    ("vanilla-h30", (0.301, 0.857, 0.650, 0.713))):
    ds = pick(study="tasks", model=tag, control="trained")
    got = (mean(ds, lambda d: d["label_r2"][-1]),
           mean(ds, lambda d: _best(d, "label_r2")),
           mean(ds, lambda d: d["label_acc"][-1]),
           mean(ds, lambda d: _best(d, "label_acc")))
    assert got == pytest.approx(want, abs=5e-4), tag
  acc = {}
  for d in _jsonl("adaptation", "results.jsonl"):
    head = "attention" if d["hmm"] == "memory" else "linear"
    if d["backbone"] == "transformer" and d["method"] in (
        f"head_{head}", f"lora_{head}_r4"):
      acc[d["hmm_fingerprint"], d["method"][:4]] = 100 * d["test_accuracy"]
  tasks = pick(study="tasks", control="trained")
  loss = np.array([_best(d) - d["r2"][-1] for d in tasks])
  lora = np.array([acc[d["hmm_fingerprint"], "lora"]
                   - acc[d["hmm_fingerprint"], "head"] for d in tasks])
  tags = np.array([d["model"] for d in tasks])
  off = lambda v: v - np.array([v[tags == t].mean() for t in tags])
  assert (loss.mean(), lora.mean()) == pytest.approx((0.312, 13.4), abs=0.05)
  assert np.corrcoef(loss, lora)[0, 1] == pytest.approx(0.59, abs=0.005)
  assert np.corrcoef(off(loss), off(lora))[0, 1] == pytest.approx(
      0.30, abs=0.005)
  for (target, where), want in ((("concept", "documents"), (0.008, 0.429)),
                                (("concept", "k=8"), (-0.005, 0.143)),
                                (("state", "documents"), (0.110, 0.134))):
    ds = pick(study="ginc", control="trained", target=target, where=where)
    assert (mean(ds, lambda d: d["r2"][-1]), mean(ds, _best)) == (
        pytest.approx(want, abs=5e-4)), where
  peaks = [mean(pick(study="ginc", control="trained", target="concept",
                     where=f"k={k}"), lambda d: _best(d, "peak"))
           for k in (0, 1, 2, 4, 8, 16, 32)]
  assert (min(peaks), max(peaks)) == pytest.approx((0.388, 0.429), abs=5e-4)
