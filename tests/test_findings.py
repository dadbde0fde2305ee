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
from hmmprompt import protocol
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import reporting
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


@pytest.mark.parametrize("mid", [protocol.vanilla(12), protocol.memory(2)])
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
  assert reporting.pair_floor(floor, "exact", "prompt_linear_p1",
                              "head_linear") == pytest.approx(5.0)
  rows = {r.split("|")[4].strip(): [c.strip() for c in r.split("|")[1:-1]]
          for r in reporting.adaptation_section(lines, floor).splitlines()
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
