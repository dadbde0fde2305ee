"""The sweep: :func:`run_sweep`, by model, draws and pretrains its stack of
trials, then tunes each of its :func:`configs.plan` groups (one tuning arm)
in one program, a :class:`schema.ResultLine` per missing cell. Both panels
share a vanilla HMM and its transformer."""

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import numpy as np

from hmmprompt import protocol
from hmmprompt import scheduling
from hmmprompt.protocol import ModelId
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import schema
from hmmprompt import generative
from hmmprompt import files as files_lib
from hmmprompt import identity as identity_lib
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import tuning
from hmmprompt import validation
from hmmprompt.backbones import Backbone
from hmmprompt.backbones import depth as depth_lib
from hmmprompt.backbones import exact
from hmmprompt.backbones import transformer

BACKBONES = protocol.BACKBONES
STAMP = "sweep.json"


def backbones(workdir: str, setup: configs.Setup, mid: ModelId,
              models_K: generative.Model, backbone_name: str,
              checkpoints: str = "always", stop_at: float | None = None,
              part: range | None = None, keep_by: float | None = None):
  """``(backbone, params_K, pretrain_K, configs_K, shallow)`` of ``mid``'s
  trials (``models_K``: the stack's ``part``; :func:`protocol.pretrained`):
  ``params_K`` padded to the deepest, row ``k``'s ``pretrain_*`` fields and
  own config (``{}``, ``None``: exact), the backbone of each shallower
  depth; in tuning dtype."""
  if backbone_name == "transformer":
    _, params_K, infos = protocol.pretrained(workdir, setup, mid, models_K,
                                             checkpoints, stop_at, part,
                                             keep_by=keep_by)
    configs_K = [info.config.model for info in infos]
    deepest = max(configs_K, key=lambda m: m.num_layers)
    dtype = setup.tune.backbone_dtype  # the loaded backbone's when float32
    where = {} if part is None else {"pretrain_part": [part.start, part.stop]}
    return (transformer.make_backbone(deepest, dtype), params_K,
            [{**protocol.pretrain_fields(info), **where} for info in infos],
            configs_K,
            {m.num_layers: transformer.make_backbone(m, dtype)
             for m in configs_K if m.num_layers != deepest.num_layers})
  backbone, hmms_K = exact.make_stacked(models_K)
  num = len(hmms_K.initial)
  return backbone, hmms_K, [{}] * num, [None] * num, {}


class Trials(NamedTuple):
  """One :class:`ModelId`'s stack of K trials, ready to tune."""

  stack: protocol.Stack
  backbone: Backbone  # the deepest trials' (the padded stack's)
  params_K: Any  # the backbone params, stacked [K, ...]
  pretrain: list[dict]  # [K] the pretrain_* fields of the trial's lines
  mlm_configs: list[transformer.MLMConfig | None]  # [K] own (None: exact)
  shallow: dict[int, Backbone]  # depth -> backbone, below the deepest

  def by_depth(self, trial_ids: list[int]
               ) -> list[tuple[Backbone, Any, list[int]]]:
    """``(backbone, params_G, ids)`` per depth among ``trial_ids``: each
    trial tuned at its own depth, not padded (a deeper backward)."""
    depths = [0 if m is None else m.num_layers for m in self.mlm_configs]
    out = []
    for d in sorted({depths[k] for k in trial_ids}):
      ids = [k for k in trial_ids if depths[k] == d]
      params = self.params_K
      if ids != list(range(len(depths))):
        params = jax.tree.map(lambda x, ids=ids: x[np.asarray(ids)], params)
      if d != max(depths):  # shallow models inside a padded stack
        params = depth_lib.take_layers(params, d)
      out.append((self.backbone if d == max(depths) else self.shallow[d],
                  params, ids))
    return out


def tune_group(setup: configs.Setup, backbone_name: str, g: configs.Group,
               trials: Trials, cells) -> list[schema.ResultLine]:
  """Tunes ``g``'s ``cells`` (``(trial, task)`` pairs, trials of ``trials``'
  rows) in one program (their trials x tasks) per depth; returns their lines."""
  first = trials.stack.first
  rows = sorted({k - first for k, _ in cells})
  task_ids = sorted({s for _, s in cells})
  cfg = g.tune_config(setup.tune)
  fields: dict[int, list[dict]] = {}
  for backbone, params, ids in trials.by_depth(rows):
    count = tuning.num_trainable(
        backbone, jax.tree.map(lambda x: x[0], params), cfg,
        tuning.data_from_task(trials.stack.tasks[ids[0]][task_ids[0]],
                              cfg).train_tokens)
    fields.update(zip(ids, ([{**f, "trainable_params": count} for f in lane]
                            for lane in protocol.tune_lanes(
        setup, cfg, backbone, params, [(first + i, task_ids) for i in ids],
        trials.stack))))
  fp, mid = setup.fingerprint(backbone_name), g.model_id
  if (verdicts := trials.stack.verdicts) is None:  # prepare draws them
    raise ValueError(f"{mid}: the stack has no assumption verdicts")
  return [schema.ResultLine(
      backbone=backbone_name, panel=g.panel, hmm=mid.hmm,
      num_states=mid.num_states, memory_size=mid.memory_size,
      trial=first + i, task=s, method=g.method_name, features=g.features,
      setup=fp, hmm_fingerprint=trials.stack.fingerprints[i], size=mid.size,
      **fields[i][j], task_redraws=trials.stack.tasks[i][s].redraws,
      assumptions=verdicts[i][s], tune_config=dataclasses.asdict(cfg),
      task_config=dataclasses.asdict(setup.task), **trials.pretrain[i])
          for i in rows for j, s in enumerate(task_ids)
          if (first + i, s) in cells]


def check_workdir(workdir: str, setup: configs.Setup,
                  write: bool = True) -> None:
  """Stamps ``DIR/sweep.json`` with :meth:`configs.Setup.identity` on first
  use (``write``; :func:`stamp`); ``ValueError`` where its stamp or result
  lines are another setup's (what differs named where the stamp says)."""
  identity, defaults = setup.identity(), identity_lib.added_defaults(setup)
  mine = {configs.fingerprint_of(identity, b) for b in BACKBONES}
  others = sorted({r.setup for r in schema.read_results(workdir)} - mine)
  # With others, the stamp names what differs; the digits alone do not.
  if not others or os.path.exists(os.path.join(workdir, STAMP)):
    stamp(workdir, identity, write and not others, defaults)
  if others:
    raise ValueError(
        f"{workdir} holds result lines of setup {others}, this run's are "
        f"{sorted(mine)} (a changed task, tuning, pretraining or seed "
        f"number): use a new --workdir for the new setup")


def stamp(workdir: str, identity: dict, write: bool = True,
          defaults: dict | None = None) -> None:
  """:func:`files.stamp` of ``DIR/sweep.json`` (``defaults`` as its),
  written by process 0 only; an earlier stamp of the trial counts alone is
  compared on those and, where they agree, upgraded."""
  path = os.path.join(workdir, STAMP)
  write = write and jax.process_index() == 0
  if os.path.exists(path):
    with open(path) as f:
      had = json.load(f)
    if set(had) == {"trials", "right_trials"}:  # the earlier version's
      files_lib.stamp(path, {k: identity[k] for k in had}, "setup", write=False)
      if not write:
        return
      os.remove(path)  # upgraded below
  files_lib.stamp(path, identity, "setup", write=write, defaults=defaults)


def missing_cells(setup: configs.Setup, workdir: str, panel: str,
                  backbone_name: str,
                  by_model: dict[ModelId, list[configs.Group]] | None = None
                  ) -> dict[ModelId, dict[configs.Group, set]]:
  """:func:`protocol.missing` of ``workdir``'s lines over :func:`plan`'s
  models (or ``by_model``), cells ``(trial, task)``."""
  fp = setup.fingerprint(backbone_name)
  if by_model is None:
    by_model = configs.plan(setup, panel, backbone_name)
  return protocol.missing(
      by_model, {line.key() for line in schema.read_results(workdir)},
      lambda g: {(k, s): (backbone_name, g.panel, g.model_id.hmm,
                          g.model_id.num_states, g.model_id.memory_size, k,
                          s, g.method_name, g.features, fp)
                 for k in range(setup.panel_trials(g.panel))
                 for s in range(setup.tasks_per_hmm)})


def _start(setup: configs.Setup, workdir: str, panel: str,
           backbone_name: str, schedule: scheduling.Schedule):
  """The checks, the plan and the stamped workdir: ``(by_model, sizes)``."""
  validation.one_of("backbone", backbone_name, BACKBONES)
  if panel not in ("left", "right", "both"):
    raise ValueError(f"panel must be left, right or both, got {panel!r}")
  schedule.check()
  if backbone_name == "transformer":
    setup.check_context()
  os.makedirs(workdir, exist_ok=True)
  check_workdir(workdir, setup)
  return configs.plan(setup, panel, backbone_name), configs.stack_sizes(setup)


def pretrain_sweep(setup: configs.Setup, workdir: str, panel: str,
                   schedule: scheduling.Schedule = scheduling.EVERYTHING
                   ) -> None:
  """Pretrains this process's share of the sweep's transformer stacks
  (``schedule``) and tunes nothing; ``ValueError`` as :func:`run_sweep`."""
  by_model, sizes = _start(setup, workdir, panel, "transformer", schedule)
  for mid in protocol.stack_order(by_model, schedule, sizes.__getitem__):
    if schedule.claim is None or schedule.claim(mid):
      protocol.pretrain(workdir, setup, mid,
                        protocol.make_models(setup, mid, sizes[mid]))


def run_sweep(setup: configs.Setup, workdir: str, panel: str,
              backbone_name: str,
              schedule: scheduling.Schedule = scheduling.EVERYTHING,
              results_file: str | None = None,
              checkpoints: str = "always") -> list[str]:
  """Runs this process's share of the sweep's stacks (``schedule``, a
  stack's weight the trials it pretrains; under ``stop_at`` a transformer
  stack that does not fit runs in part: :class:`Parts`), skipping finished
  lines, into ``results_file`` (default: the host shard's); ``checkpoints``:
  :data:`pretrain.CHECKPOINTS`. Returns and raises as
  :func:`protocol.run_stacks`; ``ValueError`` for a bad backbone, panel,
  shard or ``checkpoints``, a workdir of another setup, or (transformer)
  inputs longer than the pretrained context."""
  pretrain_lib.check_checkpoints(checkpoints)
  by_model, sizes = _start(setup, workdir, panel, backbone_name, schedule)
  todo = missing_cells(setup, workdir, panel, backbone_name, by_model)
  parts = Parts(setup, workdir, sizes, todo, backbone_name)

  def prepare(mid: ModelId, groups: dict) -> Trials:
    """``mid``'s trials (:meth:`Parts.of` ``groups``), tasks, backbones."""
    part = parts.of(mid, groups)
    stack = protocol.draw_stack(setup, mid, sizes[mid], setup.tasks_per_hmm,
                                verdicts=True, part=part)
    tune_s = schedule.tune_seconds_per_trial
    keep_by = (None if schedule.stop_at is None or tune_s is None
               else schedule.stop_at - tune_s * len(stack.tasks))
    return Trials(stack, *backbones(workdir, setup, mid, stack.models_K,
                                    backbone_name, checkpoints,
                                    schedule.stop_at, part, keep_by))

  def tune(g: configs.Group, trials: Trials) -> list[schema.ResultLine]:
    rows = range(trials.stack.first,
                 trials.stack.first + len(trials.stack.tasks))
    return tune_group(setup, backbone_name, g, trials, {
        c for c in todo[g.model_id][g] if c[0] in rows})

  return protocol.run_stacks(todo, prepare, tune, results_file or (
      schema.results_path(workdir, schedule.num_hosts, schedule.host_index)),
      schedule, weight=parts.weight, split=parts.split)


class Parts(NamedTuple):
  """Which trials of a stack a run pretrains: the whole stack, as always,
  unless its missing cells lie in a part of it (a run cut short for time
  landed the rest) and no run of the whole stack is in the workdir; and
  the part that fits a deadline (:meth:`split`)."""

  setup: configs.Setup
  workdir: str
  sizes: dict[ModelId, int]
  todo: dict[ModelId, dict[configs.Group, set]]
  backbone_name: str

  def of(self, mid: ModelId, groups: dict) -> range | None:
    """The trials that ``groups``' cells need pretrained: ``None`` for the
    whole stack, else ``range(first, last + 1)`` of their trials."""
    trials = sorted({k for cells in groups.values() for k, _ in cells})
    if (self.backbone_name != "transformer" or not trials
        or os.path.isdir(protocol.pretrain_dir(self.workdir, self.setup, mid))):
      return None
    part = range(trials[0], trials[-1] + 1)
    return None if part == range(self.sizes[mid]) else part

  def weight(self, mid: ModelId) -> int:
    """The trials a run of ``mid``'s missing cells pretrains: where the workdir
    holds that run checkpointed (a deadline cut it), those it still trains."""
    part = self.of(mid, self.todo[mid])
    return self._resumed(mid, part,
                         self.sizes[mid] if part is None else len(part))

  def _resumed(self, mid: ModelId, part: range | None, trials: int) -> int:
    """``trials``, or the trials that the checkpointed run of ``part`` in
    the workdir still trains (at least 1: the stopped ones' tuning)."""
    if self.backbone_name != "transformer":
      return trials
    running = pretrain_lib.running_at_checkpoint(
        protocol.pretrain_dir(self.workdir, self.setup, mid, part))
    return trials if running is None else max(1, len(running))

  def split(self, mid: ModelId, fits: float) -> tuple[dict, int] | None:
    """``(groups, weight)`` of the first trials of ``mid``'s part (:meth:`of`)
    that ``fits`` trials' time takes, in whole groups of ``trials_per_vmap``,
    less one for a part's own draws and compiles; a part a kept workdir holds
    from the same first trial (cut short) is resumed where it fits, weighed by
    :meth:`weight`. ``None``: not one group fits, the workdir holds the whole
    stack's run, or the backbone is exact (its stacks run whole)."""
    if (self.backbone_name != "transformer" or os.path.isdir(
        protocol.pretrain_dir(self.workdir, self.setup, mid))):
      return None
    span = self.of(mid, self.todo[mid]) or range(self.sizes[mid])
    unit = max(1, self.setup.pretrain.trials_per_vmap)
    n = (int(fits) - unit) // unit * unit
    if n >= len(span):
      return None
    cut = lambda part: {g: cells for g, all_cells in self.todo[mid].items()
                        if (cells := {c for c in all_cells if c[0] in part})}
    for stop in range(span.stop - 1, span.start, -1):  # the longest first
      held = range(span.start, stop)
      if (os.path.isdir(protocol.pretrain_dir(self.workdir, self.setup, mid,
                                              held))
          and (weight := self._resumed(mid, held, len(held))) <= n):
        return cut(held), weight
    return None if n < unit else (cut(range(span.start, span.start + n)), n)
