"""hmmprompt.figure3.sweep in process, tuning stood in for: which cells a
sweep tunes, in which programs, what each result line records, and how a
rerun, a shard, a claim and a deadline divide the work. (The real tuning
end to end: tests/integration/test_figure3_sweep.py.)"""

import dataclasses
import json
import os
import re
import time

import jax
import numpy as np
import pytest

from hmmprompt import figure3
from hmmprompt import generative
from hmmprompt import pretrain
from hmmprompt.pretrain import TrialInfo
from hmmprompt import protocol
from hmmprompt import scheduling
from hmmprompt import files as files_lib
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import sweep
from hmmprompt.backbones import transformer

# Two left sizes, the second (8 = 4 x 2) also the right panel's vanilla
# twin, so one stack serves both panels with their own trial counts.
SETUP = figure3.get_setup("tiny", trials=2, right_trials=1, tasks_per_hmm=2,
                          left_sizes=(4, 8), memory_sizes=(2,),
                          features=("raw",))
H4, H8, M2 = protocol.vanilla(4), protocol.vanilla(8), protocol.memory(2)


def _fields(cfg, k, s):
  """The stand-in's result fields: distinct per arm, trial and task."""
  arm = {"head": 0.0, "prompt": 0.5, "finetune": 0.125}[cfg.method] + (
      0.25 if cfg.head == "attention" else 0.0)
  return dict(test_accuracy=arm + k / 10 + s / 100, val_accuracy=0.5,
              train_accuracy=0.25, final_loss=1.0 + s, steps=7 + k,
              seconds=0.5)


@pytest.fixture
def tuned(monkeypatch):
  """Replaces ``protocol.tune_lanes``; its calls: ``(method, head,
  optimizer, lanes, trials in params, stack's trials)``."""
  calls = []

  def tune_lanes(setup, cfg, backbone, params_L, lanes, stack):
    assert backbone.name in ("exact", "transformer")
    calls.append((cfg.method, cfg.head, cfg.optimizer,
                  [(k, list(ss)) for k, ss in lanes],
                  jax.tree.leaves(params_L)[0].shape[0],
                  generative.num_trials(stack.models_K)))
    return [[_fields(cfg, k, s) for s in ss] for k, ss in lanes]

  monkeypatch.setattr(protocol, "tune_lanes", tune_lanes)
  return calls


@pytest.mark.slow  # 2.8 s: the full suite's
def test_a_sweep_files_each_cell_once_with_its_draw(tmp_path, tuned):
  workdir = str(tmp_path)
  assert sweep.run_sweep(SETUP, workdir, "both", "exact") == []
  # One program per group, over the rectangle of its trials x tasks; the
  # stack holds the most trials any panel reads.
  assert tuned == [
      ("head", "linear", "adam", [(0, [0, 1]), (1, [0, 1])], 2, 2),
      ("prompt", "linear", "adam", [(0, [0, 1]), (1, [0, 1])], 2, 2),
      ("head", "linear", "adam", [(0, [0, 1]), (1, [0, 1])], 2, 2),
      ("prompt", "linear", "adam", [(0, [0, 1]), (1, [0, 1])], 2, 2),
      ("head", "linear", "adam", [(0, [0, 1])], 1, 2),
      ("head", "attention", "adam", [(0, [0, 1])], 1, 1)]
  lines = schema.read_results(workdir)
  assert len(lines) == len({r.key() for r in lines}) == 20
  cells = {(r.panel, r.hmm, r.size, r.method): set() for r in lines}
  for r in lines:
    cells[r.panel, r.hmm, r.size, r.method].add((r.trial, r.task))
  both, one = {(0, 0), (0, 1), (1, 0), (1, 1)}, {(0, 0), (0, 1)}
  assert cells == {("left", "vanilla", 4, "head_linear"): both,
                   ("left", "vanilla", 4, "prompt_linear"): both,
                   ("left", "vanilla", 8, "head_linear"): both,
                   ("left", "vanilla", 8, "prompt_linear"): both,
                   ("right", "vanilla", 8, "head_linear"): one,
                   ("right", "memory", 8, "head_attention"): one}
  for mid in (H4, H8, M2):
    stack = protocol.draw_stack(SETUP, mid, configs.stack_sizes(SETUP)[mid],
                                SETUP.tasks_per_hmm, verdicts=True)
    for r in lines:
      if (r.hmm, r.num_states, r.memory_size) != (mid.hmm, mid.num_states,
                                                 mid.memory_size):
        continue
      group, = [g for g in configs.plan(SETUP)[mid]
                if (g.panel, g.method_name) == (r.panel, r.method)]
      cfg = group.tune_config(SETUP.tune)
      want = dict(
          backbone="exact", features="raw", setup=SETUP.fingerprint("exact"),
          hmm_fingerprint=stack.fingerprints[r.trial],
          task_redraws=stack.tasks[r.trial][r.task].redraws,
          assumptions=stack.verdicts[r.trial][r.task],
          tune_config=dataclasses.asdict(cfg),
          task_config=dataclasses.asdict(SETUP.task), pretrain_steps=None,
          pretrain_ce_gap=None, **_fields(cfg, r.trial, r.task))
      assert {f: getattr(r, f) for f in want} == want
  assert {r.size for r in lines if r.hmm == "memory"} == {8}
  assert {r.memory_size for r in lines} == {0, 2}

  # A rerun tunes nothing; a lost cell is tuned alone, in its own program.
  tuned.clear()
  assert sweep.run_sweep(SETUP, workdir, "both", "exact") == []
  assert tuned == []
  path = schema.results_path(workdir)
  kept = [r for r in lines if not (r.method == "prompt_linear" and r.size == 4
                                   and (r.trial, r.task) == (1, 0))]
  files_lib.atomic_write_text(path, "".join(
      json.dumps(r.to_json()) + "\n" for r in kept))
  sweep.run_sweep(SETUP, workdir, "both", "exact")
  assert tuned == [("prompt", "linear", "adam", [(1, [0])], 1, 2)]
  assert sorted(r.key() for r in schema.read_results(workdir)) == sorted(
      r.key() for r in lines)


@pytest.mark.slow
def test_missing_cells_are_the_plans_cells_without_a_line(tmp_path, tuned):
  workdir = str(tmp_path)
  missing = sweep.missing_cells(SETUP, workdir, "both", "exact")
  assert list(missing) == [H4, H8, M2]
  assert [(g.panel, g.method_name, len(c)) for g, c in missing[H8].items()
          ] == [("left", "head_linear", 4), ("left", "prompt_linear", 4),
                ("right", "head_linear", 2)]
  assert [(g.panel, c) for g, c in missing[H8].items()][-1] == (
      "right", {(0, 0), (0, 1)})
  sweep.run_sweep(SETUP, workdir, "left", "exact")
  left_done = sweep.missing_cells(SETUP, workdir, "both", "exact")
  assert left_done[H4] == {}
  assert [g.panel for g in left_done[H8]] == ["right"]
  assert list(left_done[M2]) == [g for g in configs.plan(SETUP)[M2]]
  # Lines of another backbone or setup are another sweep's cells.
  assert sweep.missing_cells(SETUP, workdir, "left", "transformer")[H4]
  other = dataclasses.replace(SETUP, seed=SETUP.seed + 1)
  assert sweep.missing_cells(other, workdir, "left", "exact")[H4]
  assert sweep.missing_cells(SETUP, workdir, "left", "exact") == {
      H4: {}, H8: {}}


@pytest.mark.slow
def test_shards_claims_and_deadlines_divide_whole_stacks(tmp_path, tuned):
  order = list(configs.plan(SETUP))
  assert order == [H4, H8, M2]
  for i in range(2):
    workdir = str(tmp_path / "sharded")
    tuned.clear()
    sweep.run_sweep(SETUP, workdir, "both", "exact",
              scheduling.Schedule(num_hosts=2, host_index=i))
    lines = files_lib.read_jsonl(schema.results_path(workdir, 2, i))
    assert os.path.basename(schema.results_path(workdir, 2, i)) == (
        f"results-0000{i}-of-00002.jsonl")
    mine = {(m["hmm"], m["num_states"]) for m in lines}
    assert mine == ({("vanilla", 4), ("memory", 4)} if i == 0
                    else {("vanilla", 8)})
  assert len(schema.read_results(str(tmp_path / "sharded"))) == 20

  asked = []
  claimed = str(tmp_path / "claimed")
  sweep.run_sweep(SETUP, claimed, "both", "exact", scheduling.Schedule(
      claim=lambda mid: asked.append(mid) or mid != H4),
            results_file=os.path.join(claimed, "mine.jsonl"))
  # The costliest first: the largest stacks, then |H| x max(|M|, 1).
  assert asked == [H8, H4, M2]
  assert {(m["hmm"], m["num_states"]) for m in files_lib.read_jsonl(
      os.path.join(claimed, "mine.jsonl"))} == {("vanilla", 8),
                                                ("memory", 4)}

  tuned.clear()
  late = str(tmp_path / "late")
  assert sweep.run_sweep(SETUP, late, "both", "exact", scheduling.Schedule(
      deadline=time.monotonic() - 1)) == [m.tag for m in order]
  assert tuned == [] and schema.read_results(late) == []


@pytest.mark.parametrize("kwargs,message", [
    (dict(backbone_name="bert"), "backbone must be one of ('exact', "
     "'transformer'), got 'bert'"),
    (dict(panel="top"), "panel must be left, right or both, got 'top'"),
    (dict(schedule=scheduling.Schedule(num_hosts=2, host_index=2)),
     "host_index 2 not in [0, 2) (num_hosts 2; the binaries' --task_index "
     "and --num_tasks)"),
    (dict(schedule=scheduling.Schedule(num_hosts=2, host_index=-1)),
     "host_index -1 not in [0, 2) (num_hosts 2; the binaries' --task_index "
     "and --num_tasks)"),
    (dict(schedule=scheduling.Schedule(num_hosts=0, host_index=0)),
     "host_index 0 not in [0, 0) (num_hosts 0; the binaries' --task_index "
     "and --num_tasks)")])
def test_a_bad_run_is_refused_by_name_before_any_work(tmp_path, tuned,
                                                      kwargs, message):
  args = {**dict(setup=SETUP, workdir=str(tmp_path / "w"), panel="both",
                 backbone_name="exact"), **kwargs}
  with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
    sweep.run_sweep(**args)
  assert not os.path.exists(tmp_path / "w") and tuned == []


def test_exact_backbones_are_the_stacks_hmms(tmp_path):
  models = protocol.make_models(SETUP, H8, configs.stack_sizes(SETUP)[H8])
  assert generative.num_trials(models) == 2
  bb, params_K, fields, configs_K, shallow = sweep.backbones(
      str(tmp_path), SETUP, H8, models, "exact")
  assert bb.name == "exact" and fields == [{}, {}] and configs_K == [None] * 2
  assert shallow == {}
  for k in range(2):
    want = generative.as_hmm(generative.trial(models, k))
    for a, b in zip(jax.tree.leaves(params_K), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a[k], b)
  assert not os.listdir(tmp_path)  # nothing pretrained


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_stack_with_a_deeper_trial_has_a_backbone_per_depth(monkeypatch,
                                                              dtype):
  """A trial that fell back to more layers pads the stack: the deepest
  config's backbone serves the stack, each shallower depth has its own,
  all in the tuning dtype (what tune_group tunes each trial with)."""
  setup = dataclasses.replace(SETUP, tune=dataclasses.replace(
      SETUP.tune, backbone_dtype=dtype))
  models = protocol.make_models(setup, H4, 2)
  shallow = setup.pretrain.model
  deep = dataclasses.replace(shallow, num_layers=shallow.num_layers + 2)
  infos = [TrialInfo(dataclasses.replace(setup.pretrain, model=m),
                     generative.trial(models, k), {"ce_gap": 0.01}, 30)
           for k, m in enumerate((deep, shallow))]
  monkeypatch.setattr(protocol, "pretrained", lambda *_, **__: (
      transformer.make_backbone(deep), {"w": np.zeros((2, 3))}, infos))
  bb, _, fields, configs, by_depth = sweep.backbones(
      "unused", setup, H4, models, "transformer")
  assert configs == [deep, shallow] and fields[0]["pretrain_ce_gap"] == 0.01
  assert bb is transformer.make_backbone(deep, dtype)
  assert by_depth == {shallow.num_layers: transformer.make_backbone(shallow,
                                                                    dtype)}


def test_a_stack_without_verdicts_is_refused_by_name(tuned):
  mid = M2
  stack = protocol.draw_stack(SETUP, mid, 1, 1)
  models = stack.models_K
  trials = sweep.Trials(stack, *sweep.backbones("unused", SETUP, mid, models,
                                                "exact"))
  group = configs.plan(SETUP)[mid][0]
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{mid}: the stack has no assumption verdicts") + "$"):
    sweep.tune_group(SETUP, "exact", group, trials, {(0, 0)})


def test_claims_take_the_costliest_stack_first(tmp_path, tuned):
  """Equal stack sizes: ``|H| x max(|M|, 1)`` orders them, the plan's order
  breaking ties."""
  setup = dataclasses.replace(SETUP, right_trials=2)
  asked = []
  sweep.run_sweep(setup, str(tmp_path), "both", "exact", scheduling.Schedule(
      claim=lambda mid: asked.append(mid) or False))
  assert asked == [H8, M2, H4] and tuned == []


def test_each_panel_alone_plans_and_runs_its_own_groups(tmp_path, tuned):
  """The right panel alone, the features of each group, and the L-BFGS
  twin on its head's panel."""
  assert {m: [(g.panel, g.method_name) for g in gs] for m, gs in
          configs.plan(SETUP, "right").items()} == {
              H8: [("right", "head_linear")], M2: [("right", "head_attention")]}
  sweep.run_sweep(SETUP, str(tmp_path), "right", "exact")
  assert {(r.panel, r.hmm) for r in schema.read_results(str(tmp_path))} == {
      ("right", "vanilla"), ("right", "memory")}
  two = dataclasses.replace(SETUP, features=("raw", "log"), head_optimum=True)
  groups = [g for gs in configs.plan(two).values() for g in gs]
  assert {(g.panel, g.method_name, g.features) for g in groups} == {
      (panel, method, f) for f in ("raw", "log") for panel, method in (
          ("left", "head_linear"), ("left", "head_linear_lbfgs"),
          ("left", "prompt_linear"), ("right", "head_linear"),
          ("right", "head_linear_lbfgs"), ("right", "head_attention"))}
  assert len(groups) == 2 * (2 * 3 + 3)  # two left sizes


def test_the_stamp_is_written_once_by_whoever_may_write(tmp_path,
                                                         monkeypatch):
  """``write=False`` (a chunk's results directory) and processes other
  than 0 check without writing; an earlier version's stamp of other
  counts is refused whole."""
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  sweep.check_workdir(str(fresh), SETUP, write=False)
  assert not (fresh / "sweep.json").exists()
  monkeypatch.setattr(sweep.jax, "process_index", lambda: 1)
  sweep.check_workdir(str(fresh), SETUP)
  assert not (fresh / "sweep.json").exists()
  monkeypatch.setattr(sweep.jax, "process_index", lambda: 0)
  sweep.stamp(str(fresh), SETUP.identity())
  assert (json.loads((fresh / "sweep.json").read_text())
          == json.loads(json.dumps(SETUP.identity())))
  old = tmp_path / "old"
  old.mkdir()
  (old / "sweep.json").write_text('{"trials": 2, "right_trials": 1}')
  sweep.check_workdir(str(old), SETUP, write=False)  # checked, kept
  assert (old / "sweep.json").read_text() == '{"trials": 2, "right_trials": 1}'
  (old / "sweep.json").write_text('{"trials": 3, "right_trials": 3}')
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{old} holds results of another setup (right_trials: 3 -> 1; "
      f"trials: 3 -> 2); use a new --workdir (or the same config) to "
      f"resume") + "$"):
    sweep.check_workdir(str(old), SETUP)
  (old / "sweep.json").write_text('{"trials": 2, "right_trials": 1}')
  other = dataclasses.replace(SETUP, seed=SETUP.seed + 1)
  sweep.check_workdir(str(old), SETUP)  # upgraded to the whole identity
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{old} holds results of another setup (seed: {SETUP.seed} -> "
      f"{other.seed}); use a new --workdir (or the same config) to resume")
      + "$"):
    sweep.check_workdir(str(old), other)


class _Calls(list):
  stop_ats: list = []
  keep_bys: list = []

  def __init__(self):
    super().__init__()
    self.stop_ats, self.keep_bys = [], []


@pytest.fixture
def pretrained(monkeypatch):
  """Stands in for pretraining and loading a stack of transformers: each
  trial's info as ``pretrain.load_trials`` gives it, checkpointed or in
  memory; the calls ``(pdir, recipe, models)``, each one's ``stop_at`` in
  ``.stop_ats`` and ``keep_by`` (in memory) in ``.keep_bys``."""
  calls = _Calls()

  def run_trials(pdir, cfg, models_K, log=None, stop_at=None, keep_by=None):
    calls.append((pdir, cfg, models_K))
    calls.stop_ats.append(stop_at)
    calls.keep_bys.append(keep_by)

  def train_trials(pdir, cfg, models_K, log=None, stop_at=None,
                   checkpoints="never", keep_by=None):
    run_trials(pdir, cfg, models_K, stop_at=stop_at, keep_by=keep_by)
    return load_trials(pdir)

  def load_trials(pdir):
    (_, cfg, models_K), = [c for c in calls if c[0] == pdir][-1:]
    num = generative.num_trials(models_K)
    infos = [TrialInfo(cfg, generative.trial(models_K, k), {
        "ce_gap": 0.01 * (k + 1), "tv": 0.1, "mlm_ce": 1.5, "bayes_ce": 1.4,
        "wall_s": 2.0 + k, "layers": None}, 30 + k) for k in range(num)]
    return (transformer.make_backbone(cfg.model), {"w": np.zeros((num, 3))},
            infos)

  monkeypatch.setattr(protocol.pretrain_lib, "run_trials", run_trials)
  monkeypatch.setattr(protocol.pretrain_lib, "load_trials", load_trials)
  monkeypatch.setattr(protocol.pretrain_lib, "train_trials", train_trials)
  return calls


@pytest.mark.slow
def test_a_transformer_sweep_pretrains_each_stack_in_its_own_directory(
    tmp_path, tuned, pretrained):
  setup = dataclasses.replace(SETUP, finetune=True)
  workdir = str(tmp_path)
  sweep.run_sweep(setup, workdir, "left", "transformer")
  assert [(pdir, cfg) for pdir, cfg, _ in pretrained] == [
      (protocol.pretrain_dir(workdir, setup, mid), setup.pretrain)
      for mid in (H4, H8)]
  for (_, _, models), mid in zip(pretrained, (H4, H8)):
    assert generative.same(models, protocol.make_models(
        setup, mid, configs.stack_sizes(setup)[mid]))
  assert [c[:3] for c in tuned] == [
      ("head", "linear", "adam"), ("prompt", "linear", "adam"),
      ("finetune", "linear", "adam")] * 2
  lines = schema.read_results(workdir)
  assert len(lines) == 2 * 3 * 4
  for r in lines:
    assert (r.backbone, r.setup) == ("transformer",
                                     setup.fingerprint("transformer"))
    assert (r.pretrain_ce_gap, r.pretrain_steps, r.pretrain_wall_s) == (
        0.01 * (r.trial + 1), 30 + r.trial, 2.0 + r.trial)
  assert setup.fingerprint("transformer") != setup.fingerprint("exact")
  assert not sweep.missing_cells(setup, workdir, "left", "transformer")[H4]
  tuned.clear()
  sweep.run_sweep(setup, workdir, "left", "transformer")  # its own lines: done
  assert tuned == []
  # Fine-tuning is an arm of the transformer's only when asked for.
  assert [g.method_name for g in configs.plan(SETUP, "left", "transformer")[
      H4]] == ["head_linear", "prompt_linear"]
  assert [g.method_name for g in configs.plan(setup, "left", "exact")[H4]] == [
      "head_linear", "prompt_linear"]
  # pretrain_sweep pretrains the claimed stacks and tunes nothing.
  pretrained.clear()
  tuned.clear()
  asked = []
  sweep.pretrain_sweep(setup, str(tmp_path / "p"), "both",
                       scheduling.Schedule(
                           claim=lambda mid: asked.append(mid) or mid != H4))
  assert asked == [H8, H4, M2] and tuned == []
  assert [(pdir, cfg) for pdir, cfg, _ in pretrained] == [
      (protocol.pretrain_dir(str(tmp_path / "p"), setup, mid), setup.pretrain)
      for mid in (H8, M2)]
  # The transformer's context bounds its inputs, before any work.
  long = figure3.get_setup("tiny", overrides={"task.seq_len": "40"})
  with pytest.raises(ValueError, match="^" + re.escape(
      f"prompt_len + 1 + seq_len = {long.input_len} positions exceed the "
      f"pretrained context of {long.pretrain.model.max_len}")):
    sweep.run_sweep(long, str(tmp_path / "long"), "left", "transformer")
  sweep.run_sweep(long, str(tmp_path / "long"), "left", "exact")  # no context


def _stub_line(mid, g, final_loss=0.0) -> schema.ResultLine:
  """A stand-in tuning group ``g``'s one line on stack ``mid``."""
  return schema.ResultLine(
      backbone="exact", panel="left", hmm="vanilla", num_states=mid.num_states,
      memory_size=0, trial=0, task=g, method="head_linear", features="raw",
      setup="s", hmm_fingerprint="f", size=mid.num_states, test_accuracy=1.0,
      val_accuracy=1.0, train_accuracy=1.0, final_loss=final_loss, steps=1,
      seconds=10.0, task_redraws=0, assumptions={}, tune_config={},
      task_config={})


@pytest.fixture
def fake_clock(monkeypatch):
  """``(clock, logged)``: ``run_stacks``' clocks read ``clock[0]`` (set it;
  0 at first), and its info and warning lines are appended to ``logged``."""
  clock, logged = [0.0], []
  monkeypatch.setattr(protocol.time, "monotonic", lambda: clock[0])
  monkeypatch.setattr(protocol.time, "perf_counter", lambda: clock[0])
  for level in ("info", "warning"):
    monkeypatch.setattr(protocol.logging, level,
                        lambda fmt, *args: logged.append(fmt % args))
  return clock, logged


def test_a_hard_deadline_skips_stacks_it_cannot_finish_and_stops_between_groups(
    tmp_path, fake_clock):
  """``stop_at``: a stack starts only if its estimate (its weight times the
  seconds per weight of the stacks finished, or the prior before any) ends
  by the deadline; at the deadline the run stops between two groups, the
  finished groups' lines on disk. A fake clock: each tuned group takes 10
  seconds, each stack's prepare 5."""
  clock, logged = fake_clock
  a, b, c = (protocol.vanilla(h) for h in (4, 8, 12))
  made, path = [], str(tmp_path / "results.jsonl")

  def prepare(mid, groups):
    assert groups  # the stack's groups to tune, never an empty stack
    made.append(mid)
    clock[0] += 5
    return mid

  def tune(g, mid):
    clock[0] += 10
    return [_stub_line(mid, g)]

  weights = {a: 1, b: 2, c: 1}
  run = lambda todo, **kw: protocol.run_stacks(
      todo, prepare, tune, path, scheduling.Schedule(**kw),
      weight=weights.get)
  # Under stop_at the cheapest run first: a, c, b. a: 25 s by the prior
  # (25 per weight); c (25 s) ends at 50; b (50 s) would end at 100 > 60.
  assert run({a: [0, 1], b: [0, 1], c: [0, 1]}, stop_at=60.0,
             seconds_per_weight=25.0) == [b.tag]
  assert made == [a, c] and clock[0] == 50
  # What the run says: each group's line with its elapsed time and an ETA
  # from the groups done (15 s, 25, 40, 50 for 1-4 of the 6), the stack it
  # does not start and why, the skipped stacks at the end.
  progress = "[{}/6 groups] vanilla-h{} {}: test acc 1.000 +- 0.000 over 1 " \
             "lines (10.0s); elapsed {}s, ETA {}s"
  assert logged == [
      progress.format(1, 4, 0, 15, 75), progress.format(2, 4, 1, 25, 50),
      progress.format(3, 12, 0, 40, 40), progress.format(4, 12, 1, 50, 25),
      "vanilla-h8: ~50 s by this run's estimate, 10 s left: not started",
      "deadline passed: skipped 1 stacks (2 groups): vanilla-h8 (2 groups)"]
  # Without an estimate, a stack starts; the deadline stops it between
  # groups (here after the first, at t = 65 > 60).
  clock[0], made[:] = 50.0, []
  with pytest.raises(protocol.DeadlineReached, match=re.escape(
      "the deadline came in vanilla-h8's tuning after 1 of its 3 groups")):
    run({b: [0, 1, 2]}, stop_at=60.0)
  assert made == [b]
  assert [(r.num_states, r.task) for r in schema.read_results(
      str(tmp_path))] == [(4, 0), (4, 1), (12, 0), (12, 1), (8, 0)]
  # Past the deadline nothing starts.
  assert run({c: [2]}, stop_at=60.0) == [c.tag] and made == [b]
  # Once stacks have finished, their seconds per weight replace the prior:
  # 15 here (a and c: prepare 5, one group 10) where the prior says 10. At
  # t = 30, b (weight 2) needs 30 s: with 25 s left it does not start (by
  # the prior it would), with 40 s it does. A stack with nothing left to
  # tune (d, first in order) is passed over, not the end of the run.
  d = protocol.vanilla(16)
  weights[d] = 0
  for stop_at, skipped in ((55.0, [b.tag]), (70.0, [])):
    clock[0], made[:] = 0.0, []
    assert run({d: [], a: [0], b: [0], c: [0]}, stop_at=stop_at,
               seconds_per_weight=10.0) == skipped
    assert made == [a, c] + ([] if skipped else [b])
  # A deadline reached exactly has passed, before a stack (deadline or
  # stop_at) and between groups; 1 s left with no estimate still starts.
  clock[0], made[:] = 100.0, []
  assert run({a: [0]}, deadline=100.0) == [a.tag]
  assert run({a: [0]}, stop_at=100.0) == [a.tag] and made == []
  assert run({a: [0]}, stop_at=101.0) == [] and made == [a]  # t = 115
  with pytest.raises(protocol.DeadlineReached, match="after 1 of its 2"):
    run({a: [0, 1]}, stop_at=130.0)  # prepared at 120, group 0 done at 130


@pytest.mark.slow
def test_a_stack_that_does_not_fit_runs_in_parts_drawn_as_the_whole(
    tmp_path, tuned, pretrained):
  """A deadline that the whole stack's estimate overruns: its first trials
  that fit (whole groups of ``trials_per_vmap``, one group's time kept for
  the part's own draws and compiles) are pretrained alone, in a directory
  of their own, seeded as in the whole stack; a later run pretrains the
  rest alone. Every line is the whole stack's draw and says its part."""
  setup = dataclasses.replace(
      SETUP, trials=8, left_sizes=(8,), memory_sizes=(),
      pretrain=SETUP.pretrain.with_overrides(trials_per_vmap=2))
  workdir = str(tmp_path)
  whole = protocol.draw_stack(setup, H8, 8, setup.tasks_per_hmm,
                              verdicts=True)
  # 100 s left at 100/7 s a trial: 6 trials fit, less a group of 2: 4.
  # In memory, checkpointed first if pretraining ends within the 4 trials'
  # tuning estimate (3 s each) of the deadline.
  stop_at = time.monotonic() + 100
  assert sweep.run_sweep(setup, workdir, "left", "transformer",
                         scheduling.Schedule(stop_at=stop_at,
                                             seconds_per_weight=100 / 7,
                                             tune_seconds_per_trial=3.0),
                         checkpoints="deadline") == ["vanilla-h8 (in part)"]
  sweep.run_sweep(setup, workdir, "left", "transformer",  # the rest
                  scheduling.Schedule(tune_seconds_per_trial=3.0))
  assert pretrained.stop_ats == [stop_at, None]
  assert pretrained.keep_bys == [stop_at - 3.0 * 4, None]  # no deadline
  parts = [range(0, 4), range(4, 8)]
  assert [(pdir, cfg) for pdir, cfg, _ in pretrained] == [
      (protocol.pretrain_dir(workdir, setup, H8, part),
       setup.pretrain.with_overrides(seed=setup.pretrain.seed + part.start))
      for part in parts]
  assert [os.path.basename(pdir).split("-")[:4] for pdir, _, _ in pretrained
          ] == [["vanilla", "h8", "trials0", "3"], ["vanilla", "h8",
                                                    "trials4", "7"]]
  for (_, _, models), part in zip(pretrained, parts):
    assert generative.same(models, jax.tree.map(
        lambda x, p=part: x[p.start:p.stop], whole.models_K))
  assert [c[3] for c in tuned] == [
      [(k, [0, 1]) for k in part] for part in parts for _ in range(2)]
  lines = schema.read_results(workdir)
  assert sorted((r.method, r.trial, r.task) for r in lines) == sorted(
      (m, k, s) for m in ("head_linear", "prompt_linear") for k in range(8)
      for s in range(2))
  for r in lines:
    part = parts[r.trial // 4]
    assert r.pretrain_part == [part.start, part.stop]
    assert r.hmm_fingerprint == whole.fingerprints[r.trial]
    assert r.assumptions == whole.verdicts[r.trial][r.task]
    assert r.task_redraws == whole.tasks[r.trial][r.task].redraws
    assert r.pretrain_steps == 30 + r.trial - part.start  # its row's info
  with open(schema.results_path(workdir)) as f:
    assert all('"pretrain_part": [' in line for line in f)
  tuned.clear()
  assert sweep.run_sweep(setup, workdir, "left", "transformer") == []
  assert tuned == []


def test_parts_of_a_stack(tmp_path, monkeypatch):
  """:class:`sweep.Parts`: which trials a run pretrains and which part of
  them fits a deadline, in whole groups of ``trials_per_vmap``; a run a
  deadline cut in the workdir weighs the trials it still trains."""
  # The pretraining dirs of these tests hold no run; the ones named here
  # hold one checkpointed with these trials still training.
  checkpointed: dict = {}
  monkeypatch.setattr(pretrain, "running_at_checkpoint",
                      lambda pdir: checkpointed.get(pdir))
  setup = dataclasses.replace(
      SETUP, trials=20, right_trials=5, left_sizes=(8,), memory_sizes=(2,),
      pretrain=SETUP.pretrain.with_overrides(trials_per_vmap=4))
  workdir = str(tmp_path)
  sizes = configs.stack_sizes(setup)
  *left, right = configs.plan(setup, "both", "transformer")[H8]
  assert (left[0].panel, right.panel, sizes[H8]) == ("left", "right", 20)
  cells = lambda trials: {(k, s) for k in trials for s in range(2)}
  todo = {H8: {left[0]: cells(range(20)), left[1]: cells(range(20)),
               right: cells(range(5))}}
  parts = sweep.Parts(setup, workdir, sizes, todo, "transformer")
  assert parts.of(H8, todo[H8]) is None and parts.weight(H8) == 20
  # 12 trials' time: 2 groups of 4, a group's time kept back.
  groups, n = parts.split(H8, 12.9)
  assert n == 8 and groups == {left[0]: cells(range(8)),
                               left[1]: cells(range(8)), right: cells(range(5))}
  assert parts.of(H8, groups) == range(0, 8)
  assert parts.split(H8, 7.9) is None  # not one group besides
  assert parts.split(H8, 8.0)[1] == 4
  # Time for every trial: no part (run_stacks asks only when it is not).
  assert parts.split(H8, 23.9)[1] == 16 and parts.split(H8, 24) is None
  # A kept workdir's part cut short, from the same first trial, is resumed
  # where it fits (not where it does not).
  held = protocol.pretrain_dir(workdir, setup, H8, range(0, 7))
  os.makedirs(held)
  assert parts.split(H8, 12.9)[1] == 7 and parts.split(H8, 9)[1] == 4
  # Checkpointed by a deadline with 2 of its 7 trials still training: it
  # weighs 2 and fits where 4 fresh trials do (not where no group does).
  checkpointed[held] = [3, 5]
  groups, n = parts.split(H8, 9)
  assert n == 2 and groups == {left[0]: cells(range(7)),
                               left[1]: cells(range(7)),
                               right: cells(range(5))}
  assert parts.split(H8, 7.9) is None and parts.weight(H8) == 20
  checkpointed[held] = []  # every trial stopped: its tuning still costs
  assert parts.split(H8, 8.0)[1] == 1
  del checkpointed[held]
  # Trials 0-7 done: the rest, 8-19, is the run's part and weight.
  todo[H8] = {left[0]: cells(range(8, 20)), left[1]: cells(range(8, 20))}
  assert parts.of(H8, todo[H8]) == range(8, 20) and parts.weight(H8) == 12
  rest = protocol.pretrain_dir(workdir, setup, H8, range(8, 20))
  checkpointed[rest] = [9, 10]  # that run, cut by a deadline
  assert parts.weight(H8) == 2
  del checkpointed[rest]
  groups, n = parts.split(H8, 9)
  assert n == 4 and groups == {left[0]: cells(range(8, 12)),
                               left[1]: cells(range(8, 12))}
  os.makedirs(protocol.pretrain_dir(workdir, setup, H8, range(8, 11)))
  assert parts.split(H8, 12.9)[1] == 3
  # Held parts checkpointed by a deadline, the longest that fits first:
  # 8-17 with 4 still training fits 9 trials' time (4 less a group);
  # 8-18 with 5 does not, with 1 it does.
  held = {stop: protocol.pretrain_dir(workdir, setup, H8, range(8, stop))
          for stop in (18, 19)}
  for stop, running in ((18, [9, 10, 11, 12]), (19, [9, 10, 11, 12, 13])):
    os.makedirs(held[stop])
    checkpointed[held[stop]] = running
  rest_of = lambda stop: {left[0]: cells(range(8, stop)),
                          left[1]: cells(range(8, stop))}
  assert parts.split(H8, 9) == (rest_of(18), 4)
  checkpointed[held[19]] = [9]
  assert parts.split(H8, 9) == (rest_of(19), 1)
  for path in held.values():
    del checkpointed[path]
  # One trial at a time (trials_per_vmap 0 or 1): parts of any size.
  ones = parts._replace(setup=dataclasses.replace(
      setup, pretrain=setup.pretrain.with_overrides(trials_per_vmap=0)))
  assert ones.split(H8, 2.5)[1] == 1 and ones.split(H8, 1.9) is None
  # The whole stack's run in the workdir: it is the one resumed, never cut.
  whole = protocol.pretrain_dir(workdir, setup, H8)
  os.makedirs(whole)
  assert parts.of(H8, todo[H8]) is None and parts.weight(H8) == 20
  assert parts.split(H8, 12.9) is None
  # Cut by a deadline with 3 trials still training: it weighs 3.
  checkpointed[whole] = [0, 9, 17]
  assert parts.weight(H8) == 3 and parts.split(H8, 12.9) is None
  # The exact backbone draws whole stacks and pretrains nothing.
  exact = sweep.Parts(setup, str(tmp_path / "e"), sizes, todo, "exact")
  assert exact.of(H8, todo[H8]) is None and exact.split(H8, 12.9) is None
  checkpointed[protocol.pretrain_dir(str(tmp_path / "e"), setup, H8)] = [1]
  assert exact.weight(H8) == 20


def test_a_deadline_runs_the_part_of_a_stack_that_fits(tmp_path, fake_clock):
  """``run_stacks``' ``split``: asked, only where a stack's estimate overruns
  the time left, for the weight that fits; its groups are prepared and
  tuned, its weight is what the measured rate divides by, and the stack is
  named as run in part. A fake clock: prepare 5 s, each group 10 s."""
  clock, logged = fake_clock
  # Its lines but the progress lines (the deadline test's).
  said = lambda: [line for line in logged if not line.startswith("[")]
  a, b, c = (protocol.vanilla(h) for h in (4, 8, 12))
  made, tuned, asked = [], [], []

  def prepare(mid, groups):
    made.append((mid, list(groups)))
    clock[0] += 5
    return mid

  def tune(g, mid):
    tuned.append((mid, g))
    clock[0] += 10
    return [_stub_line(mid, g)]

  def split(mid, fits):
    asked.append((mid, fits))
    return ({0: None}, 2) if mid == b else None

  weights = {a: 1, b: 4, c: 4}
  run = lambda todo, **kw: protocol.run_stacks(
      todo, prepare, tune, str(tmp_path / "r.jsonl"),
      scheduling.Schedule(**kw), weight=weights.get, split=split)
  # a (10 s by the prior) fits and is not split. b (60 s at a's measured
  # 15 s a weight) does not fit the 25 s left: split gets the 25 / 15
  # weights that fit, and b's part (group 0) runs. c then needs 40 s at 10
  # s a weight (a's 15 s and the part's 15 s over weights 1 + 2), 10 s
  # left: split asks for 1 weight (1.67 had the part counted b's whole
  # weight), gets nothing, and c is skipped.
  assert run({a: [0], b: [0, 1], c: [0]}, stop_at=40.0,
             seconds_per_weight=10.0) == [c.tag, f"{b.tag} (in part)"]
  assert asked == [(b, 25 / 15), (c, 1.0)]
  assert made == [(a, [0]), (b, [0])] and tuned == [(a, 0), (b, 0)]
  assert said() == [
      "vanilla-h8: ~60 s by this run's estimate, 25 s left: a part of it "
      "(~30 s) runs",
      "vanilla-h12: ~40 s by this run's estimate, 10 s left: not started",
      "deadline passed: skipped 1 stacks (1 groups): vanilla-h12 (1 groups)",
      "run in part for the deadline: vanilla-h8 (in part)"]
  # No split without an estimate, at or past stop_at or the deadline;
  # asked with half a second left; two parts listed.
  asked.clear()
  logged.clear()
  clock[0] = 0.0
  assert run({b: [0, 1]}, stop_at=100.0) == [] and asked == []
  for kw in ({"stop_at": clock[0]}, {"stop_at": clock[0] - 1},
             {"stop_at": clock[0] + 20, "deadline": clock[0]}):
    assert run({c: [0]}, seconds_per_weight=10.0, **kw) == [c.tag]
  assert asked == [] and said()[-1].startswith("deadline passed")
  logged.clear()
  always = lambda mid, fits: asked.append((mid, fits)) or ({0: None}, 1)
  run2 = lambda todo, **kw: protocol.run_stacks(
      todo, prepare, tune, str(tmp_path / "r.jsonl"),
      scheduling.Schedule(**kw), weight={b: 10, c: 10}.get, split=always)
  # b: 100 s by the prior, 50 left: a part (15 s); c: 150 s at the 15 s a
  # weight it measured, 35 left: a part.
  assert run2({b: [0, 1], c: [0, 1]}, stop_at=clock[0] + 50,
              seconds_per_weight=10.0) == [f"{b.tag} (in part)",
                                           f"{c.tag} (in part)"]
  assert asked == [(b, 5.0), (c, 35 / 15)]
  assert said()[-1] == ("run in part for the deadline: vanilla-h8 (in part), "
                        "vanilla-h12 (in part)")
  asked.clear()
  run2({b: [0]}, stop_at=clock[0] + 0.5, seconds_per_weight=1.0)
  assert asked == [(b, 0.5)]


@pytest.mark.slow
def test_a_part_of_a_stack_is_the_whole_stack_cut(tmp_path, monkeypatch):
  """``draw_stack(part=range(a, b))``: rows ``a..b-1`` of the whole stack,
  bit for bit, row 0 being trial ``a``; its pretraining seeded and filed
  as those trials'; a bad part refused by name."""
  setup = dataclasses.replace(SETUP, trials=5)
  whole = protocol.draw_stack(setup, H8, 5, 2, verdicts=True)
  part = protocol.draw_stack(setup, H8, 5, 2, verdicts=True,
                             part=range(2, 4))
  assert (whole.first, part.first) == (0, 2)
  assert generative.same(part.models_K, jax.tree.map(lambda x: x[2:4],
                                                     whole.models_K))
  assert part.fingerprints == whole.fingerprints[2:4]
  assert part.verdicts == whole.verdicts[2:4]
  assert [[t.redraws for t in row] for row in part.tasks] == [
      [t.redraws for t in row] for row in whole.tasks[2:4]]
  for got, want in zip(part.tasks, whole.tasks[2:4]):
    for g, w in zip(got, want):
      assert all(np.array_equal(a, b) for a, b in zip(
          jax.tree.leaves(g), jax.tree.leaves(w)))
  plain = protocol.draw_stack(setup, H8, 5, part=range(0, 5))
  assert plain.first == 0 and plain.fingerprints == whole.fingerprints
  # By default one task a trial and no verdicts (they cost a theory check).
  assert plain.verdicts is None and {len(row) for row in plain.tasks} == {1}
  for bad in (range(0), range(3, 3), range(-1, 2), range(4, 6),
              range(0, 4, 2), [1, 2]):
    with pytest.raises(ValueError, match=re.escape(
        f"a part of a stack of 5 trials must be a non-empty range(a, b) "
        f"with 0 <= a < b <= 5, got {bad!r}")):
      protocol.check_part(bad, 5)
  assert protocol.check_part(None, 5) is None
  assert protocol.check_part(range(4, 5), 5) == range(4, 5)
  # Seeded and filed as its trials: the whole stack's seed plus a; the
  # directory names them (the whole stack's has no span).
  assert protocol.part_config(setup, None) is setup.pretrain
  assert protocol.part_config(setup, range(3, 5)).seed == (
      setup.pretrain.seed + 3)
  assert protocol.part_config(setup, range(3, 5)).identity() == dict(
      setup.pretrain.identity(), seed=setup.pretrain.seed + 3)
  whole_dir = protocol.pretrain_dir("w", setup, H8)
  assert re.fullmatch(r"w/pretrain/vanilla-h8-[0-9a-f]{8}", whole_dir)
  assert protocol.pretrain_dir("w", setup, H8, range(3, 5)) == (
      whole_dir.replace("vanilla-h8-", "vanilla-h8-trials3-4-"))
  # The digits key the recipe, the seed and the layout, not runtime fields.
  for other in (dataclasses.replace(setup, seed=1),
                dataclasses.replace(setup, pretrain=setup.pretrain.with_overrides(
                    lr=setup.pretrain.lr * 2))):
    assert protocol.pretrain_dir("w", other, H8) != whole_dir
  assert protocol.pretrain_dir("w", dataclasses.replace(
      setup, pretrain=setup.pretrain.with_overrides(trials_per_vmap=7)),
                               H8) == whole_dir
  for name in ("MODEL_KEYS_VERSION", "PRETRAIN_DIR_VERSION"):
    with monkeypatch.context() as m:
      m.setattr(protocol, name, getattr(protocol, name) + 1)
      assert protocol.pretrain_dir("w", setup, H8) != whole_dir
  with pytest.raises(ValueError, match=re.escape(
      "vanilla-h8: part range(3, 5) of 2 trials, 3 models given")):
    protocol.pretrained(str(tmp_path), setup, H8, jax.tree.map(
        lambda x: x[:3], whole.models_K), part=range(3, 5))


def test_a_workers_progress_lines_keep_the_whole_runs_total(tmp_path,
                                                           fake_clock):
  """Under claims with ``progress`` (the binaries' ``--workers``), every
  line counts the groups all workers finished against the run's total, one
  number on every line: a stack another worker claims stays in it (before,
  a worker printed ``[1/6 groups]`` and then ``[2/3 groups]``). The ETA is
  this worker's seconds per group times the groups left, shared between
  the 2 workers (before: 50 s on the first line, all 5 groups left at this
  worker's pace)."""
  clock, logged = fake_clock
  a, b, c = (protocol.vanilla(h) for h in (4, 8, 12))
  finished = []  # the keys every worker marked, in order

  def claim(mid):
    if mid == b:  # the other worker's: it finishes b's 3 groups meanwhile
      finished.extend(f"{b.tag}-{i}" for i in range(3))
    return mid != b

  def progress(key):
    if key is not None:
      finished.append(key)
    return len(finished), 2

  def tune(g, mid):
    clock[0] += 10
    return [_stub_line(mid, g)]

  protocol.run_stacks({a: [0, 1], b: [0, 1, 2], c: [0]},
                      lambda mid, groups: mid, tune,
                      str(tmp_path / "r.jsonl"),
                      scheduling.Schedule(claim=claim, progress=progress))
  line = ("[{}/6 groups, all workers] vanilla-h{} {}: test acc 1.000 +- "
          "0.000 over 1 lines (10.0s); elapsed {}s, ETA {}s")
  # The costliest first: c (this worker's), b (the other's), a (this one's).
  assert logged == [line.format(1, 12, 0, 10, 25), line.format(5, 4, 0, 20, 5),
                    line.format(6, 4, 1, 30, 0)]
  assert finished == [f"{c.tag}-0", *(f"{b.tag}-{i}" for i in range(3)),
                      f"{a.tag}-0", f"{a.tag}-1"]


def test_a_worker_starting_late_counts_what_others_finished_before(
    tmp_path, fake_clock):
  """A worker that plans after another finished 2 groups (their lines on
  disk, so not in its todo) still counts against the run's total: before,
  it printed ``[3/1 groups]``."""
  _, logged = fake_clock
  finished = ["vanilla-h8-0", "vanilla-h8-1"]

  def progress(key):
    if key is not None:
      finished.append(key)
    return len(finished), 2

  protocol.run_stacks({protocol.vanilla(4): [0]}, lambda mid, groups: mid,
                      lambda g, mid: [_stub_line(mid, g)],
                      str(tmp_path / "r.jsonl"),
                      scheduling.Schedule(claim=lambda mid: True,
                                          progress=progress))
  assert logged[0].startswith("[3/3 groups, all workers] vanilla-h4 0")


def test_run_stacks_counts_claimed_groups_and_names_what_it_skips(
    tmp_path, fake_clock):
  """What ``run_stacks`` logs beyond its deadline test: a claiming process
  without ``progress`` counts its groups against the run's (no ETA: it
  cannot know its share), a tuning loss that is not finite, an estimate
  that ends exactly at ``stop_at`` (it starts), the skipped stacks listed,
  and no estimate line where there is no estimate."""
  clock, logged = fake_clock
  clock[0] = 100.0  # elapsed times are differences
  a, b, c = (protocol.vanilla(h) for h in (4, 8, 12))
  asked = []

  def tune(g, mid):
    clock[0] += 10
    return [_stub_line(mid, g, final_loss=float("nan") if g else 0.0)]

  run = lambda todo, weight=None, **kw: protocol.run_stacks(
      todo, lambda mid, groups: mid, tune, str(tmp_path / "r.jsonl"),
      scheduling.Schedule(**kw), weight=weight,
      split=lambda mid, fits: asked.append(mid))
  # Another process claims b: this one's 2 groups of the run's 5.
  run({a: [0, 1], b: [0, 1, 2]}, claim=lambda mid: mid != b)
  assert logged == [
      "[1 done here, of the run's 5 groups] vanilla-h4 0: test acc 1.000 "
      "+- 0.000 over 1 lines (10.0s); elapsed 10s",
      "[2 done here, of the run's 5 groups] vanilla-h4 1: test acc 1.000 "
      "+- 0.000 over 1 lines (10.0s); 1 with a non-finite tuning loss; "
      "elapsed 20s"]
  # 10 s by the prior, 10 s left: it starts whole (and ends at stop_at).
  logged.clear()
  clock[0] = 0.0
  assert run({a: [0]}, weight={a: 1}.get, stop_at=10.0,
             seconds_per_weight=10.0) == []
  assert clock[0] == 10.0 and asked == []
  # Past the deadline with no estimate: skipped and listed, no estimate.
  logged.clear()
  assert run({b: [0, 1], c: [0]}, stop_at=5.0) == [b.tag, c.tag]
  assert logged == ["deadline passed: skipped 2 stacks (3 groups): "
                    "vanilla-h8 (2 groups), vanilla-h12 (1 groups)"]
  # An estimate is named only with time left: past the (soft) deadline
  # without stop_at, at stop_at or past it, none; half a second before it,
  # the stack's.
  est = dict(weight={b: 1}.get, seconds_per_weight=10.0)
  for kw in ({"deadline": 5.0}, {"stop_at": 10.0}, {"stop_at": 9.0},
             {"stop_at": 10.5}):
    logged.clear()
    assert run({b: [0]}, **est, **kw) == [b.tag]
    assert logged[:-1] == ([] if kw != {"stop_at": 10.5} else [
        "vanilla-h8: ~10 s by this run's estimate, 0 s left: not started"])
