"""The sweep: models (one pretraining each), groups (one tuning arm on one
model, all seeds in one vmapped program), cells (one seed of a group = one
:class:`records.ResultLine`).

Random streams, all from ``PRNGKey(setup.seed)`` (:func:`model_key`,
:func:`task_key`, :func:`tune_key`): a vanilla HMM depends only on its size,
so both panels share it (and its pretrained transformer).
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
# train-state layout is restored (2: TrainState dataclass, was a dict).
_PRETRAIN_DIR_VERSION = 2


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
  """One HMM and one tuning arm, run for all seeds at once."""

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


def model_key(setup: configs.Setup, mid: ModelId):
  offset = MEMORY_MODEL_STREAM if mid.hmm == "memory" else 0
  return jax.random.fold_in(jax.random.PRNGKey(setup.seed), mid.size + offset)


def task_key(setup: configs.Setup, mid: ModelId, seed: int):
  return jax.random.fold_in(model_key(setup, mid), TASK_STREAM + seed)


def tune_key(setup: configs.Setup, seed: int):
  """Head / prompt initialisation and batch order of task ``seed``."""
  return jax.random.fold_in(jax.random.PRNGKey(setup.seed + 1), seed)


def make_model(setup: configs.Setup, mid: ModelId) -> models.Model:
  return models.random_model(model_key(setup, mid), mid.hmm, mid.num_states,
                             configs.VOCAB, mid.memory_size)


def pretrain_dir(workdir: str, setup: configs.Setup, mid: ModelId) -> str:
  fp = hashlib.sha256(json.dumps(
      {"pretrain": setup.pretrain.to_json(), "seed": setup.seed,
       "model_keys": configs.MODEL_KEYS_VERSION,
       "state_layout": _PRETRAIN_DIR_VERSION}, sort_keys=True).encode()
                      ).hexdigest()[:8]
  return os.path.join(workdir, "pretrain", f"{mid.tag}-{fp}")


def pretrained_backbone(workdir: str, setup: configs.Setup, mid: ModelId,
                        model: models.Model):
  """Pretrains (or reuses) the transformer for ``model``.

  Returns ``(backbone, params, quality)``; ``quality`` holds the
  ``pretrain_*`` fields of a result line.
  """
  pdir = pretrain_dir(workdir, setup, mid)
  logging.info("pretraining on %s in %s", mid.tag, pdir)
  pretrain_lib.run(pdir, setup.pretrain, model, log=logging.info)
  bb, params, info = pretrain_lib.load_backbone(pdir)
  m = info["metrics"]
  quality = {"pretrain_ce_gap": m.get("ce_gap"), "pretrain_tv": m.get("tv"),
             "pretrain_mlm_ce": m.get("mlm_ce"),
             "pretrain_bayes_ce": m.get("bayes_ce"),
             "pretrain_steps": info["step"],
             "pretrain_wall_s": m.get("wall_s")}
  return bb, params, quality


def backbone_for(workdir, setup, mid, model, backbone_name):
  """``(backbone, params, quality)`` of one model."""
  if backbone_name == "transformer":
    return pretrained_backbone(workdir, setup, mid, model)
  return (*exact.make(model), {})


def _tune_group(setup, g: Group, seeds, model, task_cache, bb_params):
  """Tunes one group's ``seeds`` in one program; returns result lines."""
  bb, bp, quality = bb_params
  for s in seeds:
    if s not in task_cache:
      task = tasks_lib.make_task(task_key(setup, g.model_id, s), model,
                                 setup.task)
      task_cache[s] = (task, theory.verdicts(model, task.mu))
  cfg = dataclasses.replace(setup.tune, method=g.method, head=g.head,
                            features=g.features)
  datas = [tuning.data_from_task(task_cache[s][0], cfg) for s in seeds]
  keys = [tune_key(setup, s) for s in seeds]
  recs, _ = tuning.tune_many(keys, bb, bp, datas, cfg)
  return [
      dict(seed=s, size=g.model_id.size,
           test_accuracy=rec["test_accuracy"],
           val_accuracy=rec["val_accuracy"],
           train_accuracy=rec["train_accuracy"],
           final_loss=rec["final_loss"], steps=rec["steps"],
           seconds=rec["seconds"], task_redraws=task_cache[s][0].redraws,
           assumptions=task_cache[s][1], tune_config=rec["config"],
           task_config=dataclasses.asdict(setup.task), **quality)
      for s, rec in zip(seeds, recs)]


def run(setup: configs.Setup, workdir: str, panel: str, backbone_name: str,
        num_tasks: int = 1, task_index: int = 0,
        pretrain_only: bool = False) -> None:
  """Runs this host's share of the sweep; finished lines are skipped.

  Raises:
    ValueError: a bad backbone, panel or shard, or (transformer) inputs
      longer than the pretrained context.
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
  path = records.results_path(workdir, num_tasks, task_index)
  done = {line.key() for line in records.read_results(workdir)}
  fp = setup.fingerprint(backbone_name)
  all_groups = groups(setup, panel, backbone_name)
  mine = {mid for i, mid in enumerate(model_ids(all_groups))
          if i % num_tasks == task_index}
  todo = [g for g in all_groups if g.model_id in mine]
  total_cells, finished_cells = len(todo) * setup.seeds, 0
  t_start = time.perf_counter()
  cache = {}  # model_id -> (model, tasks by seed, backbone)
  for gi, g in enumerate(todo):
    mid = g.model_id
    base = dict(backbone=backbone_name, panel=g.panel, hmm=mid.hmm,
                num_states=mid.num_states, memory_size=mid.memory_size,
                method=g.method_name, features=g.features, setup=fp)
    seeds = [s for s in range(setup.seeds)
             if records.line_key({**base, "seed": s}) not in done]
    if not seeds and not pretrain_only:
      finished_cells += setup.seeds
      continue
    if mid not in cache:
      cache.clear()  # groups of one model are adjacent; keep memory flat
      model = make_model(setup, mid)
      cache[mid] = (model, {}, backbone_for(workdir, setup, mid, model,
                                            backbone_name))
    if pretrain_only:
      continue
    model, task_cache, bb_params = cache[mid]
    lines = [records.ResultLine(**base, **fields) for fields in
             _tune_group(setup, g, seeds, model, task_cache, bb_params)]
    records.append(path, lines)
    finished_cells += setup.seeds
    elapsed = time.perf_counter() - t_start
    eta = elapsed / max(finished_cells, 1) * (total_cells - finished_cells)
    accs = [line.test_accuracy for line in lines]
    logging.info(
        "[%d/%d groups] %s %s %s |H|=%d |M|=%d %s/%s: test acc %.3f +- %.3f "
        "over %d seeds (%.1fs); elapsed %.0fs, ETA %.0fs", gi + 1, len(todo),
        backbone_name, g.panel, mid.hmm, mid.num_states, mid.memory_size,
        g.method_name, g.features, np.mean(accs), np.std(accs), len(seeds),
        lines[0].seconds, elapsed, eta)
