"""Thin wrapper over orbax-checkpoint; only finite states are ever saved."""

import errno
import logging
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from hmmprompt import sharding as sharding_lib


def _quiet_orbax(record: logging.LogRecord) -> bool:
  """Drops orbax's INFO chatter from absl logs, and its threads' tracebacks
  of a failed write (:meth:`Checkpoints.save` raises it as an ``OSError``)."""
  return "orbax" not in record.pathname or (
      record.levelno >= logging.WARNING and not record.exc_info)


logging.getLogger("absl").addFilter(_quiet_orbax)


def _quiet_closed_loops(unraisable, default=sys.unraisablehook) -> None:
  """Drops tensorstore's ``Event loop is closed`` errors (~100 tracebacks) after
  a failed orbax call, whose own error is raised (and logged)."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed"):
    default(unraisable)


sys.unraisablehook = _quiet_closed_loops


def _quiet_tensorstore_tasks(record: logging.LogRecord) -> bool:
  """Drops asyncio's ``Task exception was never retrieved`` of tensorstore
  errors: a failed restore's sibling tasks (restore_latest logs the error)."""
  exc = record.exc_info[1] if record.exc_info else None
  return not (record.getMessage().startswith(
      "Task exception was never retrieved") and "tensorstore_spec=" in str(exc))


logging.getLogger("asyncio").addFilter(_quiet_tensorstore_tasks)


class Checkpoints:
  """The ``keep`` newest (``None``: all) checkpoints under ``directory``."""

  def __init__(self, directory: str, keep: int | None = 3):
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 (None: keep all), got {keep}")
    self.directory = os.path.abspath(directory)
    self._keep = keep
    self._mngr = self._open()

  def _open(self) -> ocp.CheckpointManager:
    # Named up front, or a manager that has not saved reads no metadata.
    options = ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True)
    return ocp.CheckpointManager(self.directory, options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    """The saved steps, ascending."""
    return sorted(self._mngr.all_steps())

  def item_tree(self, step: int):
    """``step``'s saved tree of leaf metadata (``.shape``), no arrays."""
    return self._mngr.item_metadata(step).tree

  def delete(self, step: int) -> None:
    self._mngr.delete(step)

  def save(self, step: int, state) -> None:
    """Saves ``state`` as ``step``. ``OSError`` (errno, directory) if the
    filesystem fails: before writing if free space is short (orbax's threads
    would print pages), or orbax's own (``ENOSPC``, ``EACCES``, ...)."""
    if bad := nonfinite_leaves(state):
      raise FloatingPointError(f"refusing to checkpoint a non-finite state at "
                               f"step {step} (first bad leaf {bad[0]})")
    need = sum(x.nbytes for x in jax.tree.leaves(state))
    if (free := shutil.disk_usage(self.directory).free) < need:
      raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (step {step}'s "
                    f"checkpoint needs {need / 1e6:.3g} MB, "
                    f"{free / 1e6:.3g} MB free)", self.directory)
    try:
      self._mngr.save(step, args=ocp.args.StandardSave(state), force=True)
      self._mngr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      # tensorstore reports the OS's error in its message only.
      if not (code := re.search(r"os_error_code='(\d+)'",
                                f"{e} {e.__cause__}")):
        raise
      raise OSError(int(code[1]), f"{os.strerror(int(code[1]))} (saving step "
                    f"{step})", self.directory) from None

  def restore(self, abstract_state, step: int | None = None):
    """The state of ``step`` (default: the latest), leaves without a
    sharding replicated over the data mesh whatever topology saved them."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    rep = sharding_lib.replicated(sharding_lib.data_mesh())
    abstract = jax.tree.map(
        lambda x: x if getattr(x, "sharding", None) is not None else
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), abstract_state)
    return self._mngr.restore(step, args=ocp.args.StandardRestore(abstract))

  def restore_latest(self, abstract_state, log=logging.warning):
    """``(step, state)`` of the newest readable checkpoint (or ``(None,
    None)``), ``abstract_state`` a tree or a function of the step; the newer
    unreadable ones are logged and moved to ``<directory>.damaged/``.
    ``FileNotFoundError`` if none reads (nothing is moved)."""
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
        # A manager that met a damaged step misreads the good ones.
        self._mngr.close()
        self._mngr = self._open()
        continue
      if failed:
        self._set_aside([s for s, _ in failed])
      return step, state
    if failed:
      raise FileNotFoundError(f"no readable checkpoint in {self.directory}: "
                              + "; ".join(f"step {s}: {r}" for s, r in failed))
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
  """Paths of ``tree``'s float leaves with a NaN or inf (checked on device)."""
  paths = [jax.tree_util.keystr(p) for p, x in
           jax.tree_util.tree_leaves_with_path(tree) if _is_float(x)]
  finite = np.asarray(jax.device_get(_finite_leaves(tree)))
  return [p for p, ok in zip(paths, finite) if not ok]
