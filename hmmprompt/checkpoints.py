"""Thin wrapper over orbax-checkpoint: periodic saves, keep the last k (or
all), resume the latest. Only finite states are ever saved."""

from __future__ import annotations

import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hmmprompt import sharding as sharding_lib


class _QuietOrbax(logging.Filter):
  """Drops orbax's INFO chatter (several lines per save) from absl logs."""

  def filter(self, record):
    return record.levelno >= logging.WARNING or "orbax" not in record.pathname


logging.getLogger("absl").addFilter(_QuietOrbax())


class Checkpoints:
  """Checkpoints of a train-state pytree under ``directory``: the ``keep``
  newest, or every one saved (``keep=None``: a directory of retained steps,
  :attr:`PretrainConfig.retain`)."""

  def __init__(self, directory: str, keep: int | None = 3):
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 (None: keep all), got {keep}")
    self.directory = os.path.abspath(directory)
    self._keep = keep
    self._mngr = self._open()

  def _open(self) -> ocp.CheckpointManager:
    # The handler named up front: a manager that has not saved yet
    # otherwise reads no item's metadata (item_tree).
    return ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=self._keep,
                                             create=True),
        item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    """The saved steps, ascending."""
    return sorted(self._mngr.all_steps())

  def item_tree(self, step: int):
    """The saved tree of ``step`` with each leaf's metadata (``.shape``),
    read without its arrays."""
    return self._mngr.item_metadata(step).tree

  def delete(self, step: int) -> None:
    self._mngr.delete(step)

  def save(self, step: int, state) -> None:
    bad = nonfinite_leaves(state)
    if bad:
      raise FloatingPointError(f"refusing to checkpoint a non-finite state at "
                               f"step {step} (first bad leaf {bad[0]})")
    self._mngr.save(step, args=ocp.args.StandardSave(state), force=True)
    self._mngr.wait_until_finished()

  def restore(self, abstract_state, step: int | None = None):
    """The state of ``step`` (default: the latest). A leaf of
    ``abstract_state`` without a sharding is restored replicated over all
    devices (of all processes: the data mesh), whatever topology saved it
    (orbax would otherwise insist on the saving one: a checkpoint of two
    processes, or of one process on two devices, would not load on one
    device)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    rep = sharding_lib.replicated(sharding_lib.data_mesh())
    abstract_state = jax.tree.map(
        lambda x: x if getattr(x, "sharding", None) is not None else
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abstract_state)
    return self._mngr.restore(step,
                              args=ocp.args.StandardRestore(abstract_state))

  def restore_latest(self, abstract_state, log=logging.warning):
    """``(step, state)`` of the newest readable checkpoint, or ``(None,
    None)`` if there is none. ``abstract_state``: the tree to fill, or a
    function of the step that gives it (checkpoints of different shapes).

    A checkpoint that fails to read (a partial copy, corrupted files) is
    reported through ``log`` with its step and the reason, and the next
    older one is tried: ``keep`` is there for this. Once one reads, the
    newer unreadable ones are moved to ``<directory>.damaged/`` (kept for a
    look, out of the way of the steps the run saves again).

    Raises:
      FileNotFoundError: checkpoints exist but none reads (each step's
        reason named; nothing is moved).
    """
    failed = []
    for step in sorted(self._mngr.all_steps(), reverse=True):
      try:
        state = self.restore(abstract_state(step) if callable(abstract_state)
                             else abstract_state, step)
      except Exception as e:  # pylint: disable=broad-except
        # orbax and tensorstore raise many types for unreadable files.
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"checkpoint at step {step} in {self.directory} is unreadable "
            f"({reason}); trying the one before")
        failed.append((step, reason))
        # orbax infers the item layout from what it read: a manager that
        # met a damaged step misreads the good ones, so start afresh.
        self._mngr.close()
        self._mngr = self._open()
        continue
      if failed:
        self._set_aside([s for s, _ in failed])
      return step, state
    if failed:
      raise FileNotFoundError(
          f"no readable checkpoint in {self.directory}: " + "; ".join(
              f"step {s}: {r}" for s, r in failed))
    return None, None

  def _set_aside(self, steps) -> None:
    if jax.process_index() == 0:
      aside = self.directory + ".damaged"
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        os.replace(os.path.join(self.directory, str(step)),
                   os.path.join(aside, f"{step}-{time.time_ns()}"))
    self._mngr.close()
    self._mngr = self._open()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)  # bfloat16 too


@jax.jit
def _finite_leaves(tree) -> jax.Array:
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                    if _is_float(x)] or [jnp.bool_(True)])


def nonfinite_leaves(tree) -> list[str]:
  """The paths of ``tree``'s floating leaves holding a NaN or an inf. The
  check runs where the leaves are, and only its verdicts come back (one
  small transfer: a BERT-width stack's state is gigabytes)."""
  paths = [jax.tree_util.keystr(p) for p, x in
           jax.tree_util.tree_leaves_with_path(tree) if _is_float(x)]
  finite = np.asarray(jax.device_get(_finite_leaves(tree)))
  return [p for p, ok in zip(paths, finite) if not ok]
