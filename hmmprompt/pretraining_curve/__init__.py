"""Accuracy against pretraining quality (docs/pretraining_curve.md;
``python -m experiments.pretraining_curve``): head and prompt tuning on the
checkpoints one stacked pretraining run per model retains (no early stop),
the exact backbone the limit; lines in DIR/curve.jsonl (:class:`CurveLine`)."""

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

LAYOUT = 1  # bumped when a line's meaning changes for the same setup
BACKBONES = ("transformer", "exact")
# TuneConfig fields the identity keeps at any value (keyed before ADDED).
_TUNE_KEYED = ("optimizer", "lbfgs_tol", "lbfgs_max_steps", "lbfgs_l2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurveSetup(protocol.TrialsConfig):
  """Everything that decides the curve's lines besides their keys (the
  shared fields: :class:`protocol.TrialsConfig`): vanilla models with the
  linear head, memory models with the attention head; ``pretrain.retain``
  is the checkpoint schedule (in this identity), with no ``target_gap``
  (an early stop would repeat a state at later checkpoints)."""

  vanilla_sizes: tuple[int, ...]  # |H| of the vanilla models

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
    result-deciding field, the checkpoint schedule and the versions."""
    ident = identity_lib.identity(self)
    ident["tune"].update({n: getattr(self.tune, n) for n in _TUNE_KEYED})
    return json.loads(json.dumps(
        {**ident, "retain": self.pretrain.retain,
         "model_keys": protocol.MODEL_KEYS_VERSION, "layout": LAYOUT}))

  def fingerprint(self) -> str:
    """12 hex digits keying the lines: :meth:`identity` without what
    decides which lines there are (trials, models, schedule)."""
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
  """2 cores in <= 15 minutes: Figure 3's cpu models, smaller task sets;
  one learning-rate cycle of ``cpu_adamw``, checkpoints log-spaced."""
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


def get_setup(preset: str = "cpu", overrides: Mapping[str, Any] | None = None,
              **fields) -> CurveSetup:
  """The named preset with overrides (:func:`config_flags.from_preset`)."""
  return config_flags.from_preset(PRESETS, preset, overrides, **fields)


@dataclasses.dataclass(frozen=True)
class CurveLine(files_lib.Line):
  """One tuned (model, trial, checkpoint, method), keyed by ``KEY_FIELDS``
  (``setup``: :meth:`CurveSetup.fingerprint`); the pretraining metrics are
  :func:`pretrain.evaluate_checkpoints`' (0, 0, ``None``, ``None`` exact)."""

  model: str  # ModelId.tag
  trial: int
  backbone: str  # transformer | exact
  step: int | None  # the retained checkpoint; None for exact
  method: str  # <method>_<head>
  setup: str
  hmm: str
  num_states: int
  memory_size: int
  hmm_fingerprint: str
  ce_gap: float  # held-out CE gap to the Bayes CE
  tv: float  # at MASK
  mlm_ce: float | None
  bayes_ce: float | None
  test_accuracy: float
  val_accuracy: float
  train_accuracy: float
  final_loss: float
  seconds: float  # the group's program

  KEY_FIELDS = ("model", "trial", "backbone", "step", "method", "setup")
  WHAT = "curve line"


def lines_path(workdir: str) -> str:
  return os.path.join(workdir, "curve.jsonl")


def read_curve_lines(workdir: str) -> list[CurveLine]:
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
    steps = setup.pretrain.retain if self.backbone == "transformer" else (None,)
    fp = setup.fingerprint()
    return {(k, s): (self.model_id.tag, k, self.backbone, s, self.method_name,
                     fp) for k in range(setup.trials) for s in steps}


def plan(setup: CurveSetup) -> dict[protocol.ModelId, list[Group]]:
  """The groups by model, in the order they run."""
  return {mid: [Group(mid, method, "attention" if mid.hmm == "memory"
                      else "linear", backbone=bb)
                for method in ("head", "prompt") for bb in BACKBONES]
          for mid in setup.model_ids()}


def check_workdir(workdir: str, setup: CurveSetup) -> None:
  """Stamps DIR/curve.json (``ValueError`` if it holds another setup's)."""
  files_lib.stamp(os.path.join(workdir, "curve.json"), setup.identity(),
                  "curve setup", defaults=identity_lib.added_defaults(setup))


class Checkpoints(NamedTuple):
  """A stack's retained checkpoints and their quality."""

  backbone: Any
  params_QxK: Any  # stacked [Q, K, ...], the schedule's order
  metrics_QxK: list  # [Q][K] pretrain.evaluate_checkpoints' dicts


def checkpoints(workdir: str, setup: CurveSetup, mid: protocol.ModelId,
                models_K: generative.Model) -> Checkpoints:
  """``mid``'s retained checkpoints, evaluated (:func:`protocol.pretrain`)."""
  pdir = protocol.pretrain(workdir, setup, mid, models_K)
  backbone, params_QxK, steps, _ = pretrain_lib.load_retained(pdir)
  if missing := sorted(set(setup.pretrain.retain) - set(steps)):
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
  """Tunes ``g`` in one program, lane ``q * K + k`` checkpoint ``q`` of
  trial ``k`` (exact: lane ``k``), each on its trial's task 0 and key."""
  steps: tuple[int | None, ...]
  quality: list[list[dict[str, Any]]]  # [Q][K]
  if g.backbone == "transformer":
    assert ckpts is not None, "run_curve prepares a transformer's checkpoints"
    steps, backbone = setup.pretrain.retain, ckpts.backbone
    params = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]),
                          ckpts.params_QxK)
    quality = [[{n: float(ev[n]) for n in ("ce_gap", "tv", "mlm_ce",
                                           "bayes_ce")} for ev in row]
               for row in ckpts.metrics_QxK]
  else:
    steps = (None,)
    backbone, params = exact.make_stacked(stack.models_K)
    quality = [[dict(ce_gap=0.0, tv=0.0, mlm_ce=None, bayes_ce=None)]
               * setup.trials]
  lanes = [(q, k) for q in range(len(steps)) for k in range(setup.trials)]
  fields = protocol.tune_lanes(setup, g.tune_config(setup.tune), backbone,
                               params, [(k, [0]) for _, k in lanes], stack)
  mid, fp = g.model_id, setup.fingerprint()
  return [CurveLine(
      model=mid.tag, trial=k, backbone=g.backbone, step=steps[q],
      method=g.method_name, setup=fp, hmm=mid.hmm, num_states=mid.num_states,
      memory_size=mid.memory_size, hmm_fingerprint=stack.fingerprints[k],
      **quality[q][k], **{n: v for n, v in f.items() if n != "steps"})
          for (q, k), (f,) in zip(lanes, fields)]


def run_curve(setup: CurveSetup, workdir: str,
              schedule: scheduling.Schedule = scheduling.EVERYTHING
              ) -> list[CurveLine]:
  """Runs the groups without lines in DIR/curve.jsonl (one workdir per
  shard or worker); returns all lines. ``ValueError``: another setup's."""
  check_workdir(workdir, setup)
  done = {line.key() for line in read_curve_lines(workdir)}
  todo = protocol.missing(plan(setup), done, lambda g: g.keys(setup))
  def prepare(mid, groups):
    stack = protocol.draw_stack(setup, mid, setup.trials)
    return stack, (checkpoints(workdir, setup, mid, stack.models_K) if any(
        g.backbone == "transformer" for g in groups) else None)
  protocol.run_stacks(todo, prepare, lambda g, sc: [
      r for r in tune_group(setup, g, *sc) if r.key() not in done],
      lines_path(workdir), schedule, weight=lambda mid: setup.trials)
  return read_curve_lines(workdir)
