"""The progress log (:class:`Progress`) and TensorBoard curves of a pretraining
run, one run per trial (:func:`trial_logdir`): ``train_loss``, ``tokens_per_s``
and the evaluations against steps (``by_step/``) and tokens (``by_tokens/``),
one append per write (a killed run keeps every point)."""

import glob
import os
import socket
import struct
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import files
from hmmprompt import sharding
from hmmprompt.backbones import transformer
from hmmprompt.pretrain.config import PretrainConfig

try:  # the `tensorboard` extra; without it nothing is written
  from tensorboardX.proto import event_pb2
  from tensorboardX.proto import summary_pb2
  from tensorboardX.record_writer import masked_crc32c
except ImportError:
  event_pb2 = summary_pb2 = masked_crc32c = None

TB_DIR = "tb"
EVAL_KEYS = ("mlm_ce", "bayes_ce", "ce_gap", "tv")
AXES = ("by_step", "by_tokens")


def available() -> bool:
  """Whether tensorboardX is installed (the ``tensorboard`` extra)."""
  return event_pb2 is not None


def trial_logdir(workdir: str, trial: int) -> str:
  """Trial ``trial``'s TensorBoard run in a pretraining ``workdir``."""
  return os.path.join(workdir, TB_DIR, f"trial_{trial}")


def _frame(data: bytes) -> bytes:
  """One TFRecord: the length (u64) and the data, each with its CRC."""
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data
          + struct.pack("<I", masked_crc32c(data)))


class _EventFile:
  """One event file, opened for each append."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    ns = time.time_ns()
    # TensorBoard reads files in name order: the nanoseconds put a resumed
    # run's file after the one it continues, even within one second.
    self.path = os.path.join(logdir, f"events.out.tfevents.{ns // 10**9}."
                             f"{socket.gethostname()}.{ns}.{os.getpid()}")
    self.write([event_pb2.Event(wall_time=ns / 1e9,
                                file_version="brain.Event:2")])

  def write(self, events) -> None:
    with files.naming(self.path), open(self.path, "ab") as f:
      f.write(b"".join(_frame(e.SerializeToString()) for e in events))


class Curves:
  """The event files of a run's trials, or nothing (``enabled`` false)."""

  def __init__(self, workdir: str, tokens_per_step: int):
    self.workdir = workdir
    self.tokens_per_step = tokens_per_step  # per trial: batch_size * chunk_len
    self.enabled = available() and jax.process_index() == 0
    self._files: dict[int, _EventFile] = {}
    self._losses: list[tuple[Iterable[int], Any]] = []  # (trials, losses_K)

  @property
  def status(self) -> str | None:
    """A log line saying where the curves go (or why none), on process 0."""
    if jax.process_index() != 0:
      return None
    if not self.enabled:
      return ("no TensorBoard curves: tensorboardX is not installed (pip "
              "install 'hmmprompt[tensorboard]')")
    return (f"TensorBoard curves: tensorboard --logdir "
            f"{os.path.join(self.workdir, TB_DIR)}")

  def add_losses(self, trials: Iterable[int], losses_K) -> None:
    """Keeps one step's ``losses_K [K]`` (row ``j``: trial ``trials[j]``)."""
    if self.enabled:
      self._losses.append((trials, losses_K))

  def train(self, step: int, tokens_per_s: float) -> None:
    """Writes each trial's mean loss since the last call, and throughput."""
    kept, self._losses = self._losses, []
    if not self.enabled or not kept:
      return
    losses: dict[int, list[float]] = {}
    # One transfer; rows match trials step by step (a trial may stop).
    for trials, losses_K in jax.device_get(kept):
      for k, loss in zip(map(int, trials), losses_K):
        losses.setdefault(k, []).append(float(loss))
    for k, ls in sorted(losses.items()):
      self._write(k, step, {"train_loss": sum(ls) / len(ls),
                            "tokens_per_s": tokens_per_s})

  def eval(self, line: dict) -> None:
    """Writes an evaluation (a ``metrics.jsonl`` line) at its step."""
    if self.enabled:
      self._write(line.get("trial", 0), line["step"],
                  {key: line[key] for key in EVAL_KEYS})

  def _write(self, trial: int, step: int, values: dict) -> None:
    if trial not in self._files:
      self._files[trial] = _EventFile(trial_logdir(self.workdir, trial))
    now, events = time.time(), []
    for axis, x in zip(AXES, (step, step * self.tokens_per_step)):
      summary = summary_pb2.Summary(value=[
          summary_pb2.Summary.Value(tag=f"{axis}/{name}", simple_value=float(v))
          for name, v in values.items()])
      events.append(event_pb2.Event(wall_time=now, step=x, summary=summary))
    self._files[trial].write(events)


def _records(path: str):
  """The records of one event file; a torn last one ends it."""
  with open(path, "rb") as f:
    blob = f.read()
  at = 0
  while at + 12 <= len(blob):
    (size,) = struct.unpack("<Q", blob[at:at + 8])
    end = at + 12 + size + 4
    if end > len(blob):
      return
    data = blob[at + 12:end - 4]
    if _frame(data) != blob[at:end]:  # either CRC wrong
      raise ValueError(f"{path}: corrupted record at byte {at}")
    yield data
    at = end


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """Each tag's points ``(step, value)`` (float32) in a TensorBoard run as
  TensorBoard shows them (a resumed run's rewrite replaces later points).
  ``ImportError`` without tensorboardX; ``ValueError`` on a bad checksum."""
  if not available():
    raise ImportError("reading event files needs tensorboardX: pip install "
                      "'hmmprompt[tensorboard]'")
  out: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(glob.glob(os.path.join(logdir, "*tfevents*"))):
    for data in _records(path):
      event = event_pb2.Event.FromString(data)
      for value in event.summary.value:
        points = out.setdefault(value.tag, [])  # steps increasing
        while points and points[-1][0] >= event.step:
          points.pop()
        points.append((event.step, value.simple_value))
  return out


class Progress:
  """Logs loss, rate and ETA; raises on a non-finite loss."""

  def __init__(self, cfg: PretrainConfig, start: int, log, trials: int = 1):
    self.cfg, self.log = cfg, log
    self.trials = trials  # tokens/s counts all the models stepping
    self.pending: list[jax.Array] = []
    self.t_last, self.step_last = time.perf_counter(), start
    self.first: tuple[float, int] | None = None  # (time, step)
    self.flops_per_token = transformer.train_flops_per_token(
        cfg.model, cfg.corpus.chunk_len)
    peak = sharding.peak_tflops(cfg.model.dtype)  # MFU where known (GPUs)
    self.peak_flops = peak and peak * 1e12 * jax.device_count()

  def add(self, loss) -> None:
    self.pending.append(loss)

  def flush(self, done: int, last_ckpt: int | None, ckpt_dir: str) -> float:
    """Logs the steps since the last flush; returns their tokens/s."""
    losses, self.pending = np.asarray(jnp.stack(self.pending)), []
    if not np.all(np.isfinite(losses)):
      bad = done - len(losses) + int(np.argmin(np.isfinite(losses)))
      raise FloatingPointError(
          f"non-finite loss at step {bad + 1}; stopping. The last good "
          f"checkpoint (step {last_ckpt}) is in {ckpt_dir}; lower --lr or "
          f"raise --warmup_steps")
    now, total = time.perf_counter(), self.cfg.total_steps
    # The ETA excludes compilation: it counts from the first flush.
    t_first, step_first = self.first = self.first or (now, done)
    tokens = self.cfg.batch_size * self.cfg.corpus.chunk_len * self.trials
    rate = tokens * (done - self.step_last) / max(now - self.t_last, 1e-9)
    sec_per_step = ((now - t_first) / (done - step_first) if done > step_first
                    else (now - self.t_last) / max(done - self.step_last, 1))
    mfu = (f" MFU {100 * rate * self.flops_per_token / self.peak_flops:.1f}%"
           if self.peak_flops else "")
    self.log(f"step {done}/{total} loss {losses.mean():.4f} {rate / 1e3:.1f}k "
             f"tokens/s{mfu} ETA {sec_per_step * (total - done):.0f}s")
    self.t_last, self.step_last = now, done
    return rate
