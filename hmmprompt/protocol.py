"""The paper's experimental protocol, shared by Figure 3's sweep, the
pretraining curve and a user's own experiment (one seed, the same draws
everywhere): trials, stacks, lanes and the resume loop (:func:`run_stacks`)."""

import dataclasses
import math
import os
import time
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

from absl import logging
import jax
import numpy as np

from hmmprompt import identity as identity_lib
from hmmprompt import generative
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import files as files_lib
from hmmprompt import scheduling
from hmmprompt import tasks as tasks_lib
from hmmprompt import theory
from hmmprompt import tuning
from hmmprompt import validation

BACKBONES = ("exact", "transformer")
VOCAB = 10
MEMORY_SYNTAX_STATES = 4
# Bumped when the HMM of a (size, trial, seed) changes, so old lines are stale.
MODEL_KEYS_VERSION = 3
MEMORY_MODEL_STREAM = 1500  # memory HMMs' stream: fold_in(root, size + this)
TASK_STREAM = 10_000  # task s of a model: fold_in(model key, TASK_STREAM + s)
# A bump moves every pretraining dir: no other train-state layout is restored.
PRETRAIN_DIR_VERSION = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialsConfig:
  """The fields every experiment's config shares; ``tune``'s ``method`` and
  ``head`` (the sweep's ``features`` and ``optimizer`` too) are set per arm,
  and ``seed`` roots every random stream (:func:`model_key` and friends)."""

  trials: int  # HMM draws per size (each with its own backbone and tasks)
  memory_sizes: tuple[int, ...]  # |M| of the memory HMMs
  task: tasks_lib.TaskConfig
  tune: tuning.TuneConfig
  pretrain: pretrain_lib.PretrainConfig  # the transformer's (not ``exact``'s)
  seed: int = 0
  lanes_per_vmap: int | None = identity_lib.runtime(  # lanes tuned at a time
      None)  # (0: all; None: auto)
  task_budget_mb: int = identity_lib.runtime(  # a task draw's MiB (0: any)
      tasks_lib.TASK_BUDGET_BYTES >> 20)

  def _check(self, counts: Sequence[str], sizes: Sequence[str]) -> None:
    validation.require_ints(self, counts, 1, "a trial count < 1 runs nothing")
    validation.require_positive_ints(self, *sizes)
    validation.require_ints(self, ("lanes_per_vmap", "task_budget_mb"), 0,
                            "0: no bound")

  def lane_group(self) -> int | None:
    """``tuning.tune``'s ``lane_group`` (``None``: all lanes at once)."""
    return tuning.lane_group_for(self.lanes_per_vmap)

  def task_budget_bytes(self) -> int | None:
    """``tasks.make_tasks``' ``budget_bytes`` in bytes (``None``: none)."""
    return (self.task_budget_mb << 20) or None

  @property
  def input_len(self) -> int:
    """Positions of a prompt-tuning input: prompt, MASK, tokens."""
    return tasks_lib.input_len(self.tune.prompt_len, self.task.seq_len)

  def check_context(self) -> None:
    """``ValueError`` if a prompt-tuning input exceeds the context."""
    if self.input_len > (context := self.pretrain.model.max_len):
      raise ValueError(f"prompt_len + 1 + seq_len = {self.input_len} positions "
                       f"exceed the pretrained context of {context}; lower "
                       f"--config.task.seq_len or --config.tune.prompt_len")


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
    m = f"-m{self.memory_size}" if self.hmm == "memory" else ""
    return f"{self.hmm}-h{self.num_states}{m}"


def vanilla(num_states: int) -> ModelId:
  return ModelId("vanilla", num_states, 0)


def memory(memory_size: int) -> ModelId:
  return ModelId("memory", MEMORY_SYNTAX_STATES, memory_size)


@dataclasses.dataclass(frozen=True)
class Group:
  """One model size and one tuning arm: one program, one append."""

  model_id: ModelId
  method: str  # a key of tuning.METHODS
  head: str  # "linear" | "attention"
  features: str = "raw"
  optimizer: str = "adam"  # TuneConfig.optimizer: "adam" | "lbfgs"
  settings: tuple = ()  # ((TuneConfig field, value), ...): configs.parse_arm

  @property
  def method_name(self) -> str:
    """``<method>_<head>``, each setting's label (``_p5``, ``_tokens``,
    ``_r4``), ``_<optimizer>`` unless Adam."""
    name = "_".join([self.method, self.head, *(
        _LABELS.get(k, k + "{}").format(v) for k, v in self.settings)])
    return name if self.optimizer == "adam" else f"{name}_{self.optimizer}"

  def __str__(self) -> str:
    return f"{self.method_name} ({self.features})"

  def tune_config(self, tune: tuning.TuneConfig) -> tuning.TuneConfig:
    return dataclasses.replace(tune, method=self.method, head=self.head,
                               features=self.features, optimizer=self.optimizer,
                               **dict(self.settings))


_LABELS = {"prompt_len": "p{}", "prompt_init_mode": "{}", "lora_r": "r{}",
           "lora_alpha": "alpha{}", "lora_targets": "{}"}


def model_key(setup: TrialsConfig, mid: ModelId):
  """Root of ``mid``'s stack: trial ``k`` draws from ``fold_in(root, k)``."""
  offset = MEMORY_MODEL_STREAM if mid.hmm == "memory" else 0
  return jax.random.fold_in(jax.random.PRNGKey(setup.seed), mid.size + offset)


def task_key(setup: TrialsConfig, mid: ModelId, trial: int, task: int):
  return jax.random.fold_in(jax.random.fold_in(model_key(setup, mid), trial),
                            TASK_STREAM + task)


def tune_key(setup: TrialsConfig, trial: int, task: int):
  """Head / prompt initialisation and batch order of one cell."""
  return jax.random.fold_in(
      jax.random.fold_in(jax.random.PRNGKey(setup.seed + 1), trial), task)


def make_models(setup: TrialsConfig, mid: ModelId, num: int
                ) -> generative.Model:
  """``mid``'s first ``num`` trials, stacked ``[num]``."""
  return generative.random_models(model_key(setup, mid), num, mid.hmm,
                                  mid.num_states, VOCAB, mid.memory_size)


class Stack(NamedTuple):
  """:func:`draw_stack`'s trials of a size: row ``i`` is trial ``first + i``."""

  models_K: generative.Model  # stacked [K]
  fingerprints: list[str]  # [K] generative.model_fingerprint of each HMM
  tasks: list[list[tasks_lib.Task]]  # [K][S]
  verdicts: list[list[dict]] | None  # [K][S] theory.verdicts, if asked
  first: int = 0  # the trial of row 0 (a part of a stack: draw_stack)


def draw_stack(setup: TrialsConfig, mid: ModelId, num: int, num_tasks: int = 1,
               verdicts: bool = False, part: range | None = None) -> Stack:
  """``mid``'s ``num`` trials, ``num_tasks`` tasks each, verdicts if asked; with
  ``part`` (``range(a, b)``) only those rows, bit for bit the whole stack's."""
  rows = check_part(part, num) or range(num)  # checked before any draw
  keys_SxK = [np.asarray([task_key(setup, mid, k, s) for k in range(num)])
              for s in range(num_tasks)]
  models_K = make_models(setup, mid, num)
  by_task = [tasks_lib.make_tasks(keys_K, models_K, setup.task,
                                  setup.task_budget_bytes())
             for keys_K in keys_SxK]
  models_K = jax.tree.map(lambda x: x[rows.start:rows.stop], models_K)
  tasks = [[t[k] for t in by_task] for k in rows]
  checks = [[theory.verdicts(generative.trial(models_K, i), t.mu)
             for t in row] for i, row in enumerate(tasks)] if verdicts else None
  return Stack(models_K, generative.fingerprints(models_K), tasks, checks,
               rows.start)


def check_part(part: range | None, num: int) -> range | None:
  """``part`` (``None``: the whole stack); ``ValueError`` unless it is a
  non-empty ``range(a, b)`` of step 1 inside ``[0, num)``."""
  if part is not None and not (isinstance(part, range) and part.step == 1
                               and 0 <= part.start < part.stop <= num):
    raise ValueError(f"a part of a stack of {num} trials must be a non-empty "
                     f"range(a, b) with 0 <= a < b <= {num}, got {part!r}")
  return part


def part_config(setup: TrialsConfig, part: range | None
                ) -> pretrain_lib.PretrainConfig:
  """``setup.pretrain`` for stack ``part``: row ``i`` seeded as trial
  ``part.start + i`` (row ``k``: ``seed + k``), as in the whole stack."""
  cfg = setup.pretrain
  return cfg if not part else cfg.with_overrides(seed=cfg.seed + part.start)


def pretrain_dir(workdir: str, setup: TrialsConfig, mid: ModelId,
                 part: range | None = None) -> str:
  """``DIR/pretrain/<model tag>-<8 hex digits>`` of ``mid``'s stacked
  pretraining run (the digits key recipe, seed and layout versions);
  ``<model tag>-trials<a>-<b - 1>-<digits>`` of its ``part = range(a, b)``."""
  fp = identity_lib.fingerprint(
      {"pretrain": setup.pretrain.identity(), "seed": setup.seed,
       "model_keys": MODEL_KEYS_VERSION, "state_layout": PRETRAIN_DIR_VERSION},
      digits=8)
  span = "" if not part else f"-trials{part.start}-{part.stop - 1}"
  return os.path.join(workdir, "pretrain", f"{mid.tag}{span}-{fp}")


def pretrain(workdir: str, setup: TrialsConfig, mid: ModelId,
             models_K: generative.Model, stop_at: float | None = None,
             part: range | None = None) -> str:
  """Pretrains, reuses or resumes ``mid``'s transformers (its trials
  ``part``: :func:`part_config`) in :func:`pretrain_dir`, which it returns."""
  cfg, pdir = part_config(setup, part), pretrain_dir(workdir, setup, mid, part)
  logging.info("pretraining %d trials in %s", len(models_K.initial), pdir)
  pretrain_lib.run_trials(pdir, cfg, models_K, log=logging.info,
                          stop_at=stop_at)
  return pdir


def pretrained(workdir: str, setup: TrialsConfig, mid: ModelId,
               models_K: generative.Model, checkpoints: str = "always",
               stop_at: float | None = None, part: range | None = None,
               keep_by: float | None = None):
  """``(backbone, params_K, infos)`` of ``models_K`` (trials ``part``:
  :func:`part_config`): :func:`pretrain` and :func:`pretrain.load_trials` if
  ``checkpoints="always"``, else :func:`pretrain.train_trials` (``keep_by``)."""
  if part is not None and len(part) != len(models_K.initial):
    raise ValueError(f"{mid.tag}: part {part!r} of {len(part)} trials, "
                     f"{len(models_K.initial)} models given")
  if pretrain_lib.check_checkpoints(checkpoints) == "always":
    return pretrain_lib.load_trials(
        pretrain(workdir, setup, mid, models_K, stop_at, part))
  pdir = pretrain_dir(workdir, setup, mid, part)
  logging.info("pretraining %d trials in %s (%s)", len(models_K.initial),
               pdir, "no checkpoints" if checkpoints == "never" else
               "a checkpoint only at the deadline")
  return pretrain_lib.train_trials(
      pdir, part_config(setup, part), models_K, log=logging.info,
      stop_at=stop_at, checkpoints=checkpoints, keep_by=keep_by)


def pretrain_fields(info: pretrain_lib.TrialInfo) -> dict:
  """The ``pretrain_*`` fields of a result line from its trial's ``info``."""
  return {"pretrain_steps": info.step, **{
      f"pretrain_{k}": info.metrics.get(k) for k in (
          "ce_gap", "tv", "mlm_ce", "bayes_ce", "wall_s", "layers")}}


def tune_lanes(setup: TrialsConfig, cfg: tuning.TuneConfig, backbone,
               params_L: Any, lanes: Sequence[tuple[int, Sequence[int]]],
               stack: Stack) -> list[list[dict]]:
  """Tunes every lane in one :func:`tuning.tune_trials` program: lane ``i``,
  ``(k, tasks)``, is ``params_L[i]`` on trial ``k``'s ``tasks`` (each cell
  with its :func:`tune_key`); returns ``[L][S_i]`` dicts of result fields."""
  data = {(k, s): tuning.data_from_task(stack.tasks[k - stack.first][s], cfg)
          for k, s in {(k, s) for k, ss in lanes for s in ss}}
  res, _ = tuning.tune_trials(
      [[tune_key(setup, k, s) for s in ss] for k, ss in lanes], backbone,
      params_L, [[data[k, s] for s in ss] for k, ss in lanes], cfg,
      lane_group=setup.lane_group())
  assert res.lane_steps is not None  # tune_trials reports every lane's
  floats = ("test_accuracy", "val_accuracy", "train_accuracy", "final_loss")
  return [[{**{f: float(getattr(res, f)[i, j]) for f in floats},
           "steps": int(res.lane_steps[i, j]), "seconds": res.seconds}
           for j in range(len(ss))] for i, (_, ss) in enumerate(lanes)]


DeadlineReached = pretrain_lib.DeadlineReached


def missing(plan: dict, done: set, line_keys: Callable[[Any], dict]) -> dict:
  """``{model: {group: its cells without a line}}`` over ``plan`` (``{ModelId:
  [group]}``); ``line_keys(group)``: its cells' line keys; ``done``: on disk."""
  return {mid: {g: cells for g in groups if (cells := {
      cell for cell, key in line_keys(g).items() if key not in done})}
          for mid, groups in plan.items()}


def run_lines(plan: dict, read: Callable[[], list],
              line_keys: Callable[[Any], dict], prepare: Callable,
              score: Callable, path: str,
              schedule: scheduling.Schedule = scheduling.EVERYTHING) -> list:
  """A study's resume over typed lines in ``path``: :func:`run_stacks` on the
  cells of ``plan`` without a line in ``read()`` (:func:`missing`), each group's
  ``score(group, stack)`` lines less those on disk; returns ``read()`` after."""
  done = {line.key() for line in read()}
  run_stacks(missing(plan, done, line_keys), prepare,
             lambda g, stack: [r for r in score(g, stack)
                               if r.key() not in done], path, schedule)
  return read()


def stack_order(mids, schedule: scheduling.Schedule,
                weight: Callable[[ModelId], float] | None = None) -> list:
  """This process's ``mids`` in :meth:`~scheduling.Schedule.mine`'s order."""
  return schedule.mine(list(mids), lambda mid: (
      0 if weight is None else weight(mid), mid.size))


def run_stacks(todo: dict, prepare: Callable, tune: Callable, path: str,
               schedule: scheduling.Schedule = scheduling.EVERYTHING,
               weight: Callable[[ModelId], float] | None = None,
               split: Callable[[ModelId, float], tuple[Any, float] | None]
               | None = None) -> list[str]:
  """The resume loop: for each of this process's stacks of ``todo``
  (``{ModelId: [group]}``, :func:`stack_order`), ``prepare(mid, groups)``
  makes it, then each group's ``tune(group, stack)`` lines are appended to
  ``path``. A stack whose estimate (``weight(mid)`` times the seconds per
  weight so far) does not fit ``schedule``'s time left is skipped, or run
  in part where ``split(mid, weight that fits)`` returns ``(groups, their
  weight)``. Returns the tags skipped (or cut) for the deadline; raises
  :class:`DeadlineReached` inside a stack. Progress lines: docs/figure3.md."""
  mine = stack_order(todo, schedule, weight)
  total = sum(len(todo[mid]) for mid in mine)
  if schedule.claim is not None and schedule.progress is not None:
    total += schedule.progress(None)[0]  # finished before this process began
  done, t0, skipped, cut = 0, time.perf_counter(), [], []
  spent: list[tuple[float, float]] = []  # (seconds, weight) of stacks run
  deadline, stop_at = schedule.deadline, schedule.stop_at
  for mid in mine:
    if not (groups := todo[mid]):
      continue
    now = time.monotonic()
    rate = (sum(s for s, _ in spent) / sum(w for _, w in spent) if spent
            else schedule.seconds_per_weight)
    left = math.inf if stop_at is None else stop_at - now
    need = (math.nan if stop_at is None or weight is None or rate is None
            else rate * weight(mid))  # need > left: an estimate
    past = (deadline is not None and now >= deadline) or left <= 0
    part = (split(mid, left / rate) if not past and need > left
            and split is not None and rate else None)
    if past or (need > left and part is None):
      if left > 0 and not math.isnan(need):
        logging.info("%s: ~%.0f s by this run's estimate, %.0f s left: not "
                     "started", mid.tag, need, left)
      skipped.append((mid.tag, len(groups)))
      continue
    if schedule.claim is not None and not schedule.claim(mid):
      continue  # another process's: still in the run's total
    if part is not None and rate:
      groups = part[0]
      logging.info("%s: ~%.0f s by this run's estimate, %.0f s left: a part "
                   "of it (~%.0f s) runs", mid.tag, need, left, rate * part[1])
      cut.append(f"{mid.tag} (in part)")
    started = time.monotonic()
    stack = prepare(mid, groups)
    for i, g in enumerate(groups):
      if i and stop_at is not None and time.monotonic() >= stop_at:
        raise DeadlineReached(f"the deadline came in {mid.tag}'s tuning after "
                              f"{i} of its {len(groups)} groups")
      lines = tune(g, stack)
      files_lib.append_lines(path, lines)
      done += 1
      field = getattr(lines[0], "PROGRESS", "test_accuracy")
      accs = [getattr(r, field) for r in lines]
      bad = sum(not np.isfinite(getattr(r, "final_loss", 0.0)) for r in lines)
      count, timing = schedule.progress_line(f"{mid.tag}-{i}", done, total,
                                             time.perf_counter() - t0)
      logging.info(
          "%s %s %s: %s %.3f +- %.3f over %d lines (%.1fs)%s; %s",
          count, mid.tag, g, {"test_accuracy": "test acc"}.get(field, field),
          np.mean(accs), np.std(accs), len(lines), lines[0].seconds,
          f"; {bad} with a non-finite tuning loss" if bad else "", timing)
    if weight is not None:
      spent.append((time.monotonic() - started,
                    weight(mid) if part is None else part[1]))
    del stack  # before the next stack is made: one in memory
  if skipped:
    logging.warning("deadline passed: skipped %d stacks (%d groups): %s",
                    len(skipped), sum(n for _, n in skipped),
                    ", ".join(f"{t} ({n} groups)" for t, n in skipped))
  if cut:
    logging.warning("run in part for the deadline: %s", ", ".join(cut))
  return [tag for tag, _ in skipped] + cut
