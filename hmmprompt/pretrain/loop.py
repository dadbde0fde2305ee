"""The pretraining loop: resume, train, evaluate, checkpoint, stop.

The batch of step ``s`` is a pure function of ``(seed, s)``
(:func:`corpus.batch_at`), so a run resumed from an orbax checkpoint
continues exactly as an uninterrupted one (tested bit for bit).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import checkpoints as ckpt_lib
from hmmprompt import corpus as corpus_lib
from hmmprompt import models
from hmmprompt import sharding as sharding_lib
from hmmprompt.pretrain import evaluation as evaluate_lib
from hmmprompt.pretrain import train
from hmmprompt.pretrain import workdir as workdir_lib
from hmmprompt.pretrain.config import PretrainConfig


class Keys(NamedTuple):
  """The run's random streams, all from ``PRNGKey(cfg.seed)``."""

  init: jax.Array  # model parameters
  data: jax.Array  # training batches and their masks (folded with the step)
  corpus: jax.Array  # the fixed corpus (non-fresh presets)
  val: jax.Array  # held-out evaluation sequences

  @classmethod
  def of(cls, seed: int) -> "Keys":
    return cls(*jax.random.split(jax.random.PRNGKey(seed), 4))


class _Progress:
  """Collects per-step losses; logs rate and ETA every ``log_every`` steps
  and raises on a non-finite loss (naming the last good checkpoint)."""

  def __init__(self, cfg: PretrainConfig, start: int, log, trials: int = 1):
    self.cfg, self.log = cfg, log
    self.trials = trials  # models stepping together (tokens/s counts all)
    self.pending = []
    self.t_last, self.step_last = time.perf_counter(), start
    self.t_first = self.step_first = None

  def add(self, loss) -> None:
    self.pending.append(loss)

  def flush(self, done: int, last_ckpt: int | None, ckpt_dir: str) -> None:
    losses = np.asarray(jnp.stack(self.pending))
    self.pending = []
    if not np.all(np.isfinite(losses)):
      bad = done - len(losses) + int(np.argmin(np.isfinite(losses)))
      raise FloatingPointError(
          f"non-finite loss at step {bad + 1}; stopping. The last good "
          f"checkpoint (step {last_ckpt}) is in {ckpt_dir}; lower --lr or "
          f"raise --warmup_steps")
    now, total = time.perf_counter(), self.cfg.total_steps
    if self.t_first is None:  # exclude compilation from the rate
      self.t_first, self.step_first = now, done
    tokens = self.cfg.batch_size * self.cfg.corpus.chunk_len * self.trials
    rate = tokens * (done - self.step_last) / max(now - self.t_last, 1e-9)
    if done > self.step_first:
      sec_per_step = (now - self.t_first) / (done - self.step_first)
    else:
      sec_per_step = (now - self.t_last) / max(done - self.step_last, 1)
    self.log(f"step {done}/{total} loss {losses.mean():.4f} "
             f"{rate / 1e3:.1f}k tokens/s ETA "
             f"{sec_per_step * (total - done):.0f}s")
    self.t_last, self.step_last = now, done


def _reached(cfg: PretrainConfig, metrics: dict) -> bool:
  return (cfg.target_gap is not None
          and metrics.get("ce_gap", np.inf) <= cfg.target_gap)


def _is_eval(cfg: PretrainConfig, done: int) -> bool:
  return (done % cfg.eval_every == 0 or done == cfg.total_steps
          or done in cfg.cycle_ends)


def _may_stop(cfg: PretrainConfig, step: int) -> bool:
  """With cycles, an early stop happens only at the bottom of one."""
  return cfg.cycles is None or step in cfg.cycle_ends


def run(workdir: str, cfg: PretrainConfig, model: models.Model,
        log: Callable[[str], Any] = print,
        after_step: Callable[[int], Any] | None = None) -> dict:
  """Pretrains (or resumes) in ``workdir``; returns the final metrics.

  ``after_step(step)`` is called after each step's bookkeeping (tests use it
  to crash the process at a chosen point).

  Raises:
    ValueError: ``workdir`` holds another run, or the batch does not split
      over the devices.
    FloatingPointError: the loss became non-finite; the last checkpoint
      (from before) is kept.
  """
  paths = workdir_lib.prepare(workdir, cfg, model)
  mesh = sharding_lib.data_mesh()
  sharding_lib.check_batch(cfg.batch_size, mesh)
  keys = Keys.of(cfg.seed)
  ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=cfg.keep)

  # Resume: the latest checkpoint and the evaluations up to it.
  state = jax.device_put(train.init_state(keys.init, cfg),
                         sharding_lib.replicated(mesh))
  if ckpts.latest_step() is not None:
    state = ckpts.restore(state)
    log(f"resumed from step {ckpts.latest_step()}")
  start, total = int(state.step), cfg.total_steps
  metrics = workdir_lib.read_metrics(paths, upto=start)
  last = metrics[-1] if metrics else {}
  if (last and last["step"] == start and _may_stop(cfg, start)
      and _reached(cfg, last)):
    log(f"already reached the target gap at step {start}")
    ckpts.close()
    return last

  chunks = (None if cfg.corpus.fresh else
            corpus_lib.build_chunks(keys.corpus, model, cfg.corpus))
  get_batch = jax.jit(
      functools.partial(corpus_lib.batch_at, cfg=cfg.corpus,
                        batch_size=cfg.batch_size,
                        vocab_size=cfg.model.vocab_size),
      out_shardings=sharding_lib.batch_sharded(mesh))
  train_step = train.make_train_step(cfg, mesh)
  model_hmm = jax.device_put(models.as_hmm(model),
                             sharding_lib.replicated(mesh))
  val = evaluate_lib.validation_set(keys.val, model, cfg)
  progress = _Progress(cfg, start, log)
  # Training wall time summed over resumed runs (what "time per size" is).
  wall_before, t_run = last.get("wall_s", 0.0), time.perf_counter()

  def checkpoint(step, state, do_eval):
    ckpts.save(step, state)
    if not do_eval:
      return None
    m = {"step": step, **evaluate_lib.evaluate(state.params, cfg, val),
         "wall_s": wall_before + time.perf_counter() - t_run}
    metrics.append(m)
    workdir_lib.write_metrics(paths, metrics)
    log(f"step {step}: mlm_ce {m['mlm_ce']:.4f} bayes_ce "
        f"{m['bayes_ce']:.4f} gap {m['ce_gap']:.4f} tv {m['tv']:.4f}")
    return m

  for step in range(start, total):
    inputs, tokens, weights = get_batch(keys.data, step, model, chunks)
    state, loss = train_step(state, inputs, tokens, weights, model_hmm)
    progress.add(loss)
    done = step + 1
    if done % cfg.log_every == 0 or done == total:
      progress.flush(done, ckpts.latest_step(), paths.ckpt)
    is_eval = _is_eval(cfg, done)
    if is_eval or done % cfg.ckpt_every == 0:
      last = checkpoint(done, state, is_eval) or last
    if after_step is not None:
      after_step(done)
    if is_eval and _may_stop(cfg, done) and _reached(cfg, last):
      log(f"CE gap {last['ce_gap']:.4f} <= target {cfg.target_gap} at step "
          f"{done}: stopping")
      break
  if start == total and not metrics:
    last = checkpoint(total, state, True)
  ckpts.close()
  return last


def trial_keys(seed: int, num: int) -> Keys:
  """Trial ``k``'s streams are those of a single run with seed
  ``seed + k`` (:meth:`Keys.of`), stacked ``[K]``."""
  return jax.tree.map(lambda *ks: jnp.stack(ks),
                      *[Keys.of(seed + k) for k in range(num)])


def _take(tree, idx):
  return jax.tree.map(lambda x: x[idx], tree)


def run_trials(workdir: str, cfg: PretrainConfig, models_K: models.Model,
               log: Callable[[str], Any] = print,
               after_step: Callable[[int], Any] | None = None) -> list[dict]:
  """Pretrains (or resumes) K transformers of one config in ``workdir``, one
  per trial of ``models_K`` (:func:`models.random_models`), in one jitted
  step; returns each trial's final metrics (lines of ``metrics.jsonl``,
  which carry ``trial``).

  Trial ``k`` is the run of :func:`run` with ``seed = cfg.seed + k`` on
  model ``k`` (own init, batches and validation set; equal up to float
  rounding, tested). Each trial stops on its own at the target gap: it is
  dropped from the stack that steps (the stack shrinks, so a finished
  trial costs nothing), and its state stays in the checkpoint, which holds
  all K. A rerun resumes bit for bit: the trials still running follow from
  the evaluations up to the checkpoint. ``after_step`` as in :func:`run`.

  Raises:
    ValueError: ``models_K`` is not a stack, ``workdir`` holds another run
      (config, trial count, HMMs), or the batch does not split over the
      devices.
    FloatingPointError: a non-finite loss; the last checkpoint is kept.
  """
  num = models.num_trials(models_K)
  if num is None:
    raise ValueError("run_trials needs [K] stacked models "
                     "(models.random_models or models.stack); use run for "
                     "one model")
  paths = workdir_lib.prepare(workdir, cfg, models_K)
  mesh = sharding_lib.data_mesh()
  sharding_lib.check_batch(cfg.batch_size, mesh)
  keys = trial_keys(cfg.seed, num)
  ckpts = ckpt_lib.Checkpoints(paths.ckpt, keep=cfg.keep)
  rep = sharding_lib.replicated(mesh)

  states = jax.device_put(train.init_states(keys.init, cfg, num), rep)
  start = ckpts.latest_step() or 0
  if start:
    states = ckpts.restore(states)
    log(f"resumed {num} trials from step {start}")
  total = cfg.total_steps
  metrics = workdir_lib.read_metrics(paths, upto=start)
  last = {m["trial"]: m for m in metrics}
  stopped = {m["trial"] for m in metrics
             if _may_stop(cfg, m["step"]) and _reached(cfg, m)}
  running = [k for k in range(num) if k not in stopped]
  if not running or start >= total:
    ckpts.close()
    return [last.get(k, {}) for k in range(num)]

  hmms = jax.device_put(jax.vmap(models.as_hmm)(models_K), rep)
  chunks = (None if cfg.corpus.fresh else jnp.stack(
      [corpus_lib.build_chunks(keys.corpus[k], models.trial(models_K, k),
                               cfg.corpus) for k in range(num)]))
  get_batch = jax.jit(jax.vmap(
      functools.partial(corpus_lib.batch_at, cfg=cfg.corpus,
                        batch_size=cfg.batch_size,
                        vocab_size=cfg.model.vocab_size),
      in_axes=(0, None, 0, None if chunks is None else 0)),
                      out_shardings=sharding_lib.trial_batch_sharded(mesh))
  train_step = train.make_stacked_train_step(cfg, mesh)
  # Stopped trials are never evaluated again: no validation set for them.
  vals = {k: evaluate_lib.validation_set(keys.val[k],
                                         models.trial(models_K, k), cfg)
          for k in running}
  progress = _Progress(cfg, start, log, trials=len(running))
  wall_before = max((m.get("wall_s", 0.0) for m in metrics), default=0.0)
  t_run = time.perf_counter()

  def substack(running):
    idx = np.asarray(running)
    return (idx, _take(models_K, idx), _take(hmms, idx), keys.data[idx],
            None if chunks is None else chunks[idx])

  idx, sub_models, sub_hmms, sub_keys, sub_chunks = substack(running)
  sub = _take(states, idx)

  def merge(states, sub):
    return jax.tree.map(lambda full, part: full.at[idx].set(part), states,
                        sub)

  def evaluate(step, sub):
    wall = wall_before + time.perf_counter() - t_run
    for j, k in enumerate(running):
      m = {"trial": k, "step": step,
           **evaluate_lib.evaluate(_take(sub.params, j), cfg, vals[k]),
           "wall_s": wall}
      metrics.append(m)
      last[k] = m
      log(f"trial {k} step {step}: mlm_ce {m['mlm_ce']:.4f} bayes_ce "
          f"{m['bayes_ce']:.4f} gap {m['ce_gap']:.4f} tv {m['tv']:.4f}")
    workdir_lib.write_metrics(paths, metrics)

  ones = np.ones(len(running), bool)
  for step in range(start, total):
    batch = get_batch(sub_keys, step, sub_models, sub_chunks)
    sub, losses = train_step(sub, *batch, ones, sub_hmms)
    progress.add(jnp.mean(losses))
    done = step + 1
    if done % cfg.log_every == 0 or done == total:
      progress.flush(done, ckpts.latest_step(), paths.ckpt)
    is_eval = _is_eval(cfg, done)
    if is_eval or done % cfg.ckpt_every == 0:
      states = merge(states, sub)
      ckpts.save(done, states)
      if is_eval:
        evaluate(done, sub)
    if after_step is not None:
      after_step(done)
    if is_eval and _may_stop(cfg, done):
      now = [k for k in running if _reached(cfg, last[k])]
      for k in now:
        log(f"trial {k}: CE gap {last[k]['ce_gap']:.4f} <= target "
            f"{cfg.target_gap} at step {done}: stopping it")
      if now:
        running = [k for k in running if k not in now]
        if not running:
          break
        idx, sub_models, sub_hmms, sub_keys, sub_chunks = substack(running)
        sub = _take(states, idx)
        ones = np.ones(len(running), bool)
        progress.trials = len(running)
  ckpts.close()
  return [last.get(k, {}) for k in range(num)]
