"""The sweep, top to bottom: :func:`plan` lists the groups (one tuning arm
on one model size) by model; :func:`run` takes each model in turn, draws
its stack of trials (HMM draws), pretrains their backbones and draws their
tasks (:func:`prepare`), then tunes each group's missing cells, all its
trials x tasks in one vmapped program (:func:`tune_group`); a cell is one
task of one trial of a group, one :class:`records.ResultLine`.

Random streams, all from ``PRNGKey(setup.seed)``: :func:`model_key` roots a
size's stack, trial ``k`` is ``models.random_model(fold_in(root, k))``
(:func:`models.random_models`); :func:`task_key` and :func:`tune_key` are
per (trial, task). A vanilla HMM depends only on its size and trial, so
both panels share it (and its pretrained transformer).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any, NamedTuple

from absl import logging
import jax
import numpy as np

from experiments.figure3 import configs
from experiments.figure3 import records
from hmmprompt import models
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import results as results_lib
from hmmprompt import tasks as tasks_lib
from hmmprompt import theory
from hmmprompt import tuning
from hmmprompt.backbones import Backbone
from hmmprompt.backbones import exact

BACKBONES = ("exact", "transformer")
# Memory HMMs draw from their own stream: fold_in(root, size + this).
MEMORY_MODEL_STREAM = 1500
# Task s of a model: fold_in(model key, TASK_STREAM + s).
TASK_STREAM = 10_000
# A bump here moves every pretraining dir, so no checkpoint of another
# train-state layout is restored (2: TrainState dataclass, was a dict;
# 3: a stack of trials).
_PRETRAIN_DIR_VERSION = 3


@dataclasses.dataclass(frozen=True)
class ModelId:
  hmm: str  # "vanilla" | "memory"
  num_states: int  # |H| (vanilla) or syntax states (memory)
  memory_size: int  # 0 for vanilla

  @property
  def size(self) -> int:
    """x-axis: |H| (left) or |M||H| (right)."""
    return self.num_states * max(self.memory_size, 1)

  @property
  def tag(self) -> str:
    if self.hmm == "memory":
      return f"memory-h{self.num_states}-m{self.memory_size}"
    return f"vanilla-h{self.num_states}"


@dataclasses.dataclass(frozen=True)
class Group:
  """One size and one tuning arm, run for all its trials x tasks at once."""

  panel: str
  model_id: ModelId
  method: str  # "head" | "prompt" | "finetune"
  head: str  # "linear" | "attention"
  features: str
  optimizer: str = "adam"  # TuneConfig.optimizer: "adam" | "lbfgs"

  @property
  def method_name(self) -> str:
    """``<method>_<head>``, ``_<optimizer>`` appended unless Adam (so the
    paper's arms keep the keys their lines were written with)."""
    name = f"{self.method}_{self.head}"
    return name if self.optimizer == "adam" else f"{name}_{self.optimizer}"

  def key_fields(self, backbone: str, setup_fp: str, trial: int,
                 task: int) -> dict:
    """The key fields (``records.ResultLine.KEY_FIELDS``) of a cell."""
    mid = self.model_id
    return dict(backbone=backbone, panel=self.panel, hmm=mid.hmm,
                num_states=mid.num_states, memory_size=mid.memory_size,
                trial=trial, task=task, method=self.method_name,
                features=self.features, setup=setup_fp)


def plan(setup: configs.Setup, panel: str = "both",
         backbone: str = "exact") -> dict[ModelId, list[Group]]:
  """The groups of ``panel`` by model, models vanilla then memory by size
  (the order they run and are sharded in).

  Left: head and prompt tuning (and fine-tuning) with the linear head.
  Right: per ``|M|``, the memory HMM's attention head (and, with
  ``setup.prompt_attention``, prompt tuning with it: Theorem 4.6) and the
  vanilla twin's linear head. ``setup.head_optimum`` follows every
  linear-head tuning group with its L-BFGS twin (the convex problem; the
  attention head's is not, and L-BFGS on it cost minutes a group at the
  paper's sizes).
  """
  out = []
  if panel in ("left", "both"):
    methods = ["head", "prompt"]
    if setup.finetune and backbone == "transformer":
      methods.append("finetune")
    for h in setup.left_sizes:
      for method in methods:
        for f in setup.features:
          out.append(Group("left", ModelId("vanilla", h, 0), method,
                           "linear", f))
  if panel in ("right", "both"):
    syntax = configs.MEMORY_SYNTAX_STATES
    for m in setup.memory_sizes:
      for f in setup.features:
        out.append(Group("right", ModelId("memory", syntax, m), "head",
                         "attention", f))
      if setup.prompt_attention:
        for f in setup.features:
          out.append(Group("right", ModelId("memory", syntax, m), "prompt",
                           "attention", f))
      for f in setup.features:
        out.append(Group("right", ModelId("vanilla", syntax * m, 0), "head",
                         "linear", f))
  if setup.head_optimum:
    out = [twin for g in out for twin in (
        (g, dataclasses.replace(g, optimizer="lbfgs"))
        if g.method == "head" and g.head == "linear" else (g,))]
  by_model = {}
  for g in sorted(out, key=lambda g: (g.model_id.hmm != "vanilla",
                                      g.model_id.size)):  # stable
    by_model.setdefault(g.model_id, []).append(g)
  return by_model


def stack_size(setup: configs.Setup, mid: ModelId) -> int:
  """Trials drawn (and pretrained) for ``mid``: the most any panel reads,
  whichever panels this run does, so a stack never changes size."""
  return max(setup.panel_trials(g.panel) for g in plan(setup)[mid])


def model_key(setup: configs.Setup, mid: ModelId):
  """The root of ``mid``'s stack; trial ``k`` draws from ``fold_in(root,
  k)``."""
  offset = MEMORY_MODEL_STREAM if mid.hmm == "memory" else 0
  return jax.random.fold_in(jax.random.PRNGKey(setup.seed), mid.size + offset)


def task_key(setup: configs.Setup, mid: ModelId, trial: int, task: int):
  return jax.random.fold_in(jax.random.fold_in(model_key(setup, mid), trial),
                            TASK_STREAM + task)


def tune_key(setup: configs.Setup, trial: int, task: int):
  """Head / prompt initialisation and batch order of one cell."""
  return jax.random.fold_in(
      jax.random.fold_in(jax.random.PRNGKey(setup.seed + 1), trial), task)


def make_models(setup: configs.Setup, mid: ModelId) -> models.Model:
  """``mid``'s trials, stacked ``[K]``."""
  return models.random_models(model_key(setup, mid), stack_size(setup, mid),
                              mid.hmm, mid.num_states, configs.VOCAB,
                              mid.memory_size)


def pretrain_dir(workdir: str, setup: configs.Setup, mid: ModelId) -> str:
  fp = hashlib.sha256(json.dumps(
      {"pretrain": setup.pretrain.identity(), "seed": setup.seed,
       "model_keys": configs.MODEL_KEYS_VERSION,
       "state_layout": _PRETRAIN_DIR_VERSION}, sort_keys=True).encode()
                      ).hexdigest()[:8]
  return os.path.join(workdir, "pretrain", f"{mid.tag}-{fp}")


def backbones(workdir: str, setup: configs.Setup, mid: ModelId,
              models_K: models.Model, backbone_name: str):
  """``(backbone, params_K, pretrain_K)`` of ``mid``'s trials; a
  transformer is pretrained first (or reused, or resumed).

  ``params_K`` is stacked ``[K, ...]``; ``pretrain_K[k]`` holds the
  ``pretrain_*`` fields of trial ``k``'s result lines (none for exact).
  """
  if backbone_name == "exact":
    bb, _ = exact.make(models.trial(models_K, 0))
    return (bb, jax.vmap(models.as_hmm)(models_K),
            [{}] * models.num_trials(models_K))
  pdir = pretrain_dir(workdir, setup, mid)
  logging.info("pretraining %d trials of %s in %s",
               models.num_trials(models_K), mid.tag, pdir)
  pretrain_lib.run_trials(pdir, setup.pretrain, models_K, log=logging.info)
  bb, params_K, infos = pretrain_lib.load_trials(pdir)
  return bb, params_K, [pretrain_fields(info) for info in infos]


def pretrain_fields(info: dict) -> dict:
  """The ``pretrain_*`` fields of a result line from its trial's ``info``
  (:func:`pretrain.load_trials`)."""
  m = info["metrics"]
  return {"pretrain_ce_gap": m.get("ce_gap"), "pretrain_tv": m.get("tv"),
          "pretrain_mlm_ce": m.get("mlm_ce"),
          "pretrain_bayes_ce": m.get("bayes_ce"),
          "pretrain_steps": info["step"], "pretrain_wall_s": m.get("wall_s")}


class Trials(NamedTuple):
  """One model's stack of K trials, ready to tune (:func:`prepare`)."""

  fingerprints: list[str]  # [K] models.fingerprint of each HMM
  backbone: Backbone
  params_K: Any  # the backbone params, stacked [K, ...]
  pretrain: list[dict]  # [K] the pretrain_* fields of the trial's lines
  tasks: list[list[tuple]]  # [K][S] (tasks.Task, theory.verdicts)


def prepare(workdir: str, setup: configs.Setup, mid: ModelId,
            backbone_name: str) -> Trials:
  """Draws ``mid``'s trials, pretrains their backbones (transformer) and
  draws their tasks, each task index for all trials in one vmapped draw."""
  models_K = make_models(setup, mid)
  bb, params_K, pretrain = backbones(workdir, setup, mid, models_K,
                                     backbone_name)
  num = models.num_trials(models_K)
  by_task = [tasks_lib.make_tasks(
      np.stack([task_key(setup, mid, k, s) for k in range(num)]), models_K,
      setup.task, setup.task_memory_budget())
            for s in range(setup.tasks_per_hmm)]
  tasks = [[(t[k], theory.verdicts(models.trial(models_K, k), t[k].mu))
            for t in by_task] for k in range(num)]
  return Trials(models.fingerprints(models_K), bb, params_K, pretrain, tasks)


def tune_group(setup: configs.Setup, backbone_name: str, g: Group,
               trials: Trials, cells) -> list[records.ResultLine]:
  """Tunes ``g``'s ``cells`` (``(trial, task)`` pairs) in one program (the
  rectangle of their trials x tasks); returns their lines."""
  trial_ids = sorted({k for k, _ in cells})
  task_ids = sorted({s for _, s in cells})
  cfg = dataclasses.replace(setup.tune, method=g.method, head=g.head,
                            features=g.features, optimizer=g.optimizer)
  params_K = trials.params_K
  if trial_ids != list(range(len(trials.fingerprints))):
    params_K = jax.tree.map(lambda x: x[np.asarray(trial_ids)], params_K)
  res, _ = tuning.tune_trials(
      [[tune_key(setup, k, s) for s in task_ids] for k in trial_ids],
      trials.backbone, params_K,
      [[tuning.data_from_task(trials.tasks[k][s][0], cfg) for s in task_ids]
       for k in trial_ids], cfg, lane_group=setup.lane_group())
  setup_fp = setup.fingerprint(backbone_name)
  lines = []
  for i, k in enumerate(trial_ids):
    for j, s in enumerate(task_ids):
      if (k, s) not in cells:
        continue
      task, verdicts = trials.tasks[k][s]
      lines.append(records.ResultLine(
          **g.key_fields(backbone_name, setup_fp, k, s),
          hmm_fingerprint=trials.fingerprints[k], size=g.model_id.size,
          test_accuracy=float(res.test_accuracy[i, j]),
          val_accuracy=float(res.val_accuracy[i, j]),
          train_accuracy=float(res.train_accuracy[i, j]),
          final_loss=float(res.final_loss[i, j]),
          steps=int(res.lane_steps[i, j]),
          seconds=res.seconds, task_redraws=task.redraws,
          assumptions=verdicts, tune_config=dataclasses.asdict(cfg),
          task_config=dataclasses.asdict(setup.task), **trials.pretrain[k]))
  return lines


def check_workdir(workdir: str, setup: configs.Setup) -> None:
  """Records the trial counts in ``DIR/sweep.json`` on first use; a later
  run with other counts is refused (its stacks would be other sizes).

  Raises:
    ValueError: the workdir was made with other trial counts (named).
  """
  path = os.path.join(workdir, "sweep.json")
  want = setup.trial_counts()
  if os.path.exists(path):
    with open(path) as f:
      had = json.load(f)
    if had != want:
      raise ValueError(
          f"{workdir} was made with trial counts {had}, this run asks for "
          f"{want}: use a new --workdir (or the same counts) to resume")
    return
  if jax.process_index() == 0:
    results_lib.atomic_write_text(path, json.dumps(want))


def missing_cells(setup: configs.Setup, backbone_name: str, setup_fp: str,
                  g: Group, done: set) -> set[tuple[int, int]]:
  """``g``'s ``(trial, task)`` cells whose line key is not in ``done``."""
  return {(k, s) for k in range(setup.panel_trials(g.panel))
          for s in range(setup.tasks_per_hmm) if records.line_key(
              g.key_fields(backbone_name, setup_fp, k, s)) not in done}


def run(setup: configs.Setup, workdir: str, panel: str, backbone_name: str,
        num_tasks: int = 1, task_index: int = 0,
        pretrain_only: bool = False,
        deadline: float | None = None) -> list[str]:
  """Runs this host's share of the sweep (whole models: a stack of trials
  per host); finished lines are skipped.

  ``deadline`` (a ``time.monotonic()`` value) bounds a run on a machine
  lent for a fixed time (``experiments/accelerator.py``): no stack starts
  after it, and a stack started is finished, since its pretraining
  checkpoints live only in the workdir, which such a run does not keep (a
  stack cut short would be pretrained again from scratch).

  Returns:
    The tags of the stacks skipped for the deadline (``[]``: none).

  Raises:
    ValueError: a bad backbone, panel or shard, a workdir made with other
      trial counts, or (transformer) inputs longer than the pretrained
      context.
  """
  if backbone_name not in BACKBONES:
    raise ValueError(f"backbone must be one of {BACKBONES}, got "
                     f"{backbone_name!r}")
  if panel not in ("left", "right", "both"):
    raise ValueError(f"panel must be left, right or both, got {panel!r}")
  if num_tasks < 1 or not 0 <= task_index < num_tasks:
    raise ValueError(f"task_index {task_index} not in [0, {num_tasks})")
  if backbone_name == "transformer":
    setup.check_context()
  os.makedirs(workdir, exist_ok=True)
  check_workdir(workdir, setup)
  path = records.results_path(workdir, num_tasks, task_index)
  done = {line.key() for line in records.read_results(workdir)}
  setup_fp = setup.fingerprint(backbone_name)
  todo = {}  # {model: {group: its cells without a line}}, this host's models
  for i, (mid, groups) in enumerate(plan(setup, panel, backbone_name).items()):
    if i % num_tasks == task_index:
      todo[mid] = {g: cells for g in groups if (cells := missing_cells(
          setup, backbone_name, setup_fp, g, done))}
  left = sum(len(c) for cells_of in todo.values() for c in cells_of.values())
  tuned, t_start = 0, time.perf_counter()
  skipped = []  # [(stack tag, its missing cells)] not started: deadline
  for mid, cells_of in todo.items():
    if not (cells_of or pretrain_only):
      continue
    if deadline is not None and time.monotonic() >= deadline:
      skipped.append((mid.tag, sum(len(c) for c in cells_of.values())))
      continue
    if pretrain_only:
      backbones(workdir, setup, mid, make_models(setup, mid), backbone_name)
      continue
    trials = prepare(workdir, setup, mid, backbone_name)
    for g, cells in cells_of.items():
      lines = tune_group(setup, backbone_name, g, trials, cells)
      records.append(path, lines)
      diverged = [(r.trial, r.task) for r in lines
                  if not np.isfinite(r.final_loss)]
      if diverged:
        logging.warning("%s %s: tuning loss non-finite for (trial, task) %s",
                        mid.tag, g.method_name, diverged)
      tuned += len(lines)
      elapsed = time.perf_counter() - t_start
      accs = [line.test_accuracy for line in lines]
      logging.info(
          "[%d/%d cells] %s %s %s |H|=%d |M|=%d %s/%s: test acc %.3f +- "
          "%.3f over %d trials x tasks (%.1fs); elapsed %.0fs, ETA %.0fs",
          tuned, left, backbone_name, g.panel, mid.hmm, mid.num_states,
          mid.memory_size, g.method_name, g.features, np.mean(accs),
          np.std(accs), len(lines), lines[0].seconds, elapsed,
          elapsed / tuned * (left - tuned))
    del trials  # before the next model's stack is made: one in memory
  if skipped:
    logging.warning(
        "deadline passed: skipped %d stacks (%d cells): %s", len(skipped),
        sum(n for _, n in skipped),
        ", ".join(f"{tag} ({n} cells)" for tag, n in skipped))
  return [tag for tag, _ in skipped]
