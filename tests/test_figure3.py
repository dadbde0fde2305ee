"""hmmprompt.figure3: configs (get_setup), the result-line schema, the
report's statistics, a stack run in parts and merged. The sweeps
themselves: tests/integration/."""

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import types
import time

import numpy as np
import pytest

from conftest import CPU_PAPER, without_fma
from hmmprompt import figure3
from hmmprompt import pretraining_curve
from hmmprompt.figure3 import chunks
from hmmprompt.figure3 import configs
from hmmprompt import scheduling
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import sweep
from hmmprompt.figure3 import workers
from hmmprompt import generative
from hmmprompt import protocol
from hmmprompt import files as files_lib
from hmmprompt.pretrain import loop as pretrain_loop
from hmmprompt.pretrain import report as pretrain_report


def test_mean_ci():
  m, ci = figure3.mean_ci([1.0, 2.0, 3.0])
  assert m == 2.0
  assert ci == pytest.approx(4.303 * 1.0 / np.sqrt(3), rel=1e-4)
  # Past the old hand-typed table (df 1-30, then 1.96): t(0.975, 40).
  v = np.arange(41.0)
  assert figure3.mean_ci(v)[1] == pytest.approx(
      2.0211 * v.std(ddof=1) / np.sqrt(41), rel=1e-4)
  # One value: no interval, and the table says so rather than "± nan".
  m, ci = figure3.mean_ci([5.0])
  assert m == 5.0 and np.isnan(ci)
  # In float64 whatever the input (float32 accuracies sum to other bits).
  v32 = np.array([0.1, 0.1, 0.1, 0.7], np.float32)
  v64 = v32.astype(np.float64)
  assert figure3.mean_ci(v32) == (v64.mean(), figure3.mean_ci(v64)[1])
  assert v32.mean() != v64.mean()


def test_a_one_trial_cell_has_no_interval(tmp_path):
  key = ("exact", "left", "vanilla", "head_linear", "raw")
  path = str(tmp_path / "figure3.md")
  reporting.write_table({key: {4: (62.5, float("nan"), 1),
                               8: (50.0, 2.25, 3)}}, path)
  text = open(path).read()
  rows = [l for l in text.splitlines() if l.startswith("| 4 ")
          or l.startswith("| 8 ")]
  assert rows == ["| 4 | ~100 | ~94 | 62.5 (1) |",
                  "| 8 | ~97 | ~84 | 50.0 ± 2.2 (3) |"]
  assert text.endswith(rows[-1] + "\n")  # no extra, nothing after
  # A size one curve lacks is an empty cell; a right panel alone is shown.
  right = ("exact", "right", "memory", "head_attention", "raw")
  reporting.write_table({key: {4: (62.5, float("nan"), 1)},
                         ("exact", "left", "vanilla", "prompt_linear",
                          "raw"): {8: (70.0, float("nan"), 1)}}, path)
  assert "| 4 | ~100 | ~94 | 62.5 (1) |  |" in open(path).read()
  reporting.write_table({right: {8: (99.0, 1.0, 5)}}, path, extra="X")
  text = open(path).read()
  assert "## Left" not in text
  assert text.endswith("| 8 | ~100 | ~83 | 99.0 ± 1.0 (5) |\n\nX")


def test_the_tuning_dtype_keys_the_transformers_lines_only():
  """``tune.backbone_dtype`` (the gpu preset's bf16 on an accelerator)
  moves the transformer's fingerprint, not the exact backbone's: its lines
  computed on a CPU are the accelerator's setup's too."""
  cpu = figure3.get_setup("gpu")
  bf16 = figure3.get_setup("gpu", overrides={"tune.backbone_dtype":
                                             "bfloat16"})
  assert cpu.tune.backbone_dtype == "float32"  # this CPU's "auto"
  assert bf16.fingerprint("exact") == cpu.fingerprint("exact")
  assert bf16.fingerprint("transformer") != cpu.fingerprint("transformer")
  with pytest.raises(ValueError, match="backbone_dtype must be one of "
                     r"\('float32', 'bfloat16'\), got 'fp16'"):
    figure3.get_setup("gpu", overrides={"tune.backbone_dtype": "fp16"})


def test_the_report_states_the_tuning_inputs_beside_the_papers():
  line = lambda seq_len, max_len, method="prompt_linear": types.SimpleNamespace(
      method=method, task_config={"seq_len": seq_len},
      tune_config={"prompt_len": 20, "max_len": max_len})
  paper = (" The paper's: 128 tokens (Appendix D; the authors' scripts "
           "truncated every input to 80 positions, prompt included).")
  assert reporting.inputs_note([line(59, None), line(59, None)]) == (
      "Tuning inputs here: 59 tokens after the MASK, 80 positions with 20 "
      "prompt vectors." + paper)
  # Truncated to 80 positions, prompt included: 59 of the 128 tokens.
  assert reporting.inputs_note([line(128, 80), line(128, None)]) == (
      "Tuning inputs here: 59 tokens after the MASK, 80 positions with 20 "
      "prompt vectors; 128 tokens after the MASK, 149 positions with 20 "
      "prompt vectors." + paper)
  assert reporting.inputs_note([line(59, None, "head_linear")]) == ""


def test_identities_are_the_committed_ones():
  """Result lines and pretraining directories are found again by these
  digits: the refactors of issue 29 keep them byte for byte (values from
  before it)."""
  got = {p: (s.fingerprint("exact"), s.fingerprint("transformer"),
             protocol.pretrain_dir("W", s, protocol.vanilla(4)),
             protocol.pretrain_dir("W", s, protocol.memory(7)))
         for p in ("tiny", "cpu", "cpu_paper", "paper", "gpu")
         for s in [figure3.get_setup(p)]}
  assert got == {
      "tiny": ("19d48286c874", "fdca962b830c", "W/pretrain/vanilla-h4-b29a8b2f",
               "W/pretrain/memory-h4-m7-b29a8b2f"),
      # The transformer's re-keyed by issue 30's cpu_capped recipe (was
      # 99eebf1f47d2, vanilla-h4-4ff1a5bc), then by its 4-layer fallback
      # (was 5ab58c6d5ab7, vanilla-h4-539e5958; cpu_paper kept that until
      # its protocol was rerun with the fallback). cpu_paper's then by its
      # earlier fallback checks (fallback_gaps; was cpu's, df9d417fe40c,
      # vanilla-h4-2ef05c55).
      "cpu": ("a6f38f8be942", "df9d417fe40c", "W/pretrain/vanilla-h4-2ef05c55",
              "W/pretrain/memory-h4-m7-2ef05c55"),
      "cpu_paper": ("a6f38f8be942", "46e34602bece",
                    "W/pretrain/vanilla-h4-783042a5",
                    "W/pretrain/memory-h4-m7-783042a5"),
      "paper": ("80bfbca971f2", "2a26c840f84c",
                "W/pretrain/vanilla-h4-bb7e9b01",
                "W/pretrain/memory-h4-m7-bb7e9b01"),
      # gpu re-keyed by issue 49 (recipe A, cpu_paper's 59-token tasks;
      # was 80bfbca971f2, 735153be1f8a, vanilla-h4-91433979): no line had
      # been committed. Its tasks are cpu_paper's, so its exact lines are.
      "gpu": ("a6f38f8be942", "b3af386250ad", "W/pretrain/vanilla-h4-3a8d53d1",
              "W/pretrain/memory-h4-m7-3a8d53d1")}
  assert [pretraining_curve.get_setup(p).fingerprint()
          for p in ("tiny", "cpu")] == ["4f5ebe9484e0", "af5034630d2c"]
  # The committed curve: its stamp is the cpu preset's identity.
  root = __file__.rsplit("/tests/", 1)[0]
  with open(f"{root}/docs/results/pretraining-curve/curve.json") as f:
    assert json.load(f) == pretraining_curve.get_setup("cpu").identity()


def test_the_curves_tiny_report_says_it_is_a_smoke_test(tmp_path,
                                                        monkeypatch):
  """The pretraining curve's report of the tiny preset's lines says first
  that its numbers are a smoke test's, and its plot says it over the
  panels; the committed curve's (the cpu preset's) says nothing of it."""
  from hmmprompt.pretraining_curve import report as curve_report
  fp = pretraining_curve.get_setup("tiny").fingerprint()
  pretraining_curve.check_workdir(str(tmp_path), pretraining_curve.get_setup(
      "tiny"))
  files_lib.append_lines(pretraining_curve.lines_path(str(tmp_path)), [
      pretraining_curve.CurveLine(
          model="vanilla-h4", trial=k, backbone=b, step=step,
          method="head_linear", setup=fp, hmm="vanilla", num_states=4,
          memory_size=0, hmm_fingerprint="h", ce_gap=gap, tv=gap / 2,
          mlm_ce=None, bayes_ce=None, test_accuracy=0.5 + k / 10,
          val_accuracy=0.5, train_accuracy=0.5, final_loss=0.1, seconds=1.0)
      for k in range(2) for b, step, gap in (("transformer", 0, 2.0),
                                             ("transformer", 40, 0.3),
                                             ("exact", None, 0.0))])
  figs = {}
  monkeypatch.setattr(files_lib, "atomic_write_png",
                      lambda path, fig, dpi: figs.setdefault(path, fig))
  text = curve_report.write_curve_report(str(tmp_path))
  assert text.split("\n\n")[1].startswith(
      "**A smoke test, not a result.** These lines are the `tiny` preset's")
  (fig,) = figs.values()
  assert fig._suptitle.get_text() == reporting.SMOKE_TITLE
  committed = f"{__file__.rsplit('/tests/', 1)[0]}/docs/results/pretraining-curve"
  assert fp not in {r.setup for r in pretraining_curve.read_curve_lines(
      committed)}
  with open(f"{committed}/curve.md") as f:
    assert "smoke" not in f.read().lower()


def test_get_setup_presets_overrides_and_errors():
  cpu = figure3.get_setup("cpu")
  assert cpu.left_sizes == (4, 8, 12, 28) and cpu.trials == 3
  # The main job's pretraining is the named cpu_capped recipe.
  assert (cpu.pretrain.batch_size, cpu.pretrain.lr, cpu.pretrain.steps,
          cpu.pretrain.cycles, cpu.pretrain.targets,
          cpu.pretrain.corpus.corruption, cpu.pretrain.optimizer,
          cpu.pretrain.model.rel_pos,
          cpu.pretrain.corpus.train_mask_rate) == (
              32, 1e-2, 2000, (250, 250, 500, 1000), "exact", "mask", "muon",
              "bias", 0.4)
  assert (cpu.trials, cpu.tasks_per_hmm, cpu.features) == (3, 1, ("raw",))
  s = figure3.get_setup("cpu", trials=2, overrides={
      "pretrain.lr": "3e-3", "left_sizes": "4:8", "tune.epochs": 2})
  assert (s.trials, s.pretrain.lr, s.left_sizes, s.tune.epochs) == (
      2, 3e-3, (4, 8), 2)
  assert s.input_len == 20 + 1 + 59
  with pytest.raises(ValueError, match="unknown preset 'huge'"):
    figure3.get_setup("huge")
  with pytest.raises(ValueError, match="unknown config key 'pretrain.lrr'"):
    figure3.get_setup("tiny", overrides={"pretrain.lrr": 1.0})
  with pytest.raises(ValueError, match="features must be from"):
    figure3.get_setup("tiny", features=("cubic",))


def test_result_line_schema_round_trips_and_refuses_bad_lines(tmp_path):
  fields = dict(backbone="exact", panel="left", hmm="vanilla", num_states=4,
                memory_size=0, trial=0, task=0, method="head_linear",
                features="raw", setup="abc", hmm_fingerprint="0123abcd4567", size=4, test_accuracy=0.5, val_accuracy=0.5,
                train_accuracy=0.5, final_loss=0.1, steps=3, seconds=1.0,
                task_redraws=0, assumptions={}, tune_config={},
                task_config={})
  line = schema.ResultLine(**fields)
  files_lib.append_lines(str(tmp_path / "results.jsonl"), [line])
  assert schema.read_results(str(tmp_path)) == [line]
  assert line.key() == tuple(fields[f] for f in schema.ResultLine.KEY_FIELDS)
  with pytest.raises(ValueError, match="unknown fields"):
    schema.ResultLine.from_json({**fields, "bogus": 1})
  # The report names a cell whose tuning diverged, and only that one.
  nan = schema.ResultLine(**{**fields, "trial": 1, "final_loss": np.nan})
  table = reporting.diverged_table([line, nan])
  assert "1 cell(s)" in table and "| exact | left | 4 | 1 | 0 |" in table
  assert reporting.diverged_table([line]) == ""
  with pytest.raises(ValueError, match="incomplete"):
    schema.ResultLine.from_json({"backbone": "exact"})


def test_a_workdir_holds_one_setup(tmp_path):
  paper = figure3.get_setup("paper")
  assert (paper.trials, paper.right_trials, paper.tasks_per_hmm) == (20, 5, 1)
  # A vanilla HMM both panels use is one stack of the larger count.
  assert configs.stack_sizes(paper)[protocol.vanilla(8)] == 20
  assert configs.stack_sizes(paper)[protocol.vanilla(20)] == 5
  assert configs.stack_sizes(paper)[protocol.memory(7)] == 5
  assert configs.stack_sizes(paper)[protocol.vanilla(30)] == 20
  tiny = figure3.get_setup("tiny")
  # The plan: each model once, vanilla then memory by size, with its groups.
  by_model = configs.plan(tiny)
  assert [m.tag for m in by_model] == [
      "vanilla-h4", "vanilla-h8", "vanilla-h12", "memory-h4-m2"]
  assert [(g.panel, g.method_name) for g in by_model[
      protocol.vanilla(8)]] == [("right", "head_linear")] * 2
  assert all(g.model_id == m for m, gs in by_model.items() for g in gs)
  assert [m.tag for m in configs.plan(tiny, "left")] == [
      "vanilla-h4", "vanilla-h12"]
  sweep.check_workdir(str(tmp_path), tiny)
  sweep.check_workdir(str(tmp_path), tiny)  # the same setup: fine
  # Sizes, panels and arms add lines without changing any: fine too.
  sweep.check_workdir(str(tmp_path), figure3.get_setup(
      "tiny", left_sizes=(4,), head_optimum=True, features=("raw",)))
  # Another setup is refused, every field that differs named, whichever
  # backbone it would run (issue 29: a report averaged two setups).
  for overrides, named in [
      ({"trials": "3"}, "right_trials: 2 -> 3; trials: 2 -> 3"),
      ({"tune.epochs": "1", "tune.prompt_len": "1"},
       "tune.epochs: 2 -> 1; tune.prompt_len: 4 -> 1"),
      ({"pretrain.lr": "1e-3"}, "pretrain.lr: 0.003 -> 0.001"),
      # An identity.ADDED field at its default is left out of the stamp:
      # named by that default, as --print_config shows it, not None
      # (issue 66).
      ({"pretrain.corpus.train_mask_rate": "0.4"},
       "pretrain.corpus.train_mask_rate: 0.0 -> 0.4")]:
    with pytest.raises(ValueError, match=re.escape(
        f"holds results of another setup ({named})")):
      sweep.check_workdir(str(tmp_path),
                          figure3.get_setup("tiny", overrides))
  # A stamp of the earlier version (trial counts only) is upgraded when its
  # counts are this run's, refused otherwise.
  old = tmp_path / "old"
  old.mkdir()
  (old / "sweep.json").write_text('{"trials": 2, "right_trials": 2}')
  sweep.check_workdir(str(old), tiny)
  assert json.loads((old / "sweep.json").read_text()) == json.loads(
      json.dumps(tiny.identity()))
  (old / "sweep.json").write_text('{"trials": 3, "right_trials": 3}')
  with pytest.raises(ValueError, match="right_trials: 3 -> 2"):
    sweep.check_workdir(str(old), tiny)
  # Lines of another fingerprint (a workdir mixed before the stamp held the
  # setup) are refused by the check and by the report.
  mixed = tmp_path / "mixed"
  mixed.mkdir()
  line = schema.ResultLine(
      backbone="exact", panel="left", hmm="vanilla", num_states=4,
      memory_size=0, trial=0, task=0, method="head_linear", features="raw",
      setup=tiny.fingerprint(), hmm_fingerprint="", size=4,
      test_accuracy=0.5, val_accuracy=0.5, train_accuracy=0.5,
      final_loss=0.1, steps=3, seconds=1.0, task_redraws=0, assumptions={},
      tune_config={}, task_config={})
  files_lib.append_lines(str(mixed / "results.jsonl"), [
      line, dataclasses.replace(line, setup="0123456789ab")])
  with pytest.raises(ValueError, match=r"holds result lines of setup "
                     r"\['0123456789ab'\]"):
    sweep.check_workdir(str(mixed), tiny)
  with pytest.raises(ValueError, match="^" + re.escape(
      f"{mixed}: exact lines of setups ['0123456789ab', "
      f"'{tiny.fingerprint()}']; one results directory holds one setup per "
      f"backbone")):
    reporting.write_figure3_report(str(mixed))
  for bad in ({"trials": 0}, {"right_trials": 0}, {"tasks_per_hmm": 0},
              {"trials": 1.5}):
    with pytest.raises(ValueError, match="must be an int >= 1"):
      figure3.get_setup("tiny", **bad)
  # How the sweep runs (lane groups, the task memory budget) is no part of
  # what it computes: no fingerprint moves, so finished lines are kept.
  runtime = figure3.get_setup("tiny", overrides={
      "lanes_per_vmap": "3", "task_budget_mb": "0"})
  assert runtime.lane_group() == 3 and runtime.task_budget_bytes() is None
  assert runtime.fingerprint("transformer") == tiny.fingerprint("transformer")
  assert tiny.task_budget_bytes() == 512 << 20
  assert figure3.get_setup("tiny", lanes_per_vmap=0).lane_group() is None
  for bad in ({"lanes_per_vmap": -1}, {"task_budget_mb": None}):
    with pytest.raises(ValueError, match="must be an int >= 0"):
      figure3.get_setup("tiny", **bad)


def test_summary_is_over_trials_and_splits_the_variance():
  """Tasks are averaged within a trial first; the interval and n are over
  trials; the between / within SDs match a hand computation."""
  base = dict(backbone="exact", panel="left", hmm="vanilla", num_states=4,
              memory_size=0, method="head_linear", features="raw",
              setup="abc", hmm_fingerprint="f", size=4, val_accuracy=0.5,
              train_accuracy=0.5, final_loss=0.1, steps=3, seconds=1.0,
              task_redraws=0, assumptions={}, tune_config={},
              task_config={})
  accs = {(0, 0): 0.6, (0, 1): 0.8, (1, 0): 0.9, (1, 1): 0.9}
  lines = [schema.ResultLine(**base, trial=k, task=s, test_accuracy=a)
           for (k, s), a in accs.items()]
  (key, by_size), = reporting.summarize(lines).items()
  mean, ci, n = by_size[4]
  assert n == 2 and mean == pytest.approx(80.0)
  assert ci == pytest.approx(12.706 * np.std([70.0, 90.0], ddof=1)
                             / np.sqrt(2), rel=1e-4)
  between, within = reporting.variance_components(lines)[key][4]
  assert between == pytest.approx(np.std([70.0, 90.0], ddof=1))
  assert within == pytest.approx(np.sqrt((10.0**2 * 2) / 2))
  one = [r for r in lines if r.trial == 0]  # one trial: over its tasks
  assert reporting.summarize(one)[key][4][2] == 2
  assert reporting.variance_components(one) == {}
  assert reporting.components_table(lines) == (
      "## Variance components (points): SD between trials (HMM draws) / SD "
      "within a trial (task draws)\n\n| curve | size | between | within |\n"
      "|---|---|---|---|\n| exact: vanilla + head linear (raw) | 4 | 14.1 | "
      "10.0 |\n")
  assert reporting.components_table(one) == ""
  # A cell whose tuning loss ended non-finite is named, with its accuracy.
  assert reporting.diverged_table(lines) == ""
  assert reporting.diverged_table(
      [lines[0], dataclasses.replace(lines[1], final_loss=float("inf"))]) == (
          "## Diverged tuning: 1 cell(s) ended with a non-finite loss (their "
          "accuracies are in the tables)\n\n| backbone | panel | size | trial "
          "| task | arm | HMM | test acc |\n|---|---|---|---|---|---|---|---|"
          "\n| exact | left | 4 | 0 | 1 | vanilla head_linear (raw) | f | "
          "80.0 |\n")


def test_wins_count_each_draw_once_with_its_tasks_averaged():
  """Per size, a draw counts for prompt tuning when the mean over its tasks
  beats head tuning's; ties and the other panel apart."""
  base = dict(backbone="transformer", hmm="vanilla", num_states=4,
              memory_size=0, features="raw", setup="abc",
              hmm_fingerprint="f", size=4, val_accuracy=0.5,
              train_accuracy=0.5, final_loss=0.1, steps=3, seconds=1.0,
              task_redraws=0, assumptions={}, tune_config={}, task_config={})
  accs = {  # (trial, task): (head, prompt)
      (0, 0): (0.6, 0.9), (0, 1): (0.8, 0.6),  # prompt 0.75 > head 0.7
      (1, 0): (0.9, 0.8), (1, 1): (0.9, 0.9),  # head wins
      (2, 0): (0.7, 0.7), (2, 1): (0.5, 0.5)}  # a tie
  lines = [schema.ResultLine(**base, panel="left", trial=k, task=t,
                              method=m, test_accuracy=a[i])
           for (k, t), a in accs.items()
           for i, m in enumerate(("head_linear", "prompt_linear"))]
  right = [dataclasses.replace(r, panel="right") for r in lines]
  table = reporting.wins_table(lines + right)
  assert table.splitlines()[-1] == "| transformer | raw | 4 | 3 | 1 | 1 | 1 |"
  assert table.count("| transformer |") == 1
  assert reporting.wins_table(right) == ""


def test_the_trial_table_has_a_row_per_draw_and_empty_cells_where_none_ran():
  """A right-panel-only table (no left lines) still gets its panel; a draw
  with one HMM's lines and not the other's shows that HMM's fingerprint,
  gap and arm cells empty; a fallback's depth follows its gap."""
  base = dict(backbone="transformer", num_states=4, task=0, features="raw",
              setup="abc", val_accuracy=0.5, train_accuracy=0.5,
              final_loss=0.1, steps=3, seconds=1.0, task_redraws=0,
              assumptions={}, tune_config={}, task_config={},
              test_accuracy=0.75, panel="right", size=8)
  lines = [schema.ResultLine(
      **base, hmm="memory", memory_size=2, method="head_attention", trial=k,
      hmm_fingerprint=f"m{k}", pretrain_ce_gap=0.01 * (k + 1))
           for k in range(2)] + [schema.ResultLine(
               **base, hmm="vanilla", memory_size=0, method="head_linear",
               trial=0, hmm_fingerprint="v0", pretrain_ce_gap=0.05,
               pretrain_layers=4)]
  assert reporting.trial_table(lines).splitlines()[2:] == [
      "### transformer, right panel", "",
      "| size | trial | memory HMM | vanilla HMM | memory gap | vanilla gap | "
      "memory: head attention (raw) | vanilla: head linear (raw) |",
      "|---|---|---|---|---|---|---|---|",
      "| 8 | 0 | m0 | v0 | 0.0100 | 0.0500 (4 layers) | 75.0 | 75.0 |",
      "| 8 | 1 | m1 |  | 0.0200 |  | 75.0 |  |"]
  assert reporting.trial_table([]) == ""
  # A size with too few trials to split is skipped, not the sizes after it.
  two = [dataclasses.replace(r, trial=k, task=t, memory_size=0, size=s,
                             test_accuracy=a)
         for r in lines[2:] for s, k, t, a in (
             (4, 0, 0, 0.5), (4, 0, 1, 0.7), (8, 0, 0, 0.5), (8, 0, 1, 0.7),
             (8, 1, 0, 0.9), (8, 1, 1, 0.9))]
  (comps,) = reporting.variance_components(two).values()
  assert list(comps) == [8]


def test_pretraining_plot_has_a_panel_per_size_and_is_linked(tmp_path):
  """DIR/pretraining.png plots every trial's gap against tokens (from each
  run's config.json), linked under the pretraining table; no pretraining
  runs, no plot."""
  import json
  import os
  from hmmprompt import pretrain
  assert pretrain_report.section(str(tmp_path)) == ""
  assert not os.path.exists(tmp_path / pretrain_report.PLOT)
  cfg = pretrain.preset_config("tiny")
  for name, gaps in (("vanilla-h12-abc", [0.03, 0.02]),
                     ("vanilla-h4-abc", [0.03, 0.2])):  # trial 1 stalls
    run = tmp_path / "pretrain" / name
    os.makedirs(run)
    (run / "config.json").write_text(json.dumps(
        {"layout": 2, "pretrain": cfg.to_json()}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"trial": k, "step": step, "mlm_ce": 2.0 + g,
                    "bayes_ce": 2.0, "ce_gap": g, "tv": 0.1,
                    "wall_s": 1.0}) + "\n"
        for k in range(2) for step, g in zip((20, 40), (1.0, gaps[k]))))
  table = pretrain_report.write_report(str(tmp_path))
  assert (tmp_path / "pretraining.md").read_text() == table
  assert "vanilla-h4-abc | 1 | 40" in table
  assert f"]({pretrain_report.PLOT})" in table
  assert "Ended above the target gap: vanilla-h4-abc trial 1." in table
  with open(tmp_path / pretrain_report.PLOT, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_fallback_is_reported_in_place_of_the_trial_that_fell_back(
    tmp_path):
  """The table's row of a trial that fell back is its deeper run's, named
  ``<run>/fallback-<k>``; a trial that met its target keeps its own row
  even where a fallback directory exists beside it; lines written without
  a trial field (one-model runs) are trial 0."""
  import json
  from hmmprompt import pretrain
  cfg = pretrain.preset_config("tiny").with_overrides(
      target_gap=0.05, fallback_layers=2)

  def write(where, config, lines):
    os.makedirs(where)
    (where / "config.json").write_text(json.dumps(
        {"layout": 2, "pretrain": config.to_json()}))
    (where / "metrics.jsonl").write_text("".join(
        json.dumps({"step": 40, "mlm_ce": 2.0 + g, "bayes_ce": 2.0,
                    "ce_gap": g, "tv": 0.1, **extra}) + "\n"
        for g, extra in lines))
  run = tmp_path / "pretrain" / "vanilla-h4-abc"
  write(run, cfg, [(0.03, {"trial": 0, "wall_s": 1.0}),
                   (0.2, {"trial": 1, "wall_s": 3.0})])
  for k, gap in ((0, 0.01), (1, 0.02)):
    write(run / f"fallback-{k}", cfg.fallback(k),
          [(gap, {"trial": 0, "wall_s": 5.0})])
  # Written before lines had a trial or a wall time.
  write(tmp_path / "pretrain" / "memory-h4-m2-abc", cfg, [(0.04, {})])
  names = [(name, sorted(by_trial)) for name, _, by_trial
           in pretrain_report.runs(str(tmp_path))]
  assert names == [("vanilla-h4-abc", [0]),
                   ("vanilla-h4-abc/fallback-1", [1]), ("memory-h4-m2-abc", [0])]
  table = pretrain_report.table(pretrain_report.runs(str(tmp_path)))
  rows = [l.split(" | ") for l in table.splitlines() if "-abc" in l]
  assert [r[:4] + [r[6]] for r in rows] == [
      ["| vanilla-h4-abc", "0", "40", "1", "0.0300"],
      ["| vanilla-h4-abc/fallback-1", "1", "40", "5", "0.0200"],
      ["| memory-h4-m2-abc", "0", "40", "nan", "0.0400"]]
  # Each run's largest wall time, once (the trial that fell back is its
  # fallback's: 1 + 5, and 0 for lines without one).
  assert "total pretraining wall time 6 s." in table


def _captured_figures(monkeypatch) -> dict:
  """path -> the figure an atomic_write_png call saved there (written as
  well, then left open to be read)."""
  figs = {}

  def capture(path, fig, dpi=110):
    figs[os.path.basename(path)] = (fig, dpi)
    fig.savefig(path, format="png", dpi=dpi)  # the file, figure kept open

  monkeypatch.setattr(files_lib, "atomic_write_png", capture)
  return figs


@pytest.mark.slow
def test_the_pretraining_plot_draws_each_trials_gap_against_its_tokens(
    tmp_path, monkeypatch):
  """One panel per run in the table's order (vanilla before memory, sizes
  numerically), one line per trial: x = step x batch x chunk length, y =
  the gap floored at 1e-3 on a log axis, the run's own target dashed
  (0.04 where it sets none); a trial above its target is red, named and
  returned; the table sums each stack's wall time once."""
  from hmmprompt import pretrain
  figs = _captured_figures(monkeypatch)
  cfg = pretrain.preset_config("tiny")  # batch 8, chunk 32
  runs = {"vanilla-h12-abc": (None, {0: [0.5, 0.1, 0.04],
                                     1: [0.5, 0.1, 1e-5]}),
          "vanilla-h4-abc": (None, {0: [0.5, 0.1, 0.039],
                                    1: [0.5, 0.1, 0.2]}),
          "memory-h4-m2-abc": (0.1, {0: [0.5, 0.3, 0.11]})}
  for name, (target, gaps) in runs.items():
    run = tmp_path / "pretrain" / name
    os.makedirs(run)
    run_cfg = cfg.with_overrides(target_gap=target)
    (run / "config.json").write_text(json.dumps(
        {"layout": 2, "pretrain": run_cfg.to_json()}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"trial": k, "step": step, "mlm_ce": 2.0 + g,
                    "bayes_ce": 2.0, "ce_gap": g, "tv": 0.1,
                    "wall_s": step / 10 + k}) + "\n"
        for k, gs in gaps.items() for step, g in zip((20, 40, 60), gs)))
  text = pretrain_report.section(str(tmp_path))
  fig, _ = figs[pretrain_report.PLOT]
  axes = [ax for ax in fig.axes if ax.get_visible()]
  assert [ax.get_title() for ax in axes] == [
      "vanilla-h4-abc: 1/2 at target", "vanilla-h12-abc: 2/2 at target",
      "memory-h4-m2-abc: 0/1 at target"]
  assert len(fig.axes) == 3  # one row of three
  for ax, (target, gaps) in zip(axes, [runs["vanilla-h4-abc"],
                                       runs["vanilla-h12-abc"],
                                       runs["memory-h4-m2-abc"]]):
    *trials, line = ax.get_lines()
    assert ax.get_yscale() == "log"
    assert list(line.get_ydata()) == [target or 0.04] * 2
    assert line.get_linestyle() == "--"
    assert ax.get_legend().get_texts()[0].get_text() == (
        f"target {target or 0.04:g}")
    assert ax.get_xlabel() == "training tokens per trial"
    for trial, (k, gs) in zip(trials, sorted(gaps.items())):
      np.testing.assert_array_equal(trial.get_xdata(),
                                    [20 * 256, 40 * 256, 60 * 256])
      np.testing.assert_array_equal(trial.get_ydata(),
                                    np.maximum(gs, 1e-3))
      stalled = gs[-1] > (target or 0.04)  # at the target is reached
      assert (trial.get_color() == "red") == stalled, (ax.get_title(), k)
      # The last point marked: a cross where stalled, else a dot.
      assert (trial.get_marker(), trial.get_markevery()) == (
          "X" if stalled else "o", [2])
  assert axes[0].get_ylabel() == "held-out CE gap to Bayes (nats)"
  notes = [t for ax in axes for t in ax.texts]
  assert [(t.get_text(), t.xy, t.get_color()) for t in notes] == [
      ("trial 1", (60 * 256, 0.2), "red"), ("trial 0", (60 * 256, 0.11), "red")]
  # One gap scale across panels.
  assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes)
  assert text.endswith("Ended above the target gap: vanilla-h4-abc trial 1, "
                       "memory-h4-m2-abc trial 0.\n")
  # Each stack's wall time once (its largest), summed over the stacks.
  assert re.search(r"\d+ trials; .* s\.", text).group(0) == (
      "5 trials; gap median 0.0400, max 0.2000; total pretraining wall time "
      "20 s.")
  # Five runs: two rows of four, the last three panels hidden.
  for name in ("vanilla-h8-abc", "vanilla-h30-abc"):
    shutil.copytree(tmp_path / "pretrain" / "vanilla-h4-abc",
                    tmp_path / "pretrain" / name)
  pretrain_report.section(str(tmp_path))
  fig, _ = figs[pretrain_report.PLOT]
  assert len(fig.axes) == 8
  assert [ax.get_visible() for ax in fig.axes] == [True] * 5 + [False] * 3


def test_fingerprints_survive_the_head_optimum_fields():
  """TuneConfig's optimizer and lbfgs_* fields came after lines had been
  written: at their defaults they are not hashed, so every preset keeps
  the fingerprint (and the finished lines) it had; away from them the
  fingerprint moves. Values computed before those fields existed."""
  tiny = figure3.get_setup("tiny")
  assert (tiny.fingerprint("exact"), tiny.fingerprint("transformer"),
          figure3.get_setup("cpu").fingerprint("exact"),
          figure3.get_setup("paper").fingerprint("exact")) == (
              "19d48286c874", "fdca962b830c", "a6f38f8be942", "80bfbca971f2")
  flagged = figure3.get_setup("tiny", overrides={
      "prompt_attention": "true", "head_optimum": "true"})
  assert flagged.prompt_attention and flagged.head_optimum
  assert flagged.fingerprint("exact") == "19d48286c874"
  moved = figure3.get_setup("tiny", overrides={"tune.lbfgs_l2": "1e-3"})
  assert moved.fingerprint("exact") != "19d48286c874"
  with pytest.raises(ValueError, match="tune.optimizer is set per arm.*"
                     "--config.head_optimum=true"):
    figure3.get_setup("tiny", overrides={"tune.optimizer": "lbfgs"})


def test_plan_adds_the_arms_beyond_the_paper():
  """``prompt_attention``: prompt tuning with the attention head on each
  memory HMM; ``head_optimum``: an L-BFGS twin after every head arm, named
  ``<method>_<head>_lbfgs``. Off (the default), the plan is the paper's."""
  names = lambda setup: {m.tag: [g.method_name for g in gs]
                         for m, gs in configs.plan(setup).items()}
  tiny = figure3.get_setup("tiny", features=("raw",))
  assert names(tiny) == {
      "vanilla-h4": ["head_linear", "prompt_linear"],
      "vanilla-h8": ["head_linear"],
      "vanilla-h12": ["head_linear", "prompt_linear"],
      "memory-h4-m2": ["head_attention"]}
  both = figure3.get_setup("tiny", features=("raw",), prompt_attention=True,
                           head_optimum=True)
  assert names(both) == {
      "vanilla-h4": ["head_linear", "head_linear_lbfgs", "prompt_linear"],
      "vanilla-h8": ["head_linear", "head_linear_lbfgs"],
      "vanilla-h12": ["head_linear", "head_linear_lbfgs", "prompt_linear"],
      "memory-h4-m2": ["head_attention", "prompt_attention"]}
  prompt_only = figure3.get_setup("tiny", features=("raw",),
                                  prompt_attention=True)
  memory, = [gs for m, gs in configs.plan(prompt_only).items()
             if m.hmm == "memory"]
  assert [(g.panel, g.method, g.head, g.optimizer) for g in memory] == [
      ("right", "head", "attention", "adam"),
      ("right", "prompt", "attention", "adam")]
  # Stacks keep their sizes: the new arms are on panels already planned.
  assert all(configs.stack_sizes(both)[m] == configs.stack_sizes(tiny)[m]
             for m in configs.plan(tiny))


def test_report_shows_the_arms_beyond_the_paper_only_when_present(tmp_path):
  """The left table gets a "head optimum" column, the right an "attention
  prompt" one, each with a note, when their lines exist; without them the
  tables carry neither."""
  base = dict(backbone="exact", num_states=4, memory_size=0, task=0,
              features="raw", setup="abc", hmm_fingerprint="f",
              val_accuracy=0.5, train_accuracy=0.5, final_loss=0.1,
              steps=3, seconds=1.0, task_redraws=0, assumptions={},
              tune_config={}, task_config={}, test_accuracy=0.75)
  arms = [("left", "vanilla", 4, "head_linear"),
          ("left", "vanilla", 4, "prompt_linear"),
          ("right", "memory", 8, "head_attention"),
          ("right", "vanilla", 8, "head_linear")]
  extra = [("left", "vanilla", 4, "head_linear_lbfgs"),
           ("right", "memory", 8, "prompt_attention")]
  make = lambda arm_list: [
      schema.ResultLine(**base, panel=p, hmm=h, size=s, method=m, trial=k)
      for p, h, s, m in arm_list for k in range(2)]
  path = str(tmp_path / "figure3.md")
  reporting.write_table(reporting.summarize(make(arms)), path)
  plain = open(path).read()
  assert "optimum" not in plain and "attention prompt" not in plain
  assert "exact: memory + head attention (raw)" in plain
  reporting.write_table(reporting.summarize(make(arms + extra)), path)
  left, right = open(path).read().split("## Right", 1)
  assert "| exact: vanilla + head optimum (raw) |" in left
  assert "* head optimum: the linear head solved" in left
  assert "| exact: memory + attention prompt (raw) |" in right
  assert "* attention prompt: prompt tuning with the attention head" in right
  assert "(Theorem 4.6).\n" == right[right.index("(Theorem 4.6)"):]
  assert "instead of the paper's epochs of Adam.\n\n## Right" in (
      open(path).read())
  assert "head optimum" not in right
  assert reporting.trial_table(make(extra)).count("vanilla: head optimum") == 1
  # A draw without one arm's line shows an empty cell there.
  gap = [r for r in make(arms[:2]) if (r.trial, r.method) != (1,
                                                               "head_linear")]
  assert reporting.trial_table(gap).splitlines()[-2:] == [
      "| 4 | 0 | f | 75.0 | 75.0 |", "| 4 | 1 | f |  | 75.0 |"]


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CPU_PAPER = CPU_PAPER


def _readme_row(size: int, summary: dict, wins: dict) -> str:
  """The README's row of the cpu_paper table for left-panel size ``size``."""
  def cell(backbone, method):
    m, ci, n = summary[(backbone, "left", "vanilla", method, "raw")][size]
    return f"{m:.1f} ± {ci:.1f}"
  paper = [f"~{reporting.PAPER_LEFT[k][size]}"
           if size in reporting.PAPER_LEFT[k] else "" for k in ("prompt",
                                                                 "head")]
  return "| " + " | ".join(
      [str(size), *paper, cell("transformer", "head_linear"),
       cell("transformer", "prompt_linear"), wins[("transformer", size)],
       cell("exact", "head_linear"), cell("exact", "prompt_linear"),
       wins[("exact", size)]]) + " |"


@pytest.mark.slow
def test_the_committed_cpu_paper_report_is_rebuilt_from_its_lines(tmp_path):
  """The committed protocol (docs/results/figure3-cpu-paper/) is what its
  lines and pretraining metrics give: its report, rendered again here with
  no pretraining, is the committed figure3.md to the byte, with every
  transformer's gap in it, and the noise floor it was judged by
  (docs/results/noise-floor/); the README's table rows are its summary."""
  for name in ("results.jsonl", "sweep.json", "pretrain", noise.FLOOR):
    src = os.path.join(_CPU_PAPER, name)
    if os.path.isdir(src):
      shutil.copytree(src, tmp_path / name)
    else:
      shutil.copy(src, tmp_path / name)
  summary = reporting.write_figure3_report(str(tmp_path))
  with open(os.path.join(_CPU_PAPER, "figure3.md")) as f:
    assert (tmp_path / "figure3.md").read_text() == f.read()
  for plot in ("figure3.png", "pretraining.png"):
    assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  lines = figure3.read_results(_CPU_PAPER)
  models = {(r.hmm, r.size, r.trial) for r in lines
            if r.backbone == "transformer"}
  gaps = re.findall(r"^\| (?:vanilla|memory)-\S+ \| \d+ \| \d+ \|",
                    (tmp_path / "figure3.md").read_text(), re.M)
  assert len(gaps) == len(models) > 0  # one pretraining row per model
  # The draws on which prompt tuning beats head tuning: "wins of draws".
  wins = {(m[1], int(m[2])): f"{m[4]} of {m[3]}" for m in re.finditer(
      r"^\| (exact|transformer) \| raw \| (\d+) \| (\d+) \| (\d+) \|",
      (tmp_path / "figure3.md").read_text(), re.M)}
  with open(os.path.join(_ROOT, "README.md")) as f:
    readme = f.read()
  sizes = sorted({r.size for r in lines if r.panel == "left"
                  and r.backbone == "transformer"})
  for size in sizes:
    assert _readme_row(size, summary, wins) in readme, size


def test_worker_claims_give_each_stack_to_one_process(tmp_path):
  """Two workers asking for the same stacks: each stack goes to the first
  to ask, once; a backbone's stacks are claimed apart from another's."""
  first = workers.claims(str(tmp_path), "transformer")
  second = workers.claims(str(tmp_path), "transformer")
  mids = [protocol.vanilla(4), protocol.memory(2), protocol.vanilla(8)]
  assert [first(m) for m in mids[:2]] == [True, True]
  assert [second(m) for m in mids] == [False, False, True]
  assert [first(m) for m in mids] == [False, False, False]
  assert workers.claims(str(tmp_path), "exact")(mids[0])


def test_worker_files_merge_into_results_by_key(tmp_path):
  """The parent moves every worker file (a killed run's too) into
  results.jsonl: each key once, the files gone, the lines as written."""
  lines = figure3.read_results(os.path.join(
      __file__.rsplit("/tests/", 1)[0], "docs", "results",
      "figure3-cpu-paper"))[:30]
  d = str(tmp_path)
  files_lib.append_lines(workers.worker_results_path(d, 0), lines[:20])
  files_lib.append_lines(workers.worker_results_path(d, 1), lines[10:30])
  files_lib.append_lines(schema.results_path(d), lines[:5])
  assert workers.merge_results(d) == 25
  assert sorted(os.listdir(d)) == ["results.jsonl"]
  assert sorted(r.key() for r in figure3.read_results(d)) == sorted(
      r.key() for r in lines)
  assert workers.merge_results(d) == 0


class _Worker:
  """A stand-in for a worker process (``subprocess.Popen``): it runs until
  ``clock[0]`` (the parent's sleeps) reaches its ``exits``, then ends with
  its code, writing ``fault`` at ``error_path`` first; a SIGTERM ends it at
  once (code -15)."""

  def __init__(self, cmd, env, behave, claims_dir, index, clock):
    self.cmd, self.env, self.signals = cmd, env, []
    self.exits, self.code, fault = behave
    self.claims_dir, self.index, self.clock = claims_dir, index, clock
    self.fault, self.returncode = fault, None

  def poll(self):
    if self.returncode is None:
      if self.exits is not None and self.clock[0] >= self.exits:
        if self.fault:
          with open(workers.error_path(self.claims_dir, self.index), "w") as f:
            f.write(self.fault)
        self.returncode = self.code
    return self.returncode

  def send_signal(self, sig):
    self.signals.append(sig)
    self.returncode = -sig

  def wait(self):
    return self.returncode


@pytest.mark.parametrize("behaviours,raises", [
    # Worker 1 fails with a fault: the others are stopped, its line is the
    # binary's.
    ([(None, 0, ""), (2, 1, "disk full: rerun to resume"), (None, 0, "")],
     (OSError, "disk full: rerun to resume")),
    # A worker that fails with no fault: the others run to their end.
    ([(3, 0, ""), (2, 1, "")], (SystemExit, re.escape(
        "workers exited with [0, 1] (their logs above); rerun to resume"))),
    ([(1, 0, ""), (3, 0, "")], None),
])
def test_workers_run_pinned_and_a_fault_stops_them_all(
    tmp_path, monkeypatch, behaviours, raises):
  """``run_workers``: one process per core, each the binary's command line
  without ``--workers`` plus its index and the claims; their XLA single
  threaded and sharing a compilation cache under the claims; a worker's
  fault stops the others and is raised as the binary's one line; the
  claims are removed and the worker files merged either way."""
  procs = []
  claims_dirs = []
  real_mkdtemp = workers.tempfile.mkdtemp
  monkeypatch.setattr(workers.tempfile, "mkdtemp", lambda prefix: (
      claims_dirs.append(real_mkdtemp(prefix=prefix, dir=str(tmp_path)))
      or claims_dirs[-1]))

  clock = [0]

  def popen(cmd, env):
    i = len(procs)
    procs.append(_Worker(cmd, env, behaviours[i], claims_dirs[-1], i, clock))
    return procs[-1]

  def sleep(seconds):
    assert seconds == 0.2 and clock[0] < 10  # polls, not a busy loop
    clock[0] += 1

  monkeypatch.setattr(workers.subprocess, "Popen", popen)
  monkeypatch.setattr(workers.time, "sleep", sleep)
  monkeypatch.setattr(workers, "_cores", lambda: [3, 5])
  # No taskset (the last case): the workers run unpinned.
  pinned = raises is not None
  monkeypatch.setattr(workers.shutil, "which",
                      lambda name: "/bin/" + name if pinned else None)
  monkeypatch.setattr(sys.modules["__main__"], "__spec__", None,
                      raising=False)
  with pytest.raises(ValueError, match="^" + re.escape(
      "--workers needs the binary run as python -m MODULE") + "$"):
    workers.spawn(["figure3"], 1, str(tmp_path / "c"))
  monkeypatch.setattr(sys.modules["__main__"], "__spec__",
                      types.SimpleNamespace(name="experiments.figure3"))
  if pinned:
    monkeypatch.setenv("XLA_FLAGS", "--xla_mine=1")
  else:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setenv("HMMPROMPT_TEST_ENV", "kept")
  monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  workdir = str(tmp_path / "w")
  os.makedirs(workdir)
  merged = []
  monkeypatch.setattr(workers, "merge_results", merged.append)
  argv = ["figure3", "--preset=tiny", "--workers=0", "--workers", "3"]
  if raises is None:
    workers.run_workers(argv, len(behaviours), workdir)
  else:
    with pytest.raises(raises[0], match="^" + raises[1] + "$"):
      workers.run_workers(argv, len(behaviours), workdir)
  claims_dir, = claims_dirs
  assert os.path.basename(claims_dir).startswith("hmmprompt-claims-")
  assert [p.cmd for p in procs] == [
      (["/bin/taskset", "-c", str([3, 5][i % 2])] if pinned else [])
      + [sys.executable, "-m", "experiments.figure3", "--preset=tiny",
         f"--worker={i}", f"--claims={claims_dir}"]
      for i in range(len(behaviours))]
  for p in procs:
    assert p.env["XLA_FLAGS"] == " ".join(
        (["--xla_mine=1"] if pinned else []) + [*workers.SINGLE_THREAD_FLAGS])
    assert p.env["HMMPROMPT_TEST_ENV"] == "kept"
    assert p.env["MALLOC_ARENA_MAX"] == "1"
    assert p.env["JAX_COMPILATION_CACHE_DIR"] == os.path.join(claims_dir,
                                                               "xla")
  faulted = any(fault for _, _, fault in behaviours)
  # Stopped by SIGTERM: the workers still running when one left a fault.
  assert [p.signals for p in procs] == [
      [signal.SIGTERM] if faulted and exits is None else []
      for exits, _, _ in behaviours]
  assert not os.path.exists(claims_dir) and merged == [workdir]


def test_workers_progress_counts_every_workers_groups(tmp_path, monkeypatch):
  """``workers.progress``: each worker marks its finished groups under the
  shared claims and reads how many all have finished, and how many workers
  ``spawn`` started, so every worker's lines count the whole run."""
  claims_dir = str(tmp_path / "claims")
  seen = []

  class Ended:
    returncode = 0

    def poll(self):
      return 0

  def popen(cmd, env):  # each worker marks one group as it starts here
    del cmd, env
    mark = workers.progress(claims_dir, "exact")
    seen.append(mark(f"vanilla-h4-{len(seen)}"))
    return Ended()

  monkeypatch.setattr(workers.subprocess, "Popen", popen)
  monkeypatch.setattr(sys.modules["__main__"], "__spec__",
                      types.SimpleNamespace(name="experiments.figure3"),
                      raising=False)
  assert workers.spawn(["figure3"], 3, claims_dir) == [0, 0, 0]
  assert seen == [(1, 3), (2, 3), (3, 3)]
  # A key marked again counts once; another backbone counts apart.
  assert workers.progress(claims_dir, "exact")("vanilla-h4-0") == (3, 3)
  assert workers.progress(claims_dir, "transformer")("vanilla-h4-0") == (1, 3)
  # Without spawn's count (called by hand): one worker.
  assert workers.progress(str(tmp_path / "bare"), "exact")("a") == (1, 1)


def test_workers_are_refused_by_name_where_they_cannot_run():
  with pytest.raises(ValueError, match="--workers must be >= 0, got -2"):
    workers.resolve_count(-2)
  with pytest.raises(ValueError, match="does not combine with --num_tasks"):
    workers.resolve_count(2, num_hosts=3)
  assert workers.resolve_count(1) == 1
  # ./launch.sh passes --workers=0: a SLURM array's host runs one process.
  assert workers.resolve_count(0, num_hosts=4) == 1
  assert 1 <= workers.resolve_count(0) <= (os.cpu_count() or 1)


def test_chunk_workers_get_the_command_line_without_the_parents_flags():
  """The in_chunks workers rerun the parent's command line with its own
  workdir and deadline: the flags only the parent uses are dropped in
  both spellings (``--name=value``, ``--name value``), nothing else."""
  argv = ["in_chunks", "--preset=cpu_paper", "--workdir", "W", "--out=O",
          "--budget_s", "60", "--workers=0", "--chunk=left:4",
          "--config.trials=2", "--outer=1"]
  assert workers._without(argv, ("workdir", "out", "budget_s", "workers")) == [
      "in_chunks", "--preset=cpu_paper", "--chunk=left:4",
      "--config.trials=2", "--outer=1"]


def test_a_chunk_archive_carries_fallback_metrics_into_the_merge(tmp_path):
  """A stack whose draws fell back (the committed protocol's ``|H|`` =
  25): its archive holds each ``fallback-<k>/`` run's metrics and config,
  the merge accepts them (it refuses any other member) and the merged
  report names the deeper models."""
  from hmmprompt.figure3 import chunks
  work, results = tmp_path / "work", str(tmp_path / "results")
  tag = next(d for d in os.listdir(os.path.join(_CPU_PAPER, "pretrain"))
             if d.startswith("vanilla-h25-"))
  shutil.copytree(os.path.join(_CPU_PAPER, "pretrain", tag),
                  work / "pretrain" / tag)
  shutil.copy(os.path.join(_CPU_PAPER, "sweep.json"), work / "sweep.json")
  lines = [r for r in figure3.read_results(_CPU_PAPER)
           if r.backbone == "transformer" and r.panel == "left"
           and r.size == 25]
  files_lib.append_lines(schema.results_path(str(work)), lines)
  archive = str(tmp_path / "chunk.tar.gz")
  names = chunks.write_chunk_archive(str(work), archive, {"chunk": "left:25"})
  fallbacks = sorted({n.split("/")[2] for n in names if "/fallback-" in n})
  assert fallbacks == ["fallback-13", "fallback-18", "fallback-2"]
  assert chunks.merge(archive, results)["added"] == len(lines)
  for k in (2, 13, 18):
    assert open(os.path.join(results, "pretrain", tag, f"fallback-{k}",
                             "metrics.jsonl")).read()
  assert open(os.path.join(results, "figure3.md")).read().count(
      "(4 layers)") >= 3


def test_a_padded_stack_is_tuned_at_each_trials_own_depth():
  """``Trials.by_depth``: in a stack padded for a fallback
  (``pretrain.load_trials``), the shallow trials get back their own params,
  exactly (``take_layers`` undoes ``pad_layers``), and their own depth's
  backbone, whose outputs are the padded model's to float rounding; the
  deep trial keeps the stack's backbone. Exact trials stay one group."""
  import jax
  from hmmprompt.backbones import depth
  from hmmprompt.backbones import transformer
  shallow = transformer.MLMConfig(vocab_size=5, d_model=16, num_heads=2,
                                  d_ff=32, num_layers=1, max_len=8)
  deep = dataclasses.replace(shallow, num_layers=3)
  p0, p2 = (transformer.init_params(jax.random.PRNGKey(k), shallow)
            for k in (0, 2))
  p1 = transformer.init_params(jax.random.PRNGKey(1), deep)
  padded = [depth.pad_layers(p, 3) for p in (p0, p2)]
  stack = lambda *ps: jax.tree.map(lambda *x: np.stack(x), *ps)
  trials = sweep.Trials(None, transformer.make_backbone(deep),
                        stack(padded[0], p1, padded[1]), [{}] * 3,
                        [shallow, deep, shallow],
                        {1: transformer.make_backbone(shallow)})
  (bb_s, params_s, ids_s), (bb_d, params_d, ids_d) = trials.by_depth(
      [0, 1, 2])
  assert (ids_s, ids_d) == ([0, 2], [1])
  assert bb_d is trials.backbone
  assert bb_s is transformer.make_backbone(shallow)
  jax.tree.map(np.testing.assert_array_equal, params_s, stack(p0, p2))
  jax.tree.map(np.testing.assert_array_equal, params_d, stack(p1))
  tokens = np.array([1, 4, 0, 2, 3], np.int32)
  own_fn, pad_fn = jax.jit(bb_s.outputs), jax.jit(trials.backbone.outputs)
  for i, k in enumerate(ids_s):
    own, _ = own_fn(jax.tree.map(lambda x, i=i: x[i], params_s), tokens)
    pad, _ = pad_fn(jax.tree.map(lambda x, k=k: x[k], trials.params_K),
                    tokens)
    np.testing.assert_allclose(own, pad, rtol=1e-5, atol=1e-6)
  assert [ids for *_, ids in trials.by_depth([2, 1])] == [[2], [1]]
  exact = sweep.Trials(None, trials.backbone, trials.params_K, [{}] * 3,
                       [None] * 3, {})
  assert [ids for *_, ids in exact.by_depth([0, 2])] == [[0, 2]]
  with pytest.raises(ValueError, match="take_layers"):
    depth.take_layers(p0, 2)


# Under --xla_cpu_max_isa=SSE4_2 or AVX all 170 fingerprints differ
# (2026-11-25).
@pytest.mark.skipif(without_fma(), reason="the committed draws were made "
                    "with FMA (AVX2 and up); without it they round apart")
def test_the_committed_cpu_paper_lines_name_the_hmms_their_seeds_draw():
  """The committed ``cpu_paper`` lines' ``hmm_fingerprint`` is the
  fingerprint of the HMM their seed, size and trial draw now: the committed
  results stay reproducible (a change in the draw streams, the sampling of
  Appendix D's parameters or the fingerprint recipe fails here). Holds on
  CPUs with FMA, where the committed run was made (Intel Xeon with
  AVX-512, checked on an AMD EPYC with AVX2)."""
  setup = figure3.get_setup("cpu_paper")
  want: dict = {}
  for r in figure3.read_results(_CPU_PAPER):
    want.setdefault((r.hmm, r.num_states, r.memory_size), {})[r.trial] = (
        r.hmm_fingerprint)
  assert len(want) == 13 and sum(map(len, want.values())) == 170
  # Two of the 13 stacks, one of each kind (each stack is one program to
  # compile; all 170 were checked when this test was written).
  for (hmm, num_states, memory_size) in [("vanilla", 30, 0),
                                         ("memory", 4, 7)]:
    by_trial = want[(hmm, num_states, memory_size)]
    mid = protocol.ModelId(hmm, num_states, memory_size)
    got = generative.fingerprints(protocol.make_models(setup, mid,
                                                       len(by_trial)))
    assert got == [by_trial[k] for k in range(len(by_trial))], mid


def test_a_merge_keeps_the_pretraining_run_that_went_furthest(tmp_path,
                                                             caplog):
  """A run cut short by a deadline archives the evaluations it reached; the
  run that later finishes it (same directory) has those and more, and
  replaces them at the merge. Any other difference keeps what is there."""
  ev = lambda step: json.dumps({"trial": 0, "step": step}) + "\n"
  cut, whole = tmp_path / "cut.jsonl", tmp_path / "whole.jsonl"
  cut.write_text(ev(250))
  whole.write_text(ev(250) + ev(500))
  dest = tmp_path / "results" / "metrics.jsonl"
  os.makedirs(dest.parent)
  chunks._copy_new(str(cut), str(dest))
  assert dest.read_text() == ev(250)
  chunks._copy_new(str(whole), str(dest))
  assert dest.read_text() == ev(250) + ev(500)
  chunks._copy_new(str(cut), str(dest))  # an older archive merged late
  assert dest.read_text() == ev(250) + ev(500)
  assert "differs from the archive's copy" in caplog.text
  config = tmp_path / "results" / "config.json"
  config.write_text("{}")
  longer = tmp_path / "config.json"
  longer.write_text("{\n}\n")
  chunks._copy_new(str(longer), str(config))  # only metrics grow
  assert config.read_text() == "{}"


def _timeless(workdir):
  """Key -> a result line's fields but the timing ones."""
  return {r.key(): {k: v for k, v in r.to_json().items()
                    if k not in chunks.TIMING_FIELDS}
          for r in schema.read_results(workdir)}


@pytest.mark.slow  # ~6 CPU-s: two pretrainings of 4 tiny transformers
def test_a_stack_run_in_parts_merges_to_the_whole_stack(tmp_path,
                                                        monkeypatch, caplog):
  """The device protocol's 15-minute sessions: a chunk whose deadline the
  whole stack overruns pretrains and tunes the trials that fit, alone; the
  next chunk, from the merged results, the rest alone, cut by the deadline
  mid-pretraining in a kept workdir that checkpoints only then, and
  resumed there by the next command. Merged, the lines equal the whole
  stack's run bit for bit (timings and the parts aside), and the report
  numbers the parts' pretraining runs by trial."""
  setup = dataclasses.replace(figure3.get_setup("tiny", {
      "trials": 4, "features": "raw", "left_sizes": "4",
      "task.num_train": 64, "task.num_val": 16, "task.num_test": 32,
      "task.seq_len": 12, "tune.epochs": 1, "tune.prompt_len": 2,
      "pretrain.steps": 20}), memory_sizes=())
  whole = str(tmp_path / "whole")
  sweep.run_sweep(setup, whole, "left", "transformer", checkpoints="never")
  results = str(tmp_path / "results")

  def first_part(cfg, workdir, deadline):  # 3.5 trials' time: 2 fit
    return sweep.run_sweep(cfg, workdir, "both", "transformer",
                           scheduling.Schedule(
                               deadline=deadline,
                               stop_at=time.monotonic() + 300,
                               seconds_per_weight=300 / 3.5),
                           checkpoints="never")

  info = chunks.run_chunk(setup, "left:4", "transformer", results,
                          str(tmp_path / "1"), compute=first_part)
  assert info["skipped_stacks"] == ["vanilla-h4 (in part)"]
  assert info["cells_computed"] == 4  # 2 trials x head, prompt
  chunks.merge(os.path.join(tmp_path, "1", chunks.ARCHIVE), results)
  calls = [0]

  def cut_at_step_13():  # the loop's clock, read once a step
    calls[0] += 1
    return math.inf if calls[0] == 13 else time.monotonic()

  kept = str(tmp_path / "kept")
  monkeypatch.setattr(pretrain_loop, "_clock", cut_at_step_13)
  caplog.set_level(logging.INFO)
  schedules, run_sweep = [], sweep.run_sweep
  monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: (
      schedules.append(a[4]) or run_sweep(*a, **k)))
  cut, info = [chunks.run_chunk(setup, "left:4", "transformer", results,
                                str(tmp_path / out), workdir=kept,
                                deadline_s=300.0, checkpoints="deadline")
               for out in ("2", "3")]
  # Each chunk's estimate of the tuning, from the first part's lines.
  tune_s = chunks.seconds_per_trial(results, tuning_only=True)
  assert tune_s and [s.tune_seconds_per_trial for s in schedules] == [
      tune_s, tune_s]
  assert cut["cells_computed"] == 0 and "pretraining step 13 of" in (
      cut["stopped"])
  # The second command went on from the first's checkpoint of step 13.
  assert "resumed 2 trials from step 13" in caplog.messages
  assert info["cells_computed"] == 4 and info["skipped_stacks"] == []
  chunks.merge(os.path.join(tmp_path, "3", chunks.ARCHIVE), results)
  parted = {k: {f: v for f, v in d.items() if f != "pretrain_part"}
            for k, d in _timeless(results).items()}
  assert parted == _timeless(whole)
  assert sorted((r.trial, tuple(r.pretrain_part)) for r in
                schema.read_results(results) if r.method == "head_linear") == [
                    (0, (0, 2)), (1, (0, 2)), (2, (2, 4)), (3, (2, 4))]
  runs = pretrain_report.runs(results)
  assert [(name.split("-")[2:4], sorted(by_trial)) for name, _, by_trial
          in runs] == [(["trials0", "1"], [0, 1]), (["trials2", "3"], [2, 3])]
  # Each part's metrics are the whole run's for its trials.
  by_whole = dict(pretrain_report.runs(whole)[0][2])
  for _, _, by_trial in runs:
    for k, ms in by_trial.items():
      assert [{f: v for f, v in m.items() if f not in ("wall_s", "trial")}
              for m in ms] == [
                  {f: v for f, v in m.items() if f not in ("wall_s", "trial")}
                  for m in by_whole[k]]
  # The parts count as stacks of their own in the next run's estimate: each
  # its pretraining wall time and its own tuning programs.
  lines = schema.read_results(results)
  spent = tuning = 0.0
  for part in ([0, 2], [2, 4]):
    mine = [r for r in lines if r.pretrain_part == part]
    tuned = sum({(r.panel, r.method, r.features): r.seconds
                 for r in mine}.values())
    spent += max(r.pretrain_wall_s for r in mine) + tuned
    tuning += tuned
  assert chunks.seconds_per_trial(results) == pytest.approx(1.2 * spent / 4)
  # The tuning's share, for a stack that ends late to save its pretraining.
  assert chunks.seconds_per_trial(results, tuning_only=True) == (
      pytest.approx(1.2 * tuning / 4))
