"""The pretraining loop: resume, train, evaluate, checkpoint, stop; step ``s``'s
batch is a pure function of ``(seed, s)`` (:func:`corpus.batch_at`)."""

import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import checkpoints as ckpt_lib
from hmmprompt import corpus as corpus_lib
from hmmprompt import generative
from hmmprompt import sharding as sharding_lib
from hmmprompt import validation
from hmmprompt.backbones import Backbone
from hmmprompt.pretrain import batches
from hmmprompt.pretrain import curves as curves_lib
from hmmprompt.pretrain import evaluation as evaluate_lib
from hmmprompt.pretrain import train
from hmmprompt.pretrain import workdir as workdir_lib
from hmmprompt.pretrain.batches import Keys
from hmmprompt.pretrain.config import PretrainConfig


def _clock() -> float:
  """``time.monotonic()``, the clock of ``stop_at`` (tests replace it)."""
  return time.monotonic()


CHECKPOINTS = ("always", "deadline", "never")
"""What a run writes to resume from: ``always`` a checkpoint every
``ckpt_every`` steps and at ``stop_at``; ``deadline`` one only where
``stop_at`` stops the run; ``never`` none (docs/pretraining.md)."""

# The rate a stop's checkpoint is assumed written at: the stack stops early
# enough for the save to end by ``stop_at``, before accelerator_session.sh's
# SIGTERM 20 s later (docs/figure3_gpu.md; the stop logs the real rate).
SAVE_BYTES_PER_S = 150e6


def check_checkpoints(checkpoints: str) -> str:
  """``checkpoints`` if one of :data:`CHECKPOINTS`, else ``ValueError``."""
  return validation.one_of("checkpoints", checkpoints, CHECKPOINTS)


class DeadlineReached(Exception):
  """A run's ``stop_at`` came; everything finished before it is on disk."""


def _reached(cfg: PretrainConfig, metrics: dict) -> bool:
  return (cfg.target_gap is not None
          and metrics.get("ce_gap", np.inf) <= cfg.target_gap)


def _is_eval(cfg: PretrainConfig, done: int) -> bool:
  return (done % cfg.eval_every == 0 or done == cfg.total_steps
          or done in cfg.cycle_ends)


def _may_stop(cfg: PretrainConfig, step: int) -> bool:
  """With cycles, an early stop happens only at the bottom of one."""
  return cfg.cycles is None or step in cfg.cycle_ends


def _stops(cfg: PretrainConfig, last: dict | None) -> bool:
  """Whether a trial last evaluated at ``last`` trains no more here."""
  return (last is not None and _may_stop(cfg, last["step"])
          and (_reached(cfg, last) or cfg.falls_back(last)))


def running_at_checkpoint(workdir: str) -> list[int] | None:
  """The trials a rerun of ``workdir``'s run still trains from its newest
  checkpoint (``None``: none), for a deadline's estimate."""
  paths = workdir_lib.Paths.of(workdir)
  if not os.path.isdir(paths.ckpt) or not os.path.exists(paths.config):
    return None
  ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=None)
  step = ckpts.latest_step()
  ckpts.close()
  if step is None:
    return None
  _, cfg = workdir_lib.read_config(paths)
  if step >= cfg.total_steps:
    return []
  last = {m.get("trial", 0): m for m in workdir_lib.read_metrics(paths, step)}
  num = generative.num_trials(generative.load(paths.model)) or 1
  return [k for k in range(num) if not _stops(cfg, last.get(k))]


_take, _put = workdir_lib.take, workdir_lib.put


def run(workdir: str, cfg: PretrainConfig, model: generative.Model,
        log: Callable[[str], Any] = print,
        after_step: Callable[[int], Any] | None = None) -> dict:
  """:func:`run_trials` of one model; returns its final metrics line."""
  return run_trials(workdir, cfg, generative.stack([model]), log=log,
                    after_step=after_step)[0]


def run_trials(workdir: str, cfg: PretrainConfig, models_K: generative.Model,
               log: Callable[[str], Any] = print,
               after_step: Callable[[int], Any] | None = None,
               stop_at: float | None = None) -> list[dict]:
  """Pretrains (or resumes, bit for bit) K transformers in ``workdir``, one
  per trial of ``models_K``, in one jitted step; returns each trial's final
  ``metrics.jsonl`` line. Trial ``k`` is trial ``k`` alone with ``seed =
  cfg.seed + k``; ``after_step(step)`` runs after each step; at ``stop_at``
  (a ``time.monotonic()``) it checkpoints and raises :class:`DeadlineReached`.

  Raises:
    ValueError: ``models_K`` is not a stack, ``workdir`` holds another run,
      or the batch does not split over the devices.
    FileNotFoundError: checkpoints exist but none is readable.
    FloatingPointError: a non-finite loss; the last checkpoint is kept.
  """
  return _run_trials(workdir, cfg, models_K, log, after_step,
                     stop_at=stop_at)[0]


def train_trials(workdir: str, cfg: PretrainConfig, models_K: generative.Model,
                 log: Callable[[str], Any] = print,
                 stop_at: float | None = None, checkpoints: str = "never",
                 keep_by: float | None = None
                 ) -> tuple[Backbone, Any, list[workdir_lib.TrialInfo]]:
  """:func:`run_trials` then :func:`~hmmprompt.pretrain.workdir.load_trials`
  (same values), the params handed over in memory; ``checkpoints`` (``never`` or
  ``deadline``) and ``keep_by``: docs/pretraining.md."""
  if check_checkpoints(checkpoints) == "always":
    raise ValueError("train_trials writes no periodic checkpoints: use "
                     "run_trials, then load_trials")
  finals, states, deeps = _run_trials(workdir, cfg, models_K, log, None,
                                      checkpoints=checkpoints,
                                      stop_at=stop_at, keep_by=keep_by)
  infos = [workdir_lib.TrialInfo(
      cfg, generative.trial(models_K, k), deeps[k][0] if k in deeps else line,
      int(states.step[k])) for k, line in enumerate(finals)]
  return workdir_lib.with_fallbacks(cfg, states.params, infos, {
      k: (deep_states.params, workdir_lib.TrialInfo(
          cfg.fallback(k), infos[k].model, deep_line, int(deep_states.step[0])))
      for k, (_, deep_line, deep_states) in deeps.items()})


def _run_trials(workdir, cfg, models_K, log, after_step, **kw):
  """``(finals, states, {k: (own last line, deep line, deep states)})``;
  ``kw``: :func:`_train_stack`'s ``checkpoints``, ``stop_at``, ``keep_by``."""
  if (num := generative.num_trials(models_K)) is None:
    raise ValueError("run_trials needs [K] stacked models "
                     "(generative.random_models or generative.stack); use "
                     "run for one model")
  finals, states = _train_stack(workdir, cfg, models_K, num, log, after_step,
                                **kw)
  deeps = {}
  for k, line in enumerate(finals):
    if cfg.falls_back(line):
      log(f"trial {k}: CE gap {line['ce_gap']:.4f} at step {line['step']}, "
          f"above that step's fallback check (target_gap at the cap, "
          f"fallback_gap(s) before it); pretraining it again with "
          f"{cfg.fallback_layers} layers"
          f"{' from it' if cfg.fallback_init == 'warm' else ''}")
      deep_cfg = cfg.fallback(k)
      # Warm: trial k's state as it stopped (stopped rows never move).
      init = None if cfg.fallback_init == "scratch" else lambda keys: (
          train.grown_states(_take(states, np.asarray([k])), keys, deep_cfg))
      (deep,), deep_states = _train_stack(
          workdir_lib.fallback_dir(workdir, k), deep_cfg,
          generative.stack([generative.trial(models_K, k)]), 1, log,
          after_step, init=init, **kw)
      deeps[k] = (line, deep, deep_states)
      finals[k] = workdir_lib.fallback_line(line, deep, k, cfg.fallback_layers)
  return finals, states, deeps


def _train_stack(workdir: str, cfg: PretrainConfig, models_K: generative.Model,
                 num: int, log: Callable[[str], Any],
                 after_step: Callable[[int], Any] | None,
                 init: Callable[[jax.Array], Any] | None = None,
                 checkpoints: str = "always", stop_at: float | None = None,
                 keep_by: float | None = None) -> tuple[list[dict], Any]:
  """:func:`run_trials` without the fallback, also returning the states."""
  mesh = sharding_lib.data_mesh()
  sharding_lib.check_batch(cfg.batch_size, mesh)  # before writing anything
  paths = workdir_lib.prepare(workdir, cfg, models_K)
  rep = sharding_lib.replicated(mesh)
  keys = Keys.of(cfg.seed, num)
  tag = (lambda k: "") if num == 1 else (lambda k: f"trial {k} ")
  ckpts = stopped = found = None
  periodic = check_checkpoints(checkpoints) == "always"
  if checkpoints != "never":
    ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=cfg.keep)
    stopped = ckpt_lib.Checkpoints(paths.stopped, keep=None)
    found = workdir_lib.restore(ckpts, stopped, cfg, num, log=log)
    if not periodic:  # read (a workdir "always" began), never written
      stopped.close()
      stopped = None
  start, states, saved_rows = found or (0, None, [])
  if found is None:
    states = (train.init_states(keys.init, cfg) if init is None
              else init(keys.init))
  else:
    log(f"resumed {'' if num == 1 else f'{num} trials '}from step {start}")
  if stopped is not None:
    for s in stopped.all_steps():
      if s > start:  # saved by a run cut before its checkpoint: redone
        stopped.delete(s)
  states = jax.device_put(states, rep)
  # The state in hand is step start's: a crash may have cut its retained copy.
  retained = (ckpt_lib.Checkpoints(paths.retained, keep=None)
              if cfg.retain else None)
  have = set(retained.all_steps()) if retained else set()
  def retain(step, states):
    if step in cfg.retain and step not in have:
      retained.save(step, states)
      have.add(step)
  if lost := [s for s in cfg.retain if s < start and s not in have]:
    log(f"retain: steps {lost} were trained past without being retained "
        f"(resumed from step {start}); a new workdir retains them")
  retain(start, states)
  total, metrics = cfg.total_steps, workdir_lib.read_metrics(paths, upto=start)
  last = {m.get("trial", 0): m for m in metrics}
  running = [k for k in range(num) if not _stops(cfg, last.get(k))]
  # A crash between a checkpoint and its evaluation leaves one to redo.
  missing = ([k for k in running if last.get(k, {}).get("step") != start]
             if start and _is_eval(cfg, start) else [])
  if not running:
    log(f"already reached the target gap at step "
        f"{max(m['step'] for m in last.values())}")
  if not running or (start >= total and not missing):
    _close(ckpts, retained, stopped)
    return [last.get(k, {}) for k in range(num)], states

  hmms = jax.device_put(jax.vmap(generative.as_hmm)(models_K), rep)
  chunks = (None if cfg.corpus.fresh else jnp.stack(
      [corpus_lib.build_chunks(keys.corpus[k], generative.trial(models_K, k),
                               cfg.corpus) for k in range(num)]))
  get_batch = batches.batch_fn(cfg.corpus, cfg.batch_size, cfg.model.vocab_size,
                               chunks is None, cfg.model.causal, mesh)
  train_step, window = train.make_train_step(cfg, mesh), train.exact_window(cfg)
  get_window = (batches.window_fn(cfg, window, chunks is None, mesh)
                if window > 1 else None)
  # Stopped trials are never evaluated again: no validation set for them.
  vals = {k: evaluate_lib.validation_set(
      keys.val[k], generative.trial(models_K, k), cfg) for k in running}
  progress = curves_lib.Progress(cfg, start, log, trials=len(running))
  # Written, never read: no result depends on them.
  curves = curves_lib.Curves(workdir, cfg.batch_size * cfg.corpus.chunk_len)
  if curves.status:
    log(curves.status)
  # Training wall time summed over resumed runs (what "time per size" is).
  wall_before = max((m.get("wall_s", 0.0) for m in metrics), default=0.0)
  t_run = time.perf_counter()
  stacked_vals = lambda rows: jax.tree.map(
      lambda *xs: jnp.stack(xs), *[vals[int(k)] for k in rows])
  def evaluate(step, sub, rows, n, vals_N):
    """Appends (and writes) the metrics of trials ``rows[:n]``."""
    wall = wall_before + time.perf_counter() - t_run
    lines = evaluate_lib.evaluate_group(sub.params, cfg, vals_N)
    for k, line in zip(rows[:n], lines):
      m = {"trial": int(k), "step": step, **line, "wall_s": wall}
      metrics.append(m)
      last[int(k)] = m
      curves.eval(m)
      log(f"{tag(k)}step {step}: mlm_ce {m['mlm_ce']:.4f} bayes_ce "
          f"{m['bayes_ce']:.4f} gap {m['ce_gap']:.4f} tv {m['tv']:.4f}")
    workdir_lib.write_metrics(paths, metrics)
  def stop_reached(step) -> list[int]:
    """Drops the trials at their target from ``running``; returns them."""
    if not (_is_eval(cfg, step) and _may_stop(cfg, step)):
      return []
    before = list(running)
    for k in [k for k in running if _reached(cfg, last[k])]:
      log(f"{tag(k)}CE gap {last[k]['ce_gap']:.4f} <= target {cfg.target_gap} "
          f"at step {step}: stopping{'' if num == 1 else ' it'}")
      running.remove(k)
    for k in [k for k in running if cfg.falls_back(last[k])]:
      running.remove(k)  # to its fallback (run_trials), before the cap
    return [k for k in before if k not in running]

  if missing:
    evaluate(start, _take(states, np.asarray(missing)), missing, len(missing),
             stacked_vals(missing))
    stop_reached(start)
  # Stopped trials only in the checkpoint resumed from: rotation drops it.
  unsaved = [k for k in saved_rows if k not in running]
  if unsaved and stopped is not None and running and start < total:
    workdir_lib.save_rows(stopped, start, states, unsaved)
  trial_bytes = 0 if stop_at is None or ckpts is None else sum(
      x.size * x.dtype.itemsize
      for x in jax.tree.leaves(train.abstract_states(cfg, 1)))
  def save_now(ckpts, step: int, rows: list[int], why: str) -> None:
    """Saves ``rows`` of ``states`` at ``step`` and logs how fast."""
    t_save = time.perf_counter()
    workdir_lib.save_rows(ckpts, step, states, rows)
    seconds, size = time.perf_counter() - t_save, trial_bytes * len(rows)
    log(f"checkpoint of step {step} {why}: {size / 1e9:.2f} GB in "
        f"{seconds:.1f} s ({size / 1e6 / max(seconds, 1e-3):.0f} MB/s; "
        f"{size / SAVE_BYTES_PER_S:.1f} s kept for it)")
  first = start
  while running and start < total:
    idx = np.asarray(running)
    halt_at = None if stop_at is None else stop_at - trial_bytes * (
        len(running) if periodic else num) / SAVE_BYTES_PER_S
    groups = batches.groups(running, cfg.trials_per_vmap)
    subs = [_take(states, rows) for rows, _ in groups]
    data = [(n, keys.data[rows], _take(models_K, rows),
             None if chunks is None else chunks[rows], _take(hmms, rows))
            for rows, n in groups]
    group_vals = [stacked_vals(rows) for rows, _ in groups]  # not per eval
    progress.trials = len(running)
    # Each group's window draw in hand, (first step, draw); windows start at
    # multiples of ``window``, so a resumed run draws an uninterrupted one's.
    ahead: dict[int, tuple[int, Any]] = {}
    for step in range(start, total):
      parts = []
      for g, (n, data_keys, models, chunk, group_hmms) in enumerate(data):
        if get_window is None:
          batch = get_batch(data_keys, step, models, chunk)
        else:
          first = step - step % window
          if g not in ahead or ahead[g][0] != first:
            ahead[g] = (first, get_window(data_keys, first, models, chunk,
                                          group_hmms))
          batch = batches.step_of(ahead[g][1], step - first)
        subs[g], losses = train_step(subs[g], *batch, group_hmms)
        parts.append(losses[:n])  # a padded group's copies are dropped
      losses = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
      progress.add(jnp.mean(losses))
      curves.add_losses(idx, losses)
      done = step + 1
      if done % cfg.log_every == 0 or done == total:
        rate = progress.flush(
            done, None if ckpts is None else ckpts.latest_step(), paths.ckpt)
        curves.train(done, rate / len(idx))  # one trial's share
      is_eval = _is_eval(cfg, done)
      is_ckpt = is_eval or done % cfg.ckpt_every == 0
      stopped_now = []
      if is_ckpt or done in cfg.retain:
        for (rows, n), sub in zip(groups, subs):
          states = _put(states, rows[:n], _take(sub, np.arange(n)))
        retain(done, states)
        if is_eval:  # before the checkpoint, which holds the trials going on
          for (rows, n), sub, vals_N in zip(groups, subs, group_vals):
            evaluate(done, sub, rows, n, vals_N)
          stopped_now = stop_reached(done)
        if is_ckpt and ckpts is not None and stopped is not None:
          # Those stopped now go to stopped/ (or, when none runs on, stay:
          # orbax saves no empty arrays).
          if running and stopped_now:
            workdir_lib.save_rows(stopped, done, states, stopped_now)
          workdir_lib.save_rows(ckpts, done, states, running or stopped_now)
      if after_step is not None:
        after_step(done)
      if halt_at is not None and _clock() >= halt_at:
        for (rows, n), sub in zip(groups, subs):
          states = _put(states, rows[:n], _take(sub, np.arange(n)))
        # "deadline" (no stopped/): the stopped trials are in memory alone.
        save = (list(range(num)) if stopped is None
                else None if is_ckpt else running)
        if ckpts is not None and save is not None:
          save_now(ckpts, done, save, "at the deadline")
        _close(ckpts, retained, stopped)
        note = "" if ckpts is None else " (checkpointed: a rerun resumes there)"
        raise DeadlineReached(
            f"the deadline came at pretraining step {done} of {workdir}{note}")
      if stopped_now:
        break  # re-form the groups without the stopped trials
    start = done
  if (keep_by is not None and ckpts is not None and stopped is None
      and start > first and _clock() >= keep_by):
    save_now(ckpts, start, list(range(num)),
             "before a tuning the deadline would cut")
  _close(ckpts, retained, stopped)
  return [last.get(k, {}) for k in range(num)], states


def _close(*managers) -> None:
  for m in managers:
    if m is not None:
      m.close()
