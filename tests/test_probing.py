"""The probes study (hmmprompt.probing): its Mess3 stack end to end
on the tiny preset, a rerun that adds nothing, another setup refused, the
targets it builds (the causal belief, GINC's concept posterior) against
independent computations, and the report's join with the adaptation arms."""

import json

import jax
import numpy as np
import pytest

from hmmprompt import probing
from hmmprompt.probing import sweep
from hmmprompt import corpus
from hmmprompt import ginc
from hmmprompt import hmm as hmm_lib
from hmmprompt import mess3


def test_the_causal_targets_are_the_belief_before_each_symbol():
  """Position ``t`` of a causal input reads ``x_<t``: its target is Mess3's
  belief after ``t`` symbols (:func:`mess3.beliefs` one step back), and the
  stationary prior (uniform) at the start of text."""
  model = mess3.as_hmm(mess3.edge_tensor())
  setup = probing.get_setup("tiny")
  inputs, pred = sweep._stack(setup, "mess3", model, 4, 6)
  tokens = inputs[:, 1:]  # x_0 .. x_{T-2}
  beliefs = pred.reshape(4, 6, 3, 3).sum(-1)
  np.testing.assert_allclose(beliefs[:, 0], np.full((4, 3), 1 / 3), atol=1e-6)
  after = jax.vmap(lambda t: mess3.beliefs(model, t))(tokens)
  np.testing.assert_allclose(beliefs[:, 1:], after, atol=1e-5)
  assert (inputs[:, 0] == hmm_lib.MASK).all()


def test_a_concepts_posterior_is_its_blocks_mass():
  """GINC's concept posterior (a block's states summed) against Bayes' rule
  over the concepts, each concept's own forward probability of the prefix
  in float64 numpy."""
  small = ginc.GincConfig(num_values=2, num_slots=3, num_symbols=6,
                          num_concepts=3)
  concepts, _ = ginc.concepts(jax.random.PRNGKey(0), small)
  mix = ginc.mixture(concepts)
  tokens = corpus.sample_sequences(jax.random.PRNGKey(1), mix, 3, 7)
  pred = sweep._predicted(mix, tokens)
  per = len(mix.initial) // len(concepts.initial)
  got = np.asarray(pred).reshape(3, 7, -1, per).sum(-1)
  for n in range(3):
    for t in range(7):
      like = []
      for c in range(len(concepts.initial)):
        a = np.asarray(concepts.initial[c], np.float64)
        trans = np.asarray(concepts.transition[c], np.float64)
        emit = np.asarray(concepts.emission[c], np.float64)
        for x in np.asarray(tokens[n, :t]):
          a = (a * emit[:, x]) @ trans
        like.append(a.sum() / len(concepts.initial))
      np.testing.assert_allclose(got[n, t], np.array(like) / sum(like),
                                 atol=1e-5)


def _mess3_only(tmp_path):
  setup = probing.get_setup("tiny", studies=("mess3",))
  return setup, str(tmp_path)


@pytest.mark.slow  # a pretraining loop, every control, the report
def test_the_mess3_stack_runs_resumes_and_reports(tmp_path):
  """Every control's lines, an input per layer and the output; the
  shuffled control's best held-out R² near 0 (40 held-out sequences of 10
  positions: far below the trained one's); a rerun adds nothing; the simplex figure
  and the report's table are written."""
  setup, workdir = _mess3_only(tmp_path)
  lines = probing.run_probes(setup, workdir)
  assert {(r.control, r.trial) for r in lines} == {
      (c, k) for c in probing.CONTROLS for k in range(2)}
  for r in lines:
    assert r.inputs == ["embed", *(f"block {i}" for i in range(1, 5)),
                        "output"] and len(r.r2) == 6
    assert r.layers == 4 and r.rows == 40 * 10
  shuffled = [r.best_r2 for r in lines if r.control == "shuffled"]
  trained = [r.best_r2 for r in lines if r.control == "trained"]
  assert max(shuffled) < 0.1 < min(trained)
  before = open(probing.lines_path(workdir)).read()
  probing.run_probes(setup, workdir)
  assert open(probing.lines_path(workdir)).read() == before
  text = probing.write_report(workdir)
  assert "## Mess3" in text and "A smoke test" in text
  assert "## GINC" not in text
  assert (tmp_path / "mess3_simplex.png").stat().st_size > 10_000
  with pytest.raises(ValueError, match="probe setup"):
    probing.check_workdir(workdir, probing.get_setup(
        "tiny", studies=("mess3",), mess3_sequences=300))


def test_the_report_joins_the_arms_by_fingerprint(tmp_path):
  """The adaptation arms are read for the draw of the same HMM alone: a
  line of another fingerprint is not joined."""
  rows = [dict(hmm="vanilla", num_states=8, memory_size=0, trial=0,
               hmm_fingerprint="abc", backbone=b, method=m, features="raw",
               test_accuracy=acc, pretrain_ce_gap=0.03)
          for b, m, acc in (("transformer", "head_linear", 0.8),
                            ("transformer", "lora_linear_r4", 0.9),
                            ("exact", "prompt_linear", 0.95),
                            ("transformer", "lora_linear_r1", 0.1))]
  path = tmp_path / "results.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  got = probing.adaptation_accuracy(str(path))
  assert got == {("vanilla-h8", 0, "abc"): {
      "head": 0.8, "LoRA": 0.9, "exact prompt": 0.95, "gap": 0.03}}


def test_a_bad_setup_is_named():
  with pytest.raises(ValueError, match="studies"):
    probing.get_setup("tiny", studies=("mess4",))
  with pytest.raises(ValueError, match="causal model of Mess3"):
    probing.get_setup("tiny", {"mess3.model.causal": "false"})
