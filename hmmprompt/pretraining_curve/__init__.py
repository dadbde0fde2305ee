r"""Accuracy against pretraining quality: head and prompt tuning on the
checkpoints of one pretraining run, from the random init to the end
(docs/pretraining_curve.md).

  python -m experiments.pretraining_curve --preset=tiny|cpu --workdir=DIR \
      [--config.pretrain.steps=1000 --config.pretrain.retain=0,10,100,1000] \
      [--config.trials=2 --config.vanilla_sizes=8 --config.memory_sizes= ...]

Per model (vanilla ``|H|`` with a linear head, memory ``|M|`` with an
attention head; ``trials`` HMM draws each, Figure 3's draws for the same
seed), one stacked pretraining run without early stop retains its
checkpoints at ``pretrain.retain`` (step 0 the init), each evaluated
(held-out CE gap and TV at ``MASK``); head and prompt tuning run on every
checkpoint x trial in one program per (model, method), lane ``q * K + k``
for retained step ``q`` and trial ``k``, each with its trial's task and
tuning key, so the checkpoints of a trial differ in nothing but their
params; the exact backbone on the same tasks is the limit.

Writes DIR/curve.json (the setup's identity: another setup is refused,
what differs named), DIR/pretrain/<model>/, DIR/curve.jsonl (one
:class:`CurveLine` per model, trial, checkpoint and method, appended one
group at a time: a rerun resumes with nothing lost or duplicated), and
the report (:mod:`.report`): DIR/curve.md and DIR/curve.png.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple
from collections.abc import Mapping

import jax
import numpy as np

from hmmprompt import identity as identity_lib
from hmmprompt import protocol
from hmmprompt import config_flags
from hmmprompt import generative
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import files as files_lib
from hmmprompt import scheduling
from hmmprompt import tasks as tasks_lib
from hmmprompt import tuning
from hmmprompt.backbones import exact

# Bumped when a line's meaning changes for the same setup (the fingerprint
# hashes it, and DIR/curve.json records it).
LAYOUT = 1
BACKBONES = ("transformer", "exact")
# TuneConfig fields the curve's identity holds whatever their value
# (:meth:`CurveSetup.identity`).
_TUNE_KEYED = ("optimizer", "lbfgs_tol", "lbfgs_max_steps", "lbfgs_l2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurveSetup(protocol.TrialsConfig):
  """Everything that decides the curve's lines besides their keys (the
  shared fields: :class:`protocol.TrialsConfig`).

  Attributes:
    vanilla_sizes: ``|H|`` of the vanilla models (linear head).
    memory_sizes: ``|M|`` of the memory models (attention head).
    pretrain: ``retain`` (a runtime field of the pretraining, but the
      curve's x points) is the checkpoint schedule and part of this
      setup's identity; no ``target_gap`` (a trial stopped early would
      repeat its state at every later checkpoint).
  """

  vanilla_sizes: tuple[int, ...]

  def __post_init__(self):
    self._check(("trials",), ("vanilla_sizes", "memory_sizes"))
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
    self.check_context()

  def identity(self) -> dict:
    """What DIR/curve.json records and :meth:`fingerprint` hashes: every
    result-deciding field, the checkpoint schedule and the key streams'
    version."""
    ident = identity_lib.identity(self)
    # The curve was first keyed when TuneConfig's L-BFGS fields were in
    # every identity (they became identity.ADDED for Figure 3's older
    # lines later): its identity keeps them at any value.
    ident["tune"].update({n: getattr(self.tune, n) for n in _TUNE_KEYED})
    return json.loads(json.dumps(
        {**ident, "retain": self.pretrain.retain,
         "model_keys": protocol.MODEL_KEYS_VERSION, "layout": LAYOUT}))

  def fingerprint(self) -> str:
    """12 hex digits keying the lines to what decides a line's values:
    :meth:`identity` without the trial count, the models and the schedule,
    which decide which lines there are (their keys), not their values."""
    return identity_lib.fingerprint({
        k: v for k, v in self.identity().items()
        if k not in ("trials", "vanilla_sizes", "memory_sizes", "retain")})

  def model_ids(self) -> list[protocol.ModelId]:
    """The models, vanilla then memory, by size (the order they run)."""
    return ([protocol.vanilla(h) for h in self.vanilla_sizes]
            + [protocol.memory(m) for m in self.memory_sizes])


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
  ``cpu_adamw`` transformer (the main job's before issue 30) trained for one learning-rate cycle with no
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
          "cpu_adamw", steps=steps, cycles=None, target_gap=None,
          eval_every=steps, ckpt_every=250,
          retain=(0, 25, 50, 100, 200, 400, steps)))


PRESETS = {"tiny": _tiny, "cpu": _cpu}


def get_setup(preset: str = "cpu",
              overrides: Mapping[str, Any] | None = None,
              **fields) -> CurveSetup:
  """The named preset with overrides (:func:`config_flags.from_preset`)."""
  return config_flags.from_preset(PRESETS, preset, overrides, **fields)


# ----------------------------------------------------------------------------
# Result lines.


@dataclasses.dataclass(frozen=True)
class CurveLine(files_lib.Line):
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
  WHAT = "curve line"


def lines_path(workdir: str) -> str:
  return os.path.join(workdir, "curve.jsonl")


def read_lines(workdir: str) -> list[CurveLine]:
  """The lines of DIR/curve.jsonl; ``ValueError`` naming a bad one."""
  return files_lib.read_lines(lines_path(workdir), CurveLine)


@dataclasses.dataclass(frozen=True)
class Group(protocol.Group):
  """One model, tuning method and backbone: one program, one append."""

  backbone: str = "transformer"  # | "exact"

  def __str__(self) -> str:
    return f"{self.method_name} {self.backbone}"

  def keys(self, setup: CurveSetup) -> dict[tuple, tuple]:
    """``{(trial, step): key}`` of the lines this group writes."""
    steps = (setup.pretrain.retain if self.backbone == "transformer"
             else (None,))
    fp = setup.fingerprint()
    return {(k, s): (self.model_id.tag, k, self.backbone, s,
                     self.method_name, fp)
            for k in range(setup.trials) for s in steps}


def plan(setup: CurveSetup) -> dict[protocol.ModelId, list[Group]]:
  """The groups by model, in the order they run: head then prompt tuning,
  each on the transformer then the exact backbone (the limit)."""
  return {mid: [Group(mid, method, "attention" if mid.hmm == "memory"
                      else "linear", backbone=bb)
                for method in ("head", "prompt") for bb in BACKBONES]
          for mid in setup.model_ids()}


def check_workdir(workdir: str, setup: CurveSetup) -> None:
  """Stamps DIR/curve.json with the setup's identity on first use.

  Raises:
    ValueError: the workdir holds another setup's curve (what differs
      named).
  """
  files_lib.stamp(os.path.join(workdir, "curve.json"), setup.identity(),
                    "curve setup")


class Checkpoints(NamedTuple):
  """A stack's retained checkpoints and their quality."""

  backbone: Any
  params_QxK: Any  # stacked [Q, K, ...], the schedule's order
  metrics_QxK: list  # [Q][K] pretrain.evaluate_checkpoints' dicts


def checkpoints(workdir: str, setup: CurveSetup, mid: protocol.ModelId,
                models_K: generative.Model) -> Checkpoints:
  """Pretrains ``mid``'s stack in :func:`protocol.pretrain_dir` (or reuses
  or resumes it) and returns its retained checkpoints, evaluated."""
  pdir = protocol.pretrain_dir(workdir, setup, mid)
  protocol.pretrain(pdir, setup.pretrain, models_K)
  backbone, params_QxK, steps, _ = pretrain_lib.load_retained(pdir)
  missing = sorted(set(setup.pretrain.retain) - set(steps))
  if missing:
    raise FileNotFoundError(
        f"{pdir} lacks the retained steps {missing} (it was pretrained "
        f"past them without retaining them); delete it to pretrain again")
  # The schedule's checkpoints, in its order (a directory may hold more).
  idx = np.asarray([steps.index(s) for s in setup.pretrain.retain])
  params_QxK = jax.tree.map(lambda x: x[idx], params_QxK)
  return Checkpoints(backbone, params_QxK, pretrain_lib.evaluate_checkpoints(
      setup.pretrain, models_K, params_QxK))


def tune_group(setup: CurveSetup, g: Group, stack: protocol.Stack,
               ckpts: Checkpoints | None) -> list[CurveLine]:
  """Tunes ``g``: every retained checkpoint x trial (transformer, lanes
  ``[Q * K]``, lane ``q * K + k``) or every trial (exact) in one program,
  each lane on its trial's task 0 from the same tuning key, so the
  checkpoints of a trial differ in nothing but their params."""
  num = setup.trials
  steps: tuple[int | None, ...]
  if g.backbone == "transformer":
    assert ckpts is not None, "run_curve() prepares a transformer group's checkpoints"
    steps, backbone = setup.pretrain.retain, ckpts.backbone
    params = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]),
                          ckpts.params_QxK)
  else:
    steps = (None,)
    backbone, params = protocol.exact_backbones(stack.models_K)
  lanes = [(q, k) for q in range(len(steps)) for k in range(num)]
  fields = protocol.tune_lanes(setup, g.tune_config(setup.tune), backbone,
                             params, [(k, [0]) for _, k in lanes], stack)
  mid, fp, lines = g.model_id, setup.fingerprint(), []
  for (q, k), (f,) in zip(lanes, fields):
    quality: dict[str, Any]
    if ckpts is not None and g.backbone == "transformer":
      ev = ckpts.metrics_QxK[q][k]
      quality = {n: float(ev[n]) for n in ("ce_gap", "tv", "mlm_ce",
                                           "bayes_ce")}
    else:
      quality = dict(ce_gap=0.0, tv=0.0, mlm_ce=None, bayes_ce=None)
    del f["steps"]
    lines.append(CurveLine(
        model=mid.tag, trial=k, backbone=g.backbone, step=steps[q],
        method=g.method_name, setup=fp, hmm=mid.hmm,
        num_states=mid.num_states, memory_size=mid.memory_size,
        hmm_fingerprint=stack.fingerprints[k], **quality, **f))
  return lines


def run_curve(setup: CurveSetup, workdir: str,
        schedule: scheduling.Schedule = scheduling.EVERYTHING
        ) -> list[CurveLine]:
  """Runs the groups without lines in DIR/curve.jsonl (pretraining a
  model's stack only if one of its transformer groups is left); returns
  all lines. ``schedule``: this process's share of the models and its
  deadline (:class:`scheduling.Schedule`, a stack's weight its trials; a
  host shard or a worker writes the same file, so give each its own
  workdir or run them one after another).

  Raises:
    ValueError: the workdir holds another setup's curve.
  """
  check_workdir(workdir, setup)
  done = {line.key() for line in read_lines(workdir)}
  missing = protocol.missing(plan(setup), done, lambda g: g.keys(setup))
  mine = schedule.mine(list(missing),
                       lambda mid: mid.num_states * max(mid.memory_size, 1))
  todo = {mid: list(missing[mid]) for mid in mine}

  def prepare(mid, groups):
    stack = protocol.draw_stack(setup, mid, setup.trials)
    ckpts = None
    if any(g.backbone == "transformer" for g in groups):
      ckpts = checkpoints(workdir, setup, mid, stack.models_K)
    return stack, ckpts

  protocol.run_stacks(todo, prepare, lambda g, sc: [
      r for r in tune_group(setup, g, *sc) if r.key() not in done],
                    lines_path(workdir), schedule,
                    weight=lambda mid: setup.trials)
  return read_lines(workdir)
