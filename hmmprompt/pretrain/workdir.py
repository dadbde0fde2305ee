"""A pretraining run's directory, and loading a finished one for tuning.

Layout :data:`LAYOUT` (docs/pretraining.md): ``config.json``, ``hmm.npz``,
``checkpoints/`` (the trials still running), ``stopped/`` (each trial once,
as it stopped), ``metrics.jsonl``, ``retained/``."""

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import identity as identity_lib
from hmmprompt import checkpoints as ckpt_lib
from hmmprompt import generative
from hmmprompt import files as files_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.backbones import Backbone
from hmmprompt.backbones import depth
from hmmprompt.backbones import transformer
from hmmprompt.pretrain import train
from hmmprompt.pretrain.config import PretrainConfig

LAYOUT = 3
_LAYOUT1_SINGLE = (
    "{workdir} holds a one-model run of layout 1 (an unstacked model and "
    "checkpoint, written before 2026-11-23); this version reads layout "
    f"{LAYOUT}, where every run is a stack: rerun it in a new workdir")


@dataclasses.dataclass(frozen=True)
class Paths:
  config: str
  model: str
  ckpt: str
  metrics: str
  retained: str
  stopped: str

  @classmethod
  def of(cls, workdir: str) -> "Paths":
    return cls(*(os.path.join(workdir, name) for name in (
        "config.json", "hmm.npz", "checkpoints", "metrics.jsonl", "retained",
        "stopped")))


def read_config(paths: Paths) -> tuple[int, PretrainConfig]:
  """``(layout, config)`` of the run in ``paths``."""
  with open(paths.config) as f:
    blob = json.load(f)
  if "layout" not in blob:  # layout 1: the bare config
    return 1, PretrainConfig.from_json(blob)
  return blob["layout"], PretrainConfig.from_json(blob["pretrain"])


def prepare(workdir: str, cfg: PretrainConfig,
            models_K: generative.Model) -> Paths:
  """Creates ``workdir`` for a run of ``[K]`` stacked models, or checks
  that it holds this run (identity, trials, HMMs); ``ValueError`` if not."""
  paths = Paths.of(workdir)
  os.makedirs(workdir, exist_ok=True)
  if os.path.exists(paths.config):
    if diff := identity_lib.differences(
        read_config(paths)[1].identity(), cfg.identity(),
        defaults=identity_lib.added_defaults(cfg)):
      raise ValueError(f"{workdir} holds a run with a different config "
                       f"({'; '.join(diff)}); use a new --workdir (or "
                       f"delete it) to start another")
    old_models = generative.load(paths.model)
    had, has = map(generative.num_trials, (old_models, models_K))
    if had is None:
      raise ValueError(_LAYOUT1_SINGLE.format(workdir=workdir))
    if had != has:
      raise ValueError(f"{workdir} holds a run of {had} stacked trials, "
                       f"this run has {has} stacked trials: use a new "
                       f"workdir (or delete it) to change the trial count")
    if not generative.same(old_models, models_K):
      raise ValueError(f"{workdir} was pretrained on a different HMM")
  elif jax.process_index() == 0:
    generative.save(paths.model, models_K)
    files_lib.atomic_write_text(paths.config, json.dumps(
        {"layout": LAYOUT, "pretrain": cfg.to_json()}, indent=1))
  return paths


def read_metrics(paths: Paths, upto: int | None = None) -> list[dict]:
  """Evaluation lines, those after step ``upto`` dropped."""
  return [m for m in files_lib.read_jsonl(paths.metrics)
          if upto is None or m["step"] <= upto]


def write_metrics(paths: Paths, metrics: list[dict]) -> None:
  if jax.process_index() == 0:
    files_lib.atomic_write_text(
        paths.metrics, "".join(json.dumps(m) + "\n" for m in metrics))


# Jitted: one program per tree, not one eager op per leaf shape.
@jax.jit
def take(tree, rows):
  """``tree``'s rows ``rows`` of every leaf."""
  return jax.tree.map(lambda x: x[rows], tree)


@jax.jit
def put(tree, rows, part):
  """``tree`` with its rows ``rows`` set to ``part``."""
  return jax.tree.map(lambda full, p: full.at[rows].set(p), tree, part)


def save_rows(ckpts: ckpt_lib.Checkpoints, step: int, states_K, rows) -> None:
  """Saves trials ``rows`` of ``states_K`` at ``step``, numbers included."""
  rows = np.asarray(rows, np.int32)
  # Replicated: orbax refuses a process-local array from several processes.
  ckpts.save(step, {"trials": jax.device_put(rows, sharding_lib.replicated(
      sharding_lib.data_mesh())), "states": take(states_K, rows)})


class Restored(NamedTuple):
  """``step``, all K ``states``, the ``rows`` the checkpoint holds."""

  step: int
  states: Any
  rows: list[int]


def restore(ckpts: ckpt_lib.Checkpoints, stopped: ckpt_lib.Checkpoints | None,
            cfg: PretrainConfig, num: int,
            log: Callable[[str], Any] = logging.warning) -> Restored | None:
  """All ``num`` trials at the newest readable checkpoint (``None``: none), the
  rest from ``stopped``; ``FileNotFoundError``: none readable, a trial lost."""
  def abstract(mngr, step):
    """What :func:`save_rows` saved at ``step`` (layout 2: all K states)."""
    tree = mngr.item_tree(step)
    if "trials" not in tree:
      return train.abstract_states(cfg, num)
    rows = tree["trials"].shape[0]
    return {"trials": jax.ShapeDtypeStruct((rows,), jnp.int32),
            "states": train.abstract_states(cfg, rows)}
  step, saved = ckpts.restore_latest(lambda s: abstract(ckpts, s), log=log)
  if step is None:
    return None
  if not isinstance(saved, dict):  # layout 2: all K
    return Restored(step, saved, list(range(num)))
  parts = ([] if stopped is None else
           [stopped.restore(abstract(stopped, s), s)
            for s in stopped.all_steps() if s <= step])
  states = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                        train.abstract_states(cfg, num))
  for part in parts + [saved]:  # the checkpoint's own rows last: they win
    states = put(states, part["trials"], part["states"])
  rows = [np.asarray(part["trials"]).tolist() for part in parts + [saved]]
  if lost := sorted(set(range(num)).difference(*rows)):
    raise FileNotFoundError(
        f"trials {lost} are in neither the checkpoint of step {step} in "
        f"{ckpts.directory} nor in stopped/ beside it: the workdir lost "
        f"files; pretrain in a new workdir")
  return Restored(step, states, rows[-1])


def _open_run(workdir: str) -> tuple[Paths, PretrainConfig, generative.Model,
                                     int]:
  """``(paths, config, models_K, K)``; raises as :func:`load_trials`."""
  paths = Paths.of(workdir)
  for path in (paths.config, paths.model):
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path} not found: {workdir} is not a "
                              f"pretraining workdir")
  cfg, models_K = read_config(paths)[1], generative.load(paths.model)
  if (num := generative.num_trials(models_K)) is None:
    raise ValueError(_LAYOUT1_SINGLE.format(workdir=workdir))
  return paths, cfg, models_K, num


def fallback_dir(workdir: str, k: int) -> str:
  """Where trial ``k``'s fallback run lives."""
  return os.path.join(workdir, f"fallback-{k}")


def fallback_line(shallow: dict, deep: dict, k: int, layers: int) -> dict:
  """The deeper run's line, with ``layers`` and both runs' ``wall_s``."""
  return {**deep, "trial": k, "layers": layers,
          "wall_s": shallow["wall_s"] + deep["wall_s"]}


class TrialInfo(NamedTuple):
  """A pretrained trial beside its params (:func:`load_trials`)."""

  config: PretrainConfig  # its own (the fallback's where it fell back)
  model: generative.Model  # its generating model, unstacked
  metrics: dict  # its last metrics.jsonl line ({} before any)
  step: int  # the step it stopped at


def load_trials(workdir: str) -> tuple[Backbone, Any, list[TrialInfo]]:
  """``(backbone, params_K, infos)`` of a run, for :func:`tuning.tune_trials`
  (fallbacks: :func:`with_fallbacks`). ``FileNotFoundError``: not a workdir, or
  no readable checkpoint; ``ValueError``: a layout-1 one-model run."""
  paths, cfg, models_K, num = _open_run(workdir)
  ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=cfg.keep)
  stopped = (ckpt_lib.Checkpoints(paths.stopped, keep=None)
             if os.path.isdir(paths.stopped) else None)
  try:
    found = restore(ckpts, stopped, cfg, num)
  finally:
    ckpts.close()
    if stopped:
      stopped.close()
  if found is None:
    raise FileNotFoundError(f"no checkpoints in {paths.ckpt}")
  last = {m.get("trial", 0): m for m in read_metrics(paths)}
  step_K = np.asarray(found.states.step)  # one transfer
  infos = [TrialInfo(cfg, generative.trial(models_K, k), last.get(k, {}),
                     int(step_K[k])) for k in range(num)]
  deeps = {}
  for k in [k for k in range(num) if cfg.falls_back(last.get(k, {}))]:
    where = fallback_dir(workdir, k)
    if not os.path.exists(Paths.of(where).config):
      raise FileNotFoundError(
          f"trial {k} of {workdir} is above the target gap at the cap and "
          f"its fallback run {where} is missing: run run_trials to train it")
    _, deep_K, (deep,) = load_trials(where)
    deeps[k] = (deep_K, deep)
  return with_fallbacks(cfg, found.states.params, infos, deeps)


def with_fallbacks(cfg, params_K, infos: list[TrialInfo],
                   deeps: dict[int, tuple[Any, TrialInfo]]
                   ) -> tuple[Backbone, Any, list[TrialInfo]]:
  """``(backbone, params_K, infos)`` with trials ``deeps`` (``{k: (fallback
  params [1, ...], its info)}``) replaced by their deeper models, the rest
  padded with identity blocks; their metrics become :func:`fallback_line`."""
  if not deeps:
    return transformer.make_backbone(cfg.model), params_K, infos
  deep_cfg = cfg.fallback(0).model
  params_K = depth.pad_layers(params_K, deep_cfg.num_layers)
  infos = list(infos)
  for k, (deep_K, deep) in sorted(deeps.items()):
    params_K = jax.tree.map(lambda a, b: a.at[k].set(b[0]), params_K, deep_K)
    infos[k] = deep._replace(model=infos[k].model, metrics=fallback_line(
        infos[k].metrics, deep.metrics, k, deep_cfg.num_layers))
  return transformer.make_backbone(deep_cfg), params_K, infos


def load_backbone(workdir: str) -> tuple[Backbone, Any, TrialInfo]:
  """``(backbone, params, info)``: :func:`load_trials`' only trial,
  unstacked; raises as it does, and ``ValueError`` for several trials."""
  backbone, params_K, infos = load_trials(workdir)
  if len(infos) != 1:
    raise ValueError(f"{workdir} holds {len(infos)} stacked trials: load it "
                     f"with load_trials")
  return backbone, jax.tree.map(lambda x: x[0], params_K), infos[0]


def load_retained(workdir: str) -> tuple[Backbone, Any, list[int], list[dict]]:
  """``(backbone, params_QxK, steps [Q], infos)``: a run's retained
  checkpoints, ascending; ``params_QxK`` reshaped ``(Q * K, ...)`` is one
  :func:`tuning.tune_trials` stack (lane ``q * K + k``); ``infos[k]``:
  ``config``, ``model``, ``steps`` (its own). ``FileNotFoundError``: not a
  workdir, or nothing retained; ``ValueError``: layout 1, or fallbacks."""
  paths, cfg, models_K, num = _open_run(workdir)
  fell = sorted({m.get("trial", 0) for m in read_metrics(paths)
                 if cfg.falls_back(m)})
  if fell:  # their tuned models are the fallbacks', retained nowhere
    raise ValueError(f"trials {fell} of {workdir} fell back to "
                     f"{cfg.fallback_layers} layers: load_retained reads "
                     f"the stack's own checkpoints only")
  if not os.path.isdir(paths.retained):
    raise FileNotFoundError(
        f"no retained checkpoints in {workdir} ({paths.retained} missing): "
        f"pretrain with PretrainConfig.retain set")
  retained = ckpt_lib.Checkpoints(paths.retained, keep=None)
  try:
    if not (steps := retained.all_steps()):
      raise FileNotFoundError(
          f"no retained checkpoints in {paths.retained}: pretrain with "
          f"PretrainConfig.retain set (a runtime field: the steps already "
          f"trained past are not retained by a rerun)")
    abstract = train.abstract_states(cfg, num)
    states_Q = [retained.restore(abstract, step) for step in steps]
  finally:
    retained.close()
  params_QxK = jax.tree.map(lambda *xs: jnp.stack(xs),
                            *[s.params for s in states_Q])
  steps_QxK = np.asarray([s.step for s in states_Q])  # one transfer
  infos = [{"config": cfg, "model": generative.trial(models_K, k),
            "steps": steps_QxK[:, k].tolist()} for k in range(num)]
  return transformer.make_backbone(cfg.model), params_QxK, steps, infos
