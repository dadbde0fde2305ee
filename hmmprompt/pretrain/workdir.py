"""A pretraining run's directory, and loading a finished one for tuning.

Layout: ``config.json`` (the :class:`PretrainConfig`), ``hmm.npz`` (the
generating model, :func:`models.save`), ``checkpoints/`` (orbax, the
:class:`TrainState`), ``metrics.jsonl`` (one line per evaluation).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from hmmprompt import checkpoints as ckpt_lib
from hmmprompt import models
from hmmprompt import results as results_lib
from hmmprompt.backbones import Backbone
from hmmprompt.backbones import transformer
from hmmprompt.pretrain import train
from hmmprompt.pretrain.config import PretrainConfig


@dataclasses.dataclass(frozen=True)
class Paths:
  config: str
  model: str
  ckpt: str
  metrics: str

  @classmethod
  def of(cls, workdir: str) -> "Paths":
    return cls(config=os.path.join(workdir, "config.json"),
               model=os.path.join(workdir, "hmm.npz"),
               ckpt=os.path.join(workdir, "checkpoints"),
               metrics=os.path.join(workdir, "metrics.jsonl"))


def prepare(workdir: str, cfg: PretrainConfig, model: models.Model) -> Paths:
  """Creates ``workdir`` or checks that it holds this very run.

  ``model`` is one model, or ``[K]`` stacked models for a stacked run
  (:func:`~hmmprompt.pretrain.run_trials`).

  Raises:
    ValueError: the workdir holds a run of another config, another trial
      count or other HMMs (named).
  """
  paths = Paths.of(workdir)
  os.makedirs(workdir, exist_ok=True)
  if os.path.exists(paths.config):
    with open(paths.config) as f:
      old = json.load(f)
    if old != json.loads(json.dumps(cfg.to_json())):
      raise ValueError(f"{workdir} holds a run with a different config; use "
                       f"a new --workdir (or delete it) to start another")
    old_model = models.load(paths.model)
    had, has = models.num_trials(old_model), models.num_trials(model)
    if had != has:
      raise ValueError(f"{workdir} holds a run of {_trials(had)}, this run "
                       f"has {_trials(has)}: use a new workdir (or delete "
                       f"it) to change the trial count")
    if not models.same(old_model, model):
      raise ValueError(f"{workdir} was pretrained on a different HMM")
  elif jax.process_index() == 0:
    models.save(paths.model, model)
    results_lib.atomic_write_text(paths.config,
                                  json.dumps(cfg.to_json(), indent=1))
  return paths


def _trials(k: int | None) -> str:
  return "one model (not stacked)" if k is None else f"{k} stacked trials"


def read_metrics(paths: Paths, upto: int | None = None) -> list[dict]:
  """Evaluation lines (those after step ``upto`` dropped: a rerun redoes
  them from the checkpoint)."""
  lines = results_lib.read_jsonl(paths.metrics)
  return [m for m in lines if upto is None or m["step"] <= upto]


def write_metrics(paths: Paths, metrics: list[dict]) -> None:
  if jax.process_index() == 0:
    results_lib.atomic_write_text(
        paths.metrics, "".join(json.dumps(m) + "\n" for m in metrics))


def _load(workdir: str, stacked: bool):
  paths = Paths.of(workdir)
  for what in ("config", "model"):
    if not os.path.exists(getattr(paths, what)):
      raise FileNotFoundError(f"{getattr(paths, what)} not found: {workdir} "
                              f"is not a pretraining workdir")
  with open(paths.config) as f:
    cfg = PretrainConfig.from_json(json.load(f))
  model = models.load(paths.model)
  k = models.num_trials(model)
  if (k is not None) != stacked:
    raise ValueError(f"{workdir} holds {_trials(k)}: load it with "
                     f"{'load_trials' if k else 'load_backbone'}")
  if not os.path.isdir(paths.ckpt):
    raise FileNotFoundError(f"no checkpoints in {paths.ckpt}")
  ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=cfg.keep)
  if ckpts.latest_step() is None:
    ckpts.close()
    raise FileNotFoundError(f"no checkpoints in {paths.ckpt}")
  abstract = jax.eval_shape(
      lambda: train.init_states(jax.random.PRNGKey(0), cfg, k))
  state = ckpts.restore(abstract)
  ckpts.close()
  return cfg, model, state, read_metrics(paths)


def load_backbone(workdir: str) -> tuple[Backbone, Any, dict]:
  """``(backbone, params, info)`` of a pretrained run, for tuning.

  ``info`` holds the ``PretrainConfig`` (``config``), the generating
  ``model``, the last ``metrics`` line and the checkpoint's ``step``.
  Raises ``FileNotFoundError`` naming what is missing, ``ValueError`` for a
  stacked run (:func:`load_trials`).
  """
  cfg, model, state, metrics = _load(workdir, stacked=False)
  info = {"config": cfg, "model": model,
          "metrics": metrics[-1] if metrics else {},
          "step": int(state.step)}
  return transformer.make_backbone(cfg.model), state.params, info


def load_trials(workdir: str) -> tuple[Backbone, Any, list[dict]]:
  """``(backbone, params_K, infos)`` of a stacked run, for tuning.

  ``params_K``: the K transformers' params stacked ``[K, ...]`` (feed them
  to :func:`tuning.tune_trials`); ``infos[k]`` as :func:`load_backbone`'s
  ``info`` for trial ``k`` (its ``model`` unstacked, its last ``metrics``
  line, its ``step``: where it stopped). Raises ``FileNotFoundError``
  naming what is missing, ``ValueError`` for a single run.
  """
  cfg, model_k, state, metrics = _load(workdir, stacked=True)
  infos = []
  for k in range(models.num_trials(model_k)):
    mine = [m for m in metrics if m.get("trial") == k]
    infos.append({"config": cfg, "model": models.trial(model_k, k),
                  "metrics": mine[-1] if mine else {},
                  "step": int(state.step[k])})
  return transformer.make_backbone(cfg.model), state.params, infos
