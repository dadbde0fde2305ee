"""PretrainConfig's checks, overrides and fallbacks, and the presets'
recipes (hmmprompt/pretrain/config.py): every refusal names its field and
is matched whole, each boundary is accepted on its side."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from hmmprompt import generative
from hmmprompt import pretrain

TINY = pretrain.preset_config("tiny")
CPU = pretrain.preset_config("cpu")  # five cycles, a target
DEEP = TINY.model.num_layers + 1


def _refused(message: str, base=TINY, **fields):
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    base.with_overrides(**fields)


def test_unknown_names_are_refused_with_the_known_ones():
  _refused("PretrainConfig.targets must be one of ('sampled', 'exact'), "
           "got 'soft'", targets="soft")
  _refused("PretrainConfig.optimizer must be one of ('adamw', 'muon'), got "
           "'sgd'", optimizer="sgd")
  _refused("PretrainConfig.fallback_init must be one of ('scratch', "
           "'warm'), got 'hot'", fallback_init="hot")
  with pytest.raises(ValueError, match=r"^unknown pretraining preset 'big'; "
                     r"known: tiny, cpu, cpu_adamw, cpu_capped, paper$"):
    pretrain.preset_config("big")


def test_rates_gaps_and_lengths_are_refused_at_their_bounds():
  for name in ("lr", "cycle_lr", "target_gap"):
    _refused(f"PretrainConfig.{name} must be > 0, got 0.0",
             **{name: 0.0})
    assert getattr(TINY.with_overrides(**{name: 1e-9}), name) == 1e-9
  for fields in (dict(state_loss=-0.5), dict(state_loss_steps=-1)):
    _refused("PretrainConfig.state_loss and state_loss_steps must be >= 0",
             **fields)
  _refused("corpus chunk_len 32 exceeds the model context max_len 31",
           model=dataclasses.replace(TINY.model, max_len=31))
  _refused("a fresh-sample corpus has no epochs: set steps", steps=None)
  for cycles in ((), (0, 40), (41, -1)):
    _refused(f"PretrainConfig.cycles must be positive step counts, got "
             f"{cycles}", cycles=cycles, steps=40)
  assert TINY.with_overrides(cycles=(1, 39)).cycle_ends == (1, 40)
  for bad in (-1, 1.5):
    _refused(f"PretrainConfig.trials_per_vmap must be an int >= 0 (0: all "
             f"trials in one vmap), got {bad!r}", trials_per_vmap=bad)
  assert TINY.with_overrides(trials_per_vmap=0).trials_per_vmap == 0


def test_fallback_depth_needs_more_layers_and_a_target():
  def message(layers, gap):
    return (f"PretrainConfig.fallback_layers = {layers} must be 0 or an int "
            f"above model.num_layers = {TINY.model.num_layers}, with a "
            f"target_gap to fall short of (got {gap})")
  _refused(message(DEEP - 1, 0.1), fallback_layers=DEEP - 1, target_gap=0.1)
  _refused(message(float(DEEP), 0.1), fallback_layers=float(DEEP),
           target_gap=0.1)
  _refused(message(DEEP, None), fallback_layers=DEEP)
  assert TINY.with_overrides(fallback_layers=DEEP,
                             target_gap=0.1).fallback_layers == DEEP


def test_fallback_gaps_need_cycles_before_the_cap_and_gaps_above():
  base = TINY.with_overrides(target_gap=0.05, fallback_layers=DEEP,
                             cycles=(10, 10, 10, 10))

  def message(cfg, gap):
    return (f"PretrainConfig.fallback_gap = {gap} needs fallback_layers, two "
            f"or more cycles and a gap above target_gap (got "
            f"fallback_layers = {cfg.fallback_layers}, cycles = "
            f"{cfg.cycles}, target_gap = {cfg.target_gap})")
  no_depth = dataclasses.replace(base, fallback_layers=0)
  one_cycle = base.with_overrides(cycles=(40,))
  for cfg, gap in ((no_depth, 0.2), (one_cycle, 0.2), (base, 0.05)):
    _refused(message(cfg, gap), base=cfg, fallback_gap=gap)
  two = base.with_overrides(cycles=(20, 20), fallback_gap=0.0500001)
  assert two.fallback_gap == 0.0500001
  gaps = base.with_overrides(fallback_gap=0.2)
  for bad in ((0.2,), (0.3, 0.3, 0.3)):
    _refused(f"PretrainConfig.fallback_gaps = {bad} needs fallback_gap and "
             f"at most 2 values, each 0 or above fallback_gap = 0.2",
             base=gaps, fallback_gaps=bad)
  _refused("PretrainConfig.fallback_gaps = (0.3,) needs fallback_gap and at "
           "most 0 values, each 0 or above fallback_gap = 0.0",
           base=base.with_overrides(cycles=(20, 20)), fallback_gaps=(0.3,))
  assert gaps.with_overrides(fallback_gaps=(0.0, 0.21)).fallback_gaps == (
      0.0, 0.21)


def test_falls_back_at_the_cycle_ends_it_names_only():
  three = TINY.with_overrides(target_gap=0.05, fallback_layers=DEEP,
                              cycles=(10, 10, 20), fallback_gap=0.2)
  falls = lambda cfg, step, gap: cfg.falls_back({"step": step,
                                                 "ce_gap": gap})
  # The last cycle end before the cap (20, not 10 or 30) checks
  # fallback_gap; the cap checks target_gap.
  assert [falls(three, 20, 0.21), falls(three, 20, 0.2),
          falls(three, 10, 9.0), falls(three, 40, 0.06),
          falls(three, 40, 0.05), falls(three, 30, 9.0)] == [
              True, False, False, True, False, False]
  assert not three.falls_back({"step": 40})  # a line without a gap
  # Without fallback_gap, only the cap checks.
  cap_only = dataclasses.replace(three, fallback_gap=0.0)
  assert [falls(cap_only, 20, 9.0), falls(cap_only, 40, 0.06)] == [False,
                                                                   True]
  assert not falls(dataclasses.replace(three, fallback_layers=0,
                                      fallback_gap=0.0), 40, 9.0)


def test_a_fallback_is_the_deeper_one_trial_run_seeded_as_its_trial():
  cfg = TINY.with_overrides(target_gap=0.05, fallback_layers=DEEP,
                            cycles=(10, 10, 10, 10), fallback_gap=0.2,
                            fallback_gaps=(0.4,), seed=5)
  deep = cfg.fallback(2)
  assert deep.model == dataclasses.replace(cfg.model, num_layers=DEEP)
  assert (deep.seed, deep.fallback_layers, deep.fallback_gap,
          deep.fallback_gaps) == (7, 0, 0.0, ())
  assert type(deep.fallback_gap) is float  # pylint: disable=unidiomatic-typecheck
  assert dataclasses.replace(deep, model=cfg.model, seed=5, fallback_layers=DEEP,
                             fallback_gap=0.2, fallback_gaps=(0.4,)) == cfg


def test_steps_and_cycles_override_each_other():
  # A steps override keeps the cycles that fit and cuts or lengthens the last.
  cut = lambda steps: CPU.with_overrides(steps=steps).cycles
  assert cut(1000) == (1000,)
  assert cut(1001) == (1000, 1)
  assert cut(3500) == (1000, 2000, 500)
  assert cut(31000) == CPU.cycles
  assert cut(31001) == (1000, 2000, 4000, 8000, 16001)
  # A cycles override sets steps to their sum; given both, they must agree.
  assert CPU.with_overrides(cycles=(3, 4)).steps == 7
  assert CPU.with_overrides(cycles=(3, 4), steps=7).cycles == (3, 4)
  _refused("PretrainConfig.steps = 8 must equal sum(cycles) = 7", base=CPU,
           cycles=(3, 4), steps=8)


def test_configure_sets_the_context_on_both_sides_and_the_dtype(monkeypatch):
  cfg = pretrain.configure("tiny", 7, context=16, model={"num_heads": 4},
                           corpus={"val_seqs": 3}, lr=0.5)
  assert (cfg.model.vocab_size, cfg.model.max_len, cfg.corpus.chunk_len,
          cfg.model.num_heads, cfg.corpus.val_seqs, cfg.lr) == (
              7, 16, 16, 4, 3, 0.5)
  assert cfg.model.dtype == "float32"  # "auto" on the CPU
  assert pretrain.configure("tiny", dtype="bfloat16").model.dtype == "bfloat16"
  assert pretrain.configure("tiny", context=None) == pretrain.configure("tiny")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert pretrain.configure("tiny").model.dtype == "bfloat16"


def test_the_cpu_presets_are_the_recipes_their_results_were_measured_with():
  """docs/pretraining.md measured these recipes (the 13 draws, the hard
  set, the main job); ``cpu_capped`` is pinned by the committed
  identities (tests/test_figure3.py), ``paper`` by Appendix D."""
  for name in pretrain.PRESETS:
    assert pretrain.preset_config(name, vocab_size=7).model.vocab_size == 7
  m, c = CPU.model, CPU.corpus
  assert (m.d_model, m.num_heads, m.d_ff, m.num_layers, m.max_len) == (
      64, 4, 256, 2, 80)
  assert (c.chunk_len, c.mask_rate, c.fresh, c.val_seqs) == (80, 0.15, True,
                                                             256)
  assert (CPU.lr, CPU.warmup_steps, CPU.batch_size, CPU.steps, CPU.cycles,
          CPU.target_gap, CPU.targets) == (
              3e-3, 200, 64, 31000, (1000, 2000, 4000, 8000, 16000), 0.04,
              "exact")
  # Runtime settings (docs/performance.md: one trial at a time on XLA:CPU).
  assert (CPU.log_every, CPU.eval_every, CPU.ckpt_every, CPU.keep,
          CPU.trials_per_vmap) == (100, 500, 500, 2, 1)
  adamw = pretrain.preset_config("cpu_adamw")
  assert adamw == CPU.with_overrides(
      batch_size=32, lr=5e-3, cycles=(500, 500, 1000), cycle_lr=1.0,
      model=dataclasses.replace(m, pos_init="sinusoid"),
      corpus=dataclasses.replace(c, corruption="mask"))
  assert (TINY.steps, TINY.lr, TINY.warmup_steps, TINY.batch_size,
          TINY.log_every, TINY.eval_every, TINY.ckpt_every, TINY.keep,
          TINY.trials_per_vmap) == (40, 3e-3, 5, 8, 10, 20, 10, 2, 1)


# The binary's config tree (hmmprompt/pretrain/job.py).


def _leaves(model):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(model)]


def test_a_job_refuses_an_unknown_kind_and_a_bad_trial_count_by_name():
  with pytest.raises(ValueError, match=r"^model_kind must be one of "
                     r"\('vanilla', 'memory'\), got 'mixed'$"):
    pretrain.Job(pretrain=TINY, model_kind="mixed")
  for bad in (0, -1, 1.0, "2"):
    with pytest.raises(ValueError, match="^" + re.escape(
        f"trials must be an int >= 1, got {bad!r}") + "$"):
      pretrain.Job(pretrain=TINY, trials=bad)
  assert pretrain.Job(pretrain=TINY, model_kind="memory", trials=1).trials == 1


def test_a_job_is_its_preset_with_flag_strings_parsed():
  assert pretrain.Job.of() == pretrain.Job(pretrain=CPU)
  job = pretrain.Job.of("tiny", **{"num_states": "7", "pretrain.lr": "0.02",
                                   "model_kind": "memory", "trials": 3})
  assert job == pretrain.Job(pretrain=TINY.with_overrides(lr=0.02),
                             model_kind="memory", num_states=7, trials=3)
  with pytest.raises(ValueError, match=r"^unknown config key 'states'; "
                     r"known keys: hmm_seed, memory_size, model_kind, "):
    pretrain.Job.of("tiny", states=7)


@pytest.mark.parametrize("kind", ["vanilla", "memory"])
def test_a_jobs_trial_k_is_the_model_drawn_from_its_seed_folded_with_k(kind):
  job = pretrain.Job(pretrain=TINY, model_kind=kind, num_states=5,
                     memory_size=2, hmm_seed=3)
  vocab = TINY.model.vocab_size
  one = generative.random_model(jax.random.PRNGKey(3), kind, 5, vocab, 2)
  for got, want in zip(_leaves(job.make_model()), _leaves(one)):
    np.testing.assert_array_equal(got, want[None])
  for num in (2, 3):
    stacked = dataclasses.replace(job, trials=num).make_model()
    for k in range(num):
      drawn = generative.random_model(
          jax.random.fold_in(jax.random.PRNGKey(3), k), kind, 5, vocab, 2)
      for got, want in zip(_leaves(stacked), _leaves(drawn)):
        assert got.shape[0] == num
        np.testing.assert_array_equal(got[k], want)
  # The draws differ between trials and between seeds.
  assert not np.array_equal(_leaves(stacked)[0][0], _leaves(stacked)[0][1])
  other = dataclasses.replace(job, hmm_seed=4).make_model()
  assert not np.array_equal(_leaves(other)[0], _leaves(job.make_model())[0])
