"""The sweep: models (a stack of trials per size: HMM draws, one
pretraining each, in one stacked run), groups (one tuning arm on one size,
all its trials x tasks in one vmapped program), cells (one task of one
trial of a group = one :class:`records.ResultLine`).

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

  @property
  def method_name(self) -> str:
    return f"{self.method}_{self.head}"


def groups(setup: configs.Setup, panel: str,
           backbone: str = "exact") -> list[Group]:
  """All groups, those of one model adjacent, models by increasing size."""
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
      for f in setup.features:
        out.append(Group("right", ModelId("vanilla", syntax * m, 0), "head",
                         "linear", f))
  order = {mid: i for i, mid in enumerate(model_ids(out))}
  return sorted(out, key=lambda g: order[g.model_id])  # stable


def model_ids(group_list) -> list[ModelId]:
  """Distinct models of ``group_list``: vanilla then memory, by size."""
  ids = {g.model_id for g in group_list}
  return sorted(ids, key=lambda m: (m.hmm != "vanilla", m.size))


def uses(setup: configs.Setup, mid: ModelId) -> list[str]:
  """The panels that tune on ``mid``'s HMMs."""
  out = []
  if mid.hmm == "vanilla" and mid.num_states in setup.left_sizes:
    out.append("left")
  syntax = configs.MEMORY_SYNTAX_STATES
  if (mid.hmm == "memory" or mid.num_states in
      {syntax * m for m in setup.memory_sizes}):
    out.append("right")
  return out


def stack_size(setup: configs.Setup, mid: ModelId) -> int:
  """Trials drawn (and pretrained) for ``mid``: the most any panel reads,
  whichever panels this run does, so a stack never changes size."""
  return max(setup.panel_trials(p) for p in uses(setup, mid))


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
      {"pretrain": setup.pretrain.to_json(), "seed": setup.seed,
       "model_keys": configs.MODEL_KEYS_VERSION,
       "state_layout": _PRETRAIN_DIR_VERSION}, sort_keys=True).encode()
                      ).hexdigest()[:8]
  return os.path.join(workdir, "pretrain", f"{mid.tag}-{fp}")


def pretrained_backbones(workdir: str, setup: configs.Setup, mid: ModelId,
                         models_k: models.Model):
  """Pretrains (or reuses) the transformers of ``mid``'s trials, stacked.

  Returns ``(backbone, params_K, qualities)``; ``qualities[k]`` holds the
  ``pretrain_*`` fields of trial ``k``'s result lines.
  """
  pdir = pretrain_dir(workdir, setup, mid)
  logging.info("pretraining %d trials of %s in %s",
               models.num_trials(models_k), mid.tag, pdir)
  pretrain_lib.run_trials(pdir, setup.pretrain, models_k, log=logging.info)
  bb, params, infos = pretrain_lib.load_trials(pdir)
  qualities = []
  for info in infos:
    m = info["metrics"]
    qualities.append({
        "pretrain_ce_gap": m.get("ce_gap"), "pretrain_tv": m.get("tv"),
        "pretrain_mlm_ce": m.get("mlm_ce"),
        "pretrain_bayes_ce": m.get("bayes_ce"),
        "pretrain_steps": info["step"], "pretrain_wall_s": m.get("wall_s")})
  return bb, params, qualities


def backbones_for(workdir, setup, mid, models_k, backbone_name):
  """``(backbone, params_K, qualities)`` of ``mid``'s trials."""
  if backbone_name == "transformer":
    return pretrained_backbones(workdir, setup, mid, models_k)
  bb, _ = exact.make(models.trial(models_k, 0))
  return (bb, jax.vmap(models.as_hmm)(models_k),
          [{}] * models.num_trials(models_k))


class _Stack:
  """One size's trials: models, fingerprints, backbones, tasks (made on
  first use, all trials of a task index in one vmapped draw)."""

  def __init__(self, workdir, setup, mid, backbone_name):
    self.setup, self.mid = setup, mid
    self.models = make_models(setup, mid)
    self.fingerprints = models.fingerprints(self.models)
    self.backbone = backbones_for(workdir, setup, mid, self.models,
                                  backbone_name)
    self._tasks = {}  # task index -> [(Task, verdicts)] by trial

  def task(self, trial: int, task: int):
    if task not in self._tasks:
      keys = [task_key(self.setup, self.mid, k, task)
              for k in range(len(self.fingerprints))]
      drawn = tasks_lib.make_tasks(np.stack(keys), self.models,
                                   self.setup.task)
      self._tasks[task] = [
          (t, theory.verdicts(models.trial(self.models, k), t.mu))
          for k, t in enumerate(drawn)]
    return self._tasks[task][trial]


def _tune_group(setup, g: Group, cells, stack: _Stack):
  """Tunes one group's ``cells`` (``(trial, task)`` pairs) in one program
  (the rectangle of their trials x tasks); returns their fields."""
  trials = sorted({k for k, _ in cells})
  task_ids = sorted({s for _, s in cells})
  bb, params_k, qualities = stack.backbone
  cfg = dataclasses.replace(setup.tune, method=g.method, head=g.head,
                            features=g.features)
  datas = [[tuning.data_from_task(stack.task(k, s)[0], cfg)
            for s in task_ids] for k in trials]
  keys = [[tune_key(setup, k, s) for s in task_ids] for k in trials]
  if trials != list(range(len(stack.fingerprints))):
    idx = np.asarray(trials)
    params_k = jax.tree.map(lambda x: x[idx], params_k)
  recs, _ = tuning.tune_trials(keys, bb, params_k, datas, cfg)
  out = []
  for i, k in enumerate(trials):
    for j, s in enumerate(task_ids):
      if (k, s) not in cells:
        continue
      rec, (task, verdicts) = recs[i][j], stack.task(k, s)
      out.append(dict(
          trial=k, task=s, hmm_fingerprint=stack.fingerprints[k],
          size=g.model_id.size, test_accuracy=rec["test_accuracy"],
          val_accuracy=rec["val_accuracy"],
          train_accuracy=rec["train_accuracy"],
          final_loss=rec["final_loss"], steps=rec["steps"],
          seconds=rec["seconds"], task_redraws=task.redraws,
          assumptions=verdicts, tune_config=rec["config"],
          task_config=dataclasses.asdict(setup.task), **qualities[k]))
  return out


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


def run(setup: configs.Setup, workdir: str, panel: str, backbone_name: str,
        num_tasks: int = 1, task_index: int = 0,
        pretrain_only: bool = False) -> None:
  """Runs this host's share of the sweep (whole sizes: a stack of trials
  per host); finished lines are skipped.

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
  fp = setup.fingerprint(backbone_name)
  all_groups = groups(setup, panel, backbone_name)
  mine = {mid for i, mid in enumerate(model_ids(all_groups))
          if i % num_tasks == task_index}
  todo = [g for g in all_groups if g.model_id in mine]
  cells_of = lambda g: setup.panel_trials(g.panel) * setup.tasks_per_hmm
  total_cells, finished_cells = sum(cells_of(g) for g in todo), 0
  t_start = time.perf_counter()
  stack = None  # groups of one size are adjacent: one stack in memory
  for gi, g in enumerate(todo):
    mid = g.model_id
    base = dict(backbone=backbone_name, panel=g.panel, hmm=mid.hmm,
                num_states=mid.num_states, memory_size=mid.memory_size,
                method=g.method_name, features=g.features, setup=fp)
    cells = {(k, s) for k in range(setup.panel_trials(g.panel))
             for s in range(setup.tasks_per_hmm)
             if records.line_key({**base, "trial": k, "task": s}) not in done}
    if not cells and not pretrain_only:
      finished_cells += cells_of(g)
      continue
    if stack is None or stack.mid != mid:
      stack = None
      stack = _Stack(workdir, setup, mid, backbone_name)
    if pretrain_only:
      continue
    lines = [records.ResultLine(**base, **fields)
             for fields in _tune_group(setup, g, cells, stack)]
    records.append(path, lines)
    diverged = [(r.trial, r.task) for r in lines
                if not np.isfinite(r.final_loss)]
    if diverged:
      logging.warning("%s %s: tuning loss non-finite for (trial, task) %s",
                      mid.tag, g.method_name, diverged)
    finished_cells += cells_of(g)
    elapsed = time.perf_counter() - t_start
    eta = elapsed / max(finished_cells, 1) * (total_cells - finished_cells)
    accs = [line.test_accuracy for line in lines]
    logging.info(
        "[%d/%d groups] %s %s %s |H|=%d |M|=%d %s/%s: test acc %.3f +- %.3f "
        "over %d trials x tasks (%.1fs); elapsed %.0fs, ETA %.0fs", gi + 1,
        len(todo), backbone_name, g.panel, mid.hmm, mid.num_states,
        mid.memory_size, g.method_name, g.features, np.mean(accs),
        np.std(accs), len(lines), lines[0].seconds, elapsed, eta)
