r"""Accuracy against pretraining quality: head and prompt tuning on the
checkpoints of one pretraining run, from the random init to the end.

  python -m experiments.pretraining_curve --preset=tiny|cpu --workdir=DIR \
      [--config.pretrain.steps=1000 --config.pretrain.retain=0,10,100,1000] \
      [--config.trials=2 --config.vanilla_sizes=8 --config.memory_sizes= ...]

Figure 3 tunes each transformer once, at the end of its pretraining; how
much of the gap to the exact backbone is the transformer's distance from
the Bayes optimum is what this measures. Per model (vanilla ``|H|`` and
memory ``|M|`` with :data:`configs.MEMORY_SYNTAX_STATES` syntax states,
``trials`` HMM draws each, the same draws as Figure 3's sweep for the same
seed), one stacked pretraining run (no early stop) retains its checkpoints
at ``pretrain.retain`` (:attr:`PretrainConfig.retain`, step 0 the init);
each retained checkpoint's held-out CE gap and TV at ``MASK`` are measured
on the loop's validation sets (:func:`pretrain.evaluate_checkpoints`); head
and prompt tuning (vanilla: the linear head; memory: the attention head)
run on every checkpoint x trial in one :func:`tuning.tune_trials` program
per (model, method), lanes ``[Q * K]`` (retained step ``q``, trial ``k``
at lane ``q * K + k``), each with its trial's task and tuning key, so the
checkpoints of a trial differ in nothing but their params; the exact
backbone (perfect pretraining) is tuned on the same tasks as the limit.

Writes DIR/curve.json (the setup's identity: a workdir of another setup is
refused, the difference named), DIR/pretrain/<model>/ (the stacked runs),
DIR/curve.jsonl (one :class:`CurveLine` per (model, trial, checkpoint,
method), plus the exact backbone's per (model, trial, method), appended
atomically one group at a time: a group is (model, method, backbone), and
a rerun skips the finished ones, so an interrupted run resumes with nothing
lost or duplicated), DIR/curve.md (the table, the gap at which each method
comes within 2 points of the exact backbone, rank correlations) and
DIR/curve.png (test accuracy against CE gap). Presets: ``tiny`` (seconds,
tests) and ``cpu`` (2 cores, docs/pretraining_curve.md).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Any, Mapping

from absl import app
from absl import flags
from absl import logging
import jax
import numpy as np
import scipy.stats

from experiments.figure3 import configs as fig_configs
from experiments.figure3 import sweep as fig_sweep
from hmmprompt import config_flags
from hmmprompt import host_memory
from hmmprompt import models
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import results as results_lib
from hmmprompt import tasks as tasks_lib
from hmmprompt import tuning
from hmmprompt import validation
from hmmprompt.backbones import exact
from hmmprompt.pretrain import workdir as pretrain_workdir

# Bumped when a line's meaning changes for the same setup (the fingerprint
# hashes it, and DIR/curve.json records it).
LAYOUT = 1
BACKBONES = ("transformer", "exact")
WITHIN = 0.02  # "within 2 points of the exact backbone"
# The log x axis has no 0: a gap at or below this (float noise on the
# held-out set) is drawn here.
GAP_FLOOR = 1e-3


@dataclasses.dataclass(frozen=True)
class CurveSetup:
  """Everything that decides the curve's lines besides their keys.

  Attributes:
    trials: HMM draws per model, each with its own transformer and task.
    vanilla_sizes: ``|H|`` of the vanilla models (linear head).
    memory_sizes: ``|M|`` of the memory models (attention head).
    task: downstream data sizes.
    tune: tuning recipe; ``method`` and ``head`` are set per group.
    pretrain: the pretraining recipe; ``retain`` (a runtime field of the
      pretraining, but the curve's x points) is the checkpoint schedule and
      part of this setup's identity; no ``target_gap`` (a trial stopped
      early would repeat its state at every later checkpoint).
    seed: root of every random stream (as :mod:`experiments.figure3.sweep`).
    lanes_per_vmap: runtime: lanes tuned at a time (``None``: 1 on CPU,
      all on accelerators; 0 all).
    task_memory_mb: runtime: :func:`tasks.make_tasks`' memory budget (MiB;
      0 unbounded).
  """

  trials: int
  vanilla_sizes: tuple[int, ...]
  memory_sizes: tuple[int, ...]
  task: tasks_lib.TaskConfig
  tune: tuning.TuneConfig
  pretrain: pretrain_lib.PretrainConfig
  seed: int = 0
  lanes_per_vmap: int | None = dataclasses.field(
      default=None, metadata=config_flags.RUNTIME)
  task_memory_mb: int = dataclasses.field(
      default=tasks_lib.MEMORY_BUDGET >> 20, metadata=config_flags.RUNTIME)

  def __post_init__(self):
    if not (isinstance(self.trials, int) and self.trials >= 1):
      raise ValueError(f"CurveSetup.trials must be an int >= 1, got "
                       f"{self.trials!r}")
    validation.require_positive_ints(self, "vanilla_sizes", "memory_sizes")
    if not self.vanilla_sizes + self.memory_sizes:
      raise ValueError("CurveSetup.vanilla_sizes and memory_sizes are both "
                       "empty: no model to run")
    if not self.pretrain.retain:
      raise ValueError("CurveSetup.pretrain.retain is empty: set the "
                       "checkpoint schedule (e.g. 0,25,100,400,1000)")
    if self.pretrain.target_gap is not None:
      raise ValueError(f"CurveSetup.pretrain.target_gap must be none (no "
                       f"early stop), got {self.pretrain.target_gap}")
    if self.tune.optimizer != "adam":
      raise ValueError(f"CurveSetup.tune.optimizer must be 'adam', got "
                       f"{self.tune.optimizer!r}")
    for name in ("lanes_per_vmap", "task_memory_mb"):
      v = getattr(self, name)
      if not (v is None and name == "lanes_per_vmap") and not (
          isinstance(v, int) and v >= 0):
        raise ValueError(f"CurveSetup.{name} must be an int >= 0, got {v!r}")
    need = tasks_lib.input_len(self.tune.prompt_len, self.task.seq_len)
    if need > self.pretrain.model.max_len:
      raise ValueError(
          f"prompt_len + 1 + seq_len = {need} positions exceed the "
          f"pretrained context of {self.pretrain.model.max_len}; lower "
          f"--config.task.seq_len or --config.tune.prompt_len")

  def identity(self) -> dict:
    """What DIR/curve.json records and :meth:`fingerprint` hashes: every
    result-deciding field, the checkpoint schedule and the key streams'
    version."""
    return json.loads(json.dumps(
        {**config_flags.identity(self), "retain": self.pretrain.retain,
         "model_keys": fig_configs.MODEL_KEYS_VERSION, "layout": LAYOUT}))

  def fingerprint(self) -> str:
    """12 hex digits keying the lines to what decides a line's values:
    :meth:`identity` without the trial count, the models and the schedule,
    which decide which lines there are (their keys), not their values."""
    blob = {k: v for k, v in self.identity().items() if k not in (
        "trials", "vanilla_sizes", "memory_sizes", "retain")}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()
                          ).hexdigest()[:12]

  def lane_group(self) -> int | None:
    """``tuning.tune``'s ``lane_group`` (``None``: all lanes at once)."""
    return tuning.lane_group_for(self.lanes_per_vmap)

  def model_ids(self) -> list[fig_sweep.ModelId]:
    """The models, vanilla then memory, by size (the order they run)."""
    syntax = fig_configs.MEMORY_SYNTAX_STATES
    return ([fig_sweep.ModelId("vanilla", h, 0) for h in self.vanilla_sizes]
            + [fig_sweep.ModelId("memory", syntax, m)
               for m in self.memory_sizes])


def _tiny() -> CurveSetup:
  """Seconds: tests and smoke runs (the tiny transformer, 40 steps)."""
  return CurveSetup(
      trials=2, vanilla_sizes=(4,), memory_sizes=(2,),
      task=tasks_lib.TaskConfig(num_train=64, num_val=16, num_test=32,
                                seq_len=12),
      tune=tuning.TuneConfig(epochs=1, prompt_len=2, batch_size=32),
      pretrain=pretrain_lib.configure("tiny", retain=(0, 10, 40)))


def _cpu() -> CurveSetup:
  """2 cores in <= 15 minutes (docs/pretraining_curve.md): Figure 3's
  cpu-preset models at |H| = 8, 12, 28 and |M| = 7, 3 trials; the
  ``cpu_capped`` transformer trained for one learning-rate cycle with no
  early stop, checkpoints log-spaced from the init; 80-position inputs as
  the main job (20 prompt vectors, MASK, 59 tokens), smaller task sets."""
  # Measured on 2 cores: a stack of 3 trials costs ~24 ms per trial-step,
  # prompt tuning ~3.7 s per lane and head tuning ~0.4 s (1000 training
  # examples); 1500 steps and 8 checkpoints came to ~17 minutes.
  steps = 1000
  return CurveSetup(
      trials=3, vanilla_sizes=(8, 12, 28), memory_sizes=(7,),
      task=tasks_lib.TaskConfig(num_train=1000, num_val=250, num_test=500,
                                seq_len=59),
      tune=tuning.TuneConfig(epochs=5, prompt_len=20, batch_size=32),
      pretrain=pretrain_lib.configure(
          "cpu_capped", steps=steps, cycles=None, target_gap=None,
          eval_every=steps, ckpt_every=250,
          retain=(0, 25, 50, 100, 200, 400, steps)))


PRESETS = {"tiny": _tiny, "cpu": _cpu}


def get_setup(preset: str = "cpu",
              overrides: Mapping[str, Any] | None = None,
              **fields) -> CurveSetup:
  """The named preset with ``{"a.b": value}`` overrides (strings parsed)
  and top-level ``fields``; ``ValueError`` naming an unknown preset, key
  or a bad value."""
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; known: "
                     f"{', '.join(PRESETS)}")
  return config_flags.apply(PRESETS[preset](),
                            {**fields, **dict(overrides or {})})


# ----------------------------------------------------------------------------
# Result lines.


@dataclasses.dataclass(frozen=True)
class CurveLine:
  """One tuned (model, trial, checkpoint, method).

  Key fields (what a rerun looks up): ``model`` (:attr:`ModelId.tag`),
  ``trial``, ``backbone`` (transformer | exact), ``step`` (the retained
  checkpoint; ``None`` for exact), ``method`` (``<method>_<head>``) and
  ``setup`` (:meth:`CurveSetup.fingerprint`). ``ce_gap`` / ``tv``: the
  checkpoint's held-out CE gap to the Bayes CE and TV at ``MASK``
  (:func:`pretrain.evaluate_checkpoints`); 0 for the exact backbone, whose
  conditionals are the Bayes ones by construction (``mlm_ce`` and
  ``bayes_ce`` are ``None`` there). ``seconds``: the group's program.
  """

  model: str
  trial: int
  backbone: str
  step: int | None
  method: str
  setup: str
  hmm: str
  num_states: int
  memory_size: int
  hmm_fingerprint: str
  ce_gap: float
  tv: float
  mlm_ce: float | None
  bayes_ce: float | None
  test_accuracy: float
  val_accuracy: float
  train_accuracy: float
  final_loss: float
  seconds: float

  KEY_FIELDS = ("model", "trial", "backbone", "step", "method", "setup")

  def key(self) -> tuple:
    return tuple(getattr(self, f) for f in self.KEY_FIELDS)


def results_path(workdir: str) -> str:
  return os.path.join(workdir, "curve.jsonl")


def read_lines(workdir: str) -> list[CurveLine]:
  """The lines of DIR/curve.jsonl; ``ValueError`` naming a bad one."""
  return results_lib.read_lines(results_path(workdir), CurveLine,
                                "curve line")


# ----------------------------------------------------------------------------
# The run.


@dataclasses.dataclass(frozen=True)
class Group:
  """One model, tuning method and backbone: one program, one append."""

  model_id: fig_sweep.ModelId
  method: str  # "head" | "prompt"
  backbone: str  # "transformer" | "exact"

  @property
  def head(self) -> str:
    return "attention" if self.model_id.hmm == "memory" else "linear"

  @property
  def method_name(self) -> str:
    return f"{self.method}_{self.head}"

  def keys(self, setup: CurveSetup) -> set[tuple]:
    """The line keys this group writes."""
    steps = (setup.pretrain.retain if self.backbone == "transformer"
             else (None,))
    fp = setup.fingerprint()
    return {(self.model_id.tag, k, self.backbone, s, self.method_name, fp)
            for k in range(setup.trials) for s in steps}


def plan(setup: CurveSetup) -> dict[fig_sweep.ModelId, list[Group]]:
  """The groups by model, in the order they run."""
  return {mid: [Group(mid, method, bb) for method in ("head", "prompt")
                for bb in BACKBONES] for mid in setup.model_ids()}


def model_key(setup: CurveSetup, mid: fig_sweep.ModelId):
  """``mid``'s root key, as :func:`experiments.figure3.sweep.model_key`:
  trial ``k`` is ``fold_in(root, k)``, so the draws are the sweep's."""
  return fig_sweep.model_key(setup, mid)  # reads setup.seed only


def make_models(setup: CurveSetup, mid: fig_sweep.ModelId) -> models.Model:
  """``mid``'s trials stacked ``[K]``."""
  return models.random_models(model_key(setup, mid), setup.trials, mid.hmm,
                              mid.num_states, fig_configs.VOCAB,
                              mid.memory_size)


def task_key(setup: CurveSetup, mid: fig_sweep.ModelId, trial: int):
  """The sweep's key of task 0 of ``trial``."""
  return fig_sweep.task_key(setup, mid, trial, 0)


def tune_key(setup: CurveSetup, trial: int):
  """The sweep's tuning key of task 0 of ``trial``: every checkpoint of a
  trial (and its exact backbone) starts from the same head, prompt and
  batch order."""
  return fig_sweep.tune_key(setup, trial, 0)


def check_workdir(workdir: str, setup: CurveSetup) -> None:
  """Records the setup's identity in DIR/curve.json on first use.

  Raises:
    ValueError: the workdir was made with another setup (what differs
      named).
  """
  path = os.path.join(workdir, "curve.json")
  want = setup.identity()
  if os.path.exists(path):
    with open(path) as f:
      had = json.load(f)
    diff = pretrain_workdir.differences(had, want)
    if diff:
      raise ValueError(f"{workdir} holds a curve of another setup "
                       f"({'; '.join(diff)}); use a new --workdir (or "
                       f"delete it)")
    return
  os.makedirs(workdir, exist_ok=True)
  results_lib.atomic_write_text(path, json.dumps(want, indent=1,
                                                 sort_keys=True))


class _Model:
  """A model's trials, their tasks and (when a transformer group is left)
  their retained checkpoints with the checkpoints' metrics."""

  def __init__(self, workdir: str, setup: CurveSetup,
               mid: fig_sweep.ModelId, pretrained: bool):
    self.models_K = make_models(setup, mid)
    self.fingerprints = models.fingerprints(self.models_K)
    num = setup.trials
    self.tasks_K = tasks_lib.make_tasks(
        np.stack([task_key(setup, mid, k) for k in range(num)]),
        self.models_K, setup.task, (setup.task_memory_mb << 20) or None)
    if not pretrained:
      return
    pdir = os.path.join(workdir, "pretrain", mid.tag)
    logging.info("pretraining %d trials of %s in %s", num, mid.tag, pdir)
    pretrain_lib.run_trials(pdir, setup.pretrain, self.models_K,
                            log=logging.info)
    self.backbone, self.params_QxK, steps, _ = pretrain_lib.load_retained(
        pdir)
    missing = sorted(set(setup.pretrain.retain) - set(steps))
    if missing:
      raise FileNotFoundError(
          f"{pdir} lacks the retained steps {missing} (it was pretrained "
          f"past them without retaining them); delete it to pretrain again")
    # The schedule's checkpoints, in its order (a directory may hold more).
    idx = np.asarray([steps.index(s) for s in setup.pretrain.retain])
    self.params_QxK = jax.tree.map(lambda x: x[idx], self.params_QxK)
    self.metrics_QxK = pretrain_lib.evaluate_checkpoints(
        setup.pretrain, self.models_K, self.params_QxK)


def tune_group(setup: CurveSetup, g: Group, m: _Model) -> list[CurveLine]:
  """Tunes ``g``: every retained checkpoint x trial (transformer, lanes
  ``[Q * K]``, lane ``q * K + k``) or every trial (exact) in one program;
  returns its lines."""
  cfg = dataclasses.replace(setup.tune, method=g.method, head=g.head)
  num = setup.trials
  data_K = [tuning.data_from_task(m.tasks_K[k], cfg) for k in range(num)]
  if g.backbone == "transformer":
    steps = setup.pretrain.retain
    backbone = m.backbone
    params = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]),
                          m.params_QxK)
  else:
    steps = (None,)
    backbone, _ = exact.make(models.trial(m.models_K, 0))
    params = jax.vmap(models.as_hmm)(m.models_K)
  lanes = [(q, k) for q in range(len(steps)) for k in range(num)]
  res, _ = tuning.tune_trials(
      [[tune_key(setup, k)] for _, k in lanes], backbone, params,
      [[data_K[k]] for _, k in lanes], cfg, lane_group=setup.lane_group())
  mid, fp, lines = g.model_id, setup.fingerprint(), []
  for i, (q, k) in enumerate(lanes):
    if g.backbone == "transformer":
      ev = m.metrics_QxK[q][k]
      quality = dict(ce_gap=float(ev["ce_gap"]), tv=float(ev["tv"]),
                     mlm_ce=float(ev["mlm_ce"]),
                     bayes_ce=float(ev["bayes_ce"]))
    else:
      quality = dict(ce_gap=0.0, tv=0.0, mlm_ce=None, bayes_ce=None)
    lines.append(CurveLine(
        model=mid.tag, trial=k, backbone=g.backbone, step=steps[q],
        method=g.method_name, setup=fp, hmm=mid.hmm,
        num_states=mid.num_states, memory_size=mid.memory_size,
        hmm_fingerprint=m.fingerprints[k], **quality,
        test_accuracy=float(res.test_accuracy[i, 0]),
        val_accuracy=float(res.val_accuracy[i, 0]),
        train_accuracy=float(res.train_accuracy[i, 0]),
        final_loss=float(res.final_loss[i, 0]), seconds=res.seconds))
  return lines


def run(setup: CurveSetup, workdir: str) -> list[CurveLine]:
  """Runs the groups without lines in DIR/curve.jsonl (pretraining a
  model's stack only if one of its transformer groups is left); returns
  all lines.

  Raises:
    ValueError: the workdir holds another setup's curve.
  """
  check_workdir(workdir, setup)
  path = results_path(workdir)
  done = {line.key() for line in read_lines(workdir)}
  todo = {mid: [g for g in groups if not g.keys(setup) <= done]
          for mid, groups in plan(setup).items()}
  total = sum(len(gs) for gs in todo.values())
  finished, t0 = 0, time.perf_counter()
  for mid, groups in todo.items():
    if not groups:
      continue
    m = _Model(workdir, setup, mid,
               pretrained=any(g.backbone == "transformer" for g in groups))
    for g in groups:
      lines = [r for r in tune_group(setup, g, m) if r.key() not in done]
      results_lib.append_jsonl(path, [dataclasses.asdict(r) for r in lines])
      done |= {r.key() for r in lines}
      finished += 1
      logging.info("[%d/%d groups] %s %s %s: test acc %.3f over %d lanes "
                   "(%.1fs); elapsed %.0fs", finished, total, mid.tag,
                   g.method_name, g.backbone,
                   np.mean([r.test_accuracy for r in lines]), len(lines),
                   lines[0].seconds, time.perf_counter() - t0)
    del m  # one model's checkpoints in memory at a time
  return read_lines(workdir)


# ----------------------------------------------------------------------------
# The report.


def _spearman(x, y) -> float:
  if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return float("nan")
  return float(scipy.stats.spearmanr(x, y).statistic)


def _per_decade(gaps, deficits) -> float:
  """Least-squares slope of the accuracy deficit (points) against
  log10 of the CE gap: how much accuracy a tenfold larger gap costs."""
  x = np.log10(np.maximum(np.asarray(gaps, np.float64), GAP_FLOOR))
  if len(x) < 2 or np.ptp(x) == 0:
    return float("nan")
  return float(100 * np.polyfit(x, np.asarray(deficits, np.float64), 1)[0])


def summarize(lines: list[CurveLine]) -> dict:
  """``{model: {method: {"steps": [Q], "gap", "tv", "acc", "sd": [Q],
  "exact": mean, "within": (step, gap) | None, "points": [(gap, tv,
  deficit)], "trial_points": [(gap, accuracy)]}}}``: means over trials at
  each checkpoint; ``within``: the first checkpoint from which every later
  one's mean accuracy is within :data:`WITHIN` of the exact backbone's;
  ``points``: per (trial, checkpoint), the accuracy below that trial's
  exact backbone (what the rank correlations read)."""
  out = {}
  models_seen = {}
  for r in lines:
    models_seen.setdefault(r.model, (r.hmm != "vanilla", r.num_states
                                     * max(r.memory_size, 1)))
  for tag in sorted(models_seen, key=models_seen.get):
    mine = [r for r in lines if r.model == tag]
    out[tag] = {}
    for method in sorted({r.method for r in mine}):
      ex = {r.trial: r.test_accuracy for r in mine
            if r.method == method and r.backbone == "exact"}
      tr = [r for r in mine if r.method == method
            and r.backbone == "transformer"]
      steps = sorted({r.step for r in tr})
      at = {s: [r for r in tr if r.step == s] for s in steps}
      mean = lambda f, s: float(np.mean([getattr(r, f) for r in at[s]]))
      d = {"steps": steps, "gap": [mean("ce_gap", s) for s in steps],
           "tv": [mean("tv", s) for s in steps],
           "acc": [mean("test_accuracy", s) for s in steps],
           "sd": [float(np.std([r.test_accuracy for r in at[s]]))
                  for s in steps],
           "exact": float(np.mean(list(ex.values()))) if ex else float("nan"),
           "points": [(r.ce_gap, r.tv, ex[r.trial] - r.test_accuracy)
                      for r in tr if r.trial in ex],
           "trial_points": [(r.ce_gap, r.test_accuracy) for r in tr]}
      close = [a >= d["exact"] - WITHIN for a in d["acc"]]
      first = next((i for i in range(len(steps)) if all(close[i:])), None)
      d["within"] = (None if first is None
                     else (steps[first], d["gap"][first]))
      out[tag][method] = d
  return out


def _pct(x: float) -> str:
  return "" if np.isnan(x) else f"{100 * x:.1f}"


def markdown(summary: dict) -> str:
  """The tables of DIR/curve.md."""
  out = ["# Accuracy against pretraining quality", "",
         "Test accuracy (%), mean ± sd over trials, at each retained "
         "checkpoint with its mean held-out CE gap to the Bayes CE (nats) "
         "and TV at MASK; `exact` is the exact backbone (perfect "
         "pretraining) on the same tasks.", ""]
  for tag, methods in summary.items():
    names = list(methods)
    out += [f"## {tag}", "",
            "| step | CE gap | TV | " + " | ".join(names) + " |",
            "|---|---|---|" + "---|" * len(names)]
    first = methods[names[0]]
    for i, step in enumerate(first["steps"]):
      cells = [f"{_pct(methods[n]['acc'][i])} ± {_pct(methods[n]['sd'][i])}"
               if i < len(methods[n]["acc"]) else "" for n in names]
      out.append(f"| {step} | {first['gap'][i]:.4f} | {first['tv'][i]:.4f} "
                 f"| " + " | ".join(cells) + " |")
    out.append("| exact | 0 | 0 | " + " | ".join(
        _pct(methods[n]["exact"]) for n in names) + " |")
    out.append("")
  out += ["## Summary", "",
          f"Within {100 * WITHIN:.0f} points: the first checkpoint from "
          f"which the mean accuracy stays within {100 * WITHIN:.0f} points "
          f"of the exact backbone's (its step and mean CE gap). Spearman "
          f"ρ: over every (trial, checkpoint), the accuracy below the "
          f"trial's exact backbone (the deficit) against the CE gap and "
          f"against TV. Per decade: the least-squares slope of the deficit "
          f"(points) against log10 of the gap.", "",
          "| model | method | within (step, gap) | ρ(deficit, gap) | "
          "ρ(deficit, TV) | per decade |", "|---|---|---|---|---|---|"]
  pooled = {}
  for tag, methods in summary.items():
    for name, d in methods.items():
      pts = np.asarray(d["points"]).reshape(-1, 3)
      pooled.setdefault(name.split("_")[0], []).append(pts)
      w = ("never" if d["within"] is None
           else f"{d['within'][0]}, {d['within'][1]:.4f}")
      out.append(f"| {tag} | {name} | {w} | "
                 f"{_spearman(pts[:, 0], pts[:, 2]):.2f} | "
                 f"{_spearman(pts[:, 1], pts[:, 2]):.2f} | "
                 f"{_per_decade(pts[:, 0], pts[:, 2]):.1f} |")
  for method, parts in pooled.items():
    pts = np.concatenate(parts)
    out.append(f"| all | {method} | | {_spearman(pts[:, 0], pts[:, 2]):.2f} "
               f"| {_spearman(pts[:, 1], pts[:, 2]):.2f} | "
               f"{_per_decade(pts[:, 0], pts[:, 2]):.1f} |")
  return "\n".join(out) + "\n"


def write_plot(summary: dict, path: str) -> None:
  """Test accuracy against CE gap (log x), one panel per model: head and
  prompt tuning over the checkpoints (means; each trial a faint dot), the
  exact backbone as horizontal lines in the same colours."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, len(summary), figsize=(4 * len(summary), 3.8),
                           squeeze=False)
  for ax, (tag, methods) in zip(axes[0], summary.items()):
    for i, (name, d) in enumerate(methods.items()):
      color = f"C{i}"
      gaps = np.maximum(d["gap"], GAP_FLOOR)
      ax.plot(gaps, 100 * np.asarray(d["acc"]), "-o", color=color,
              label=name.replace("_", " "))
      if d["trial_points"]:
        gap_t, acc_t = np.asarray(d["trial_points"]).T
        ax.scatter(np.maximum(gap_t, GAP_FLOOR), 100 * acc_t, s=8,
                   color=color, alpha=0.3)
      for gap, step, acc in zip(gaps, d["steps"], d["acc"]):
        ax.annotate(str(step), (gap, 100 * acc), fontsize=6, alpha=0.6,
                    textcoords="offset points", xytext=(2, 3))
      ax.axhline(100 * d["exact"], color=color, linestyle="--", alpha=0.7,
                 label=f"exact: {name.replace('_', ' ')}")
    ax.set_xscale("log")
    ax.set_xlabel("held-out CE gap to Bayes (nats)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(tag)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  results_lib.atomic_write_png(path, fig, dpi=110)


def report(workdir: str) -> str:
  """Writes DIR/curve.md and DIR/curve.png from DIR/curve.jsonl; returns
  the markdown."""
  summary = summarize(read_lines(workdir))
  text = markdown(summary)
  results_lib.atomic_write_text(os.path.join(workdir, "curve.md"), text)
  if summary:
    write_plot(summary, os.path.join(workdir, "curve.png"))
  return text


# ----------------------------------------------------------------------------
# The binary.

def _define_flags():
  """The binary's flags, defined only when it runs as ``__main__``: the
  module is a library too (tests import it beside other binaries whose
  ``--preset`` would clash in absl's global registry)."""
  return (flags.DEFINE_enum("preset", "cpu", list(PRESETS),
                            "config preset; --config.<path> overrides it"),
          config_flags.define(PRESETS["cpu"]()),
          flags.DEFINE_string("workdir", None, "output directory"))


def main(argv, preset_flag, config_flag, workdir_flag):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  host_memory.retain_freed_memory()  # XLA:CPU step temporaries
  workdir = workdir_flag.value
  if not workdir:
    raise app.UsageError("--workdir is required")
  try:
    setup = get_setup(preset_flag.value, config_flag.value())
    check_workdir(workdir, setup)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  t0 = time.perf_counter()
  run(setup, workdir)
  print(report(workdir))
  print(f"done in {time.perf_counter() - t0:.0f}s\n"
        f"results: {results_path(workdir)}\n"
        f"table:   {os.path.join(workdir, 'curve.md')}\n"
        f"plot:    {os.path.join(workdir, 'curve.png')}")


if __name__ == "__main__":
  _preset, _config, _workdir = _define_flags()
  app.run(functools.partial(main, preset_flag=_preset, config_flag=_config,
                            workdir_flag=_workdir))
