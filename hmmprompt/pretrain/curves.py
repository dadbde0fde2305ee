"""TensorBoard curves of a pretraining run: one TensorBoard run per trial.

Trial ``k``'s event files go to ``<workdir>/tb/trial_<k>/``
(:func:`trial_logdir`), beside ``metrics.jsonl``; ``tensorboard --logdir
<workdir>`` (a sweep's ``DIR/pretrain``) shows every trial while it trains.
Each quantity is written twice, against optimizer steps (``by_step/<name>``)
and against the tokens the trial has trained on (``by_tokens/<name>``,
``step * batch_size * chunk_len``), so runs of other batch sizes or context
lengths compare on one axis:

* ``train_loss``: the training loss, mean over the steps since the last log
  line (``log_every``);
* ``tokens_per_s``: the trial's training throughput over those steps (its
  stack's rate divided among the trials stepping; the first window counts
  compilation);
* ``mlm_ce``, ``bayes_ce``, ``ce_gap``, ``tv``: every held-out evaluation
  (its line of ``metrics.jsonl``).

The event format comes from tensorboardX (the ``tensorboard`` extra; no
TensorFlow): its protos and record checksums. Without it, or on a process
other than 0, :class:`Curves` writes nothing. Each write appends its
records and closes the file (a few hundred bytes per trial every
``log_every`` steps, never fsynced): a killed run keeps every point written
before the kill, and nothing needs closing (tensorboardX's
``SummaryWriter`` queues events to a thread and fsyncs each flush).

A resumed run opens a new event file in each trial's run and writes again
from its checkpoint's step. TensorBoard reads a run's files in name order
(the names carry the time), and a point at step ``s`` replaces the tag's
earlier points at steps ``>= s``: the curves show the resumed run, whose
losses and evaluations equal the lost ones (resumes are bit-exact) but for
the throughput and a first ``train_loss`` window that starts at the
checkpoint. :func:`read_scalars` reads a run back under the same rule,
which is TensorBoard's default loader's (checked with TensorBoard 2.21; its
legacy ``--load_fast=false`` loader keeps both points of a rewritten step).
"""

from __future__ import annotations

import glob
import os
import socket
import struct
import time
from collections.abc import Iterable
from typing import Any

import jax

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
  """One TFRecord: the length (little-endian u64) and its masked CRC32C,
  the data and its masked CRC32C."""
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data
          + struct.pack("<I", masked_crc32c(data)))


class _EventFile:
  """One event file, opened for each append: no handle outlives a write,
  so a crash leaves nothing to close."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    ns = time.time_ns()
    # TensorBoard reads a run's files in name order: seconds, then
    # nanoseconds put a resumed run's file after the one it continues, even
    # within one second (a crash and rerun in one process, as in the tests).
    self.path = os.path.join(logdir, f"events.out.tfevents.{ns // 10**9}."
                             f"{socket.gethostname()}.{ns}.{os.getpid()}")
    self.write([event_pb2.Event(wall_time=ns / 1e9,
                                file_version="brain.Event:2")])

  def write(self, events) -> None:
    with open(self.path, "ab") as f:
      f.write(b"".join(_frame(e.SerializeToString()) for e in events))


class Curves:
  """The event files of a run's trials (:func:`trial_logdir`), or nothing
  (``enabled`` false: no tensorboardX, or not process 0).

  Cheap by design: :meth:`add_losses` keeps each step's losses on the device
  (no transfer, no sync); :meth:`train` fetches them once per log line. A
  trial's file is created at its first point, so a rerun with nothing left
  to do adds none.
  """

  def __init__(self, workdir: str, tokens_per_step: int):
    self.workdir = workdir
    self.tokens_per_step = tokens_per_step  # per trial: batch_size * chunk_len
    self.enabled = available() and jax.process_index() == 0
    self._files: dict[int, _EventFile] = {}
    # (trials, losses_K) of each step since train()
    self._losses: list[tuple[Iterable[int], Any]] = []

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
    """Keeps one step's training losses ``losses_K [K]`` (row ``j`` is
    trial ``trials[j]``) for the next :meth:`train`."""
    if self.enabled:
      self._losses.append((trials, losses_K))

  def train(self, step: int, tokens_per_s: float) -> None:
    """Writes each trial's mean training loss over the steps kept since the
    last call, and its throughput, at ``step``."""
    kept, self._losses = self._losses, []
    if not self.enabled or not kept:
      return
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    # One transfer for the window; the stack may have changed inside it (a
    # trial stopped), so rows are matched to trials step by step.
    host = jax.device_get([losses_K for _, losses_K in kept])
    for (trials, _), losses_K in zip(kept, host):
      for j, k in enumerate(map(int, trials)):
        sums[k] = sums.get(k, 0.0) + float(losses_K[j])
        counts[k] = counts.get(k, 0) + 1
    for k in sorted(sums):
      self._write(k, step, {"train_loss": sums[k] / counts[k],
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
          summary_pb2.Summary.Value(tag=f"{axis}/{name}",
                                    simple_value=float(v))
          for name, v in values.items()])
      events.append(event_pb2.Event(wall_time=now, step=x, summary=summary))
    self._files[trial].write(events)


def _records(path: str):
  """The records of one event file; a torn last one (a writer killed
  mid-record) ends it, as TensorBoard waits for the rest."""
  with open(path, "rb") as f:
    blob = f.read()
  at = 0
  while at + 12 <= len(blob):
    header = blob[at:at + 8]
    (size,) = struct.unpack("<Q", header)
    end = at + 12 + size + 4
    if end > len(blob):
      return
    data = blob[at + 12:end - 4]
    if (struct.unpack("<I", blob[at + 8:at + 12])[0] != masked_crc32c(header)
        or struct.unpack("<I", blob[end - 4:end])[0] != masked_crc32c(data)):
      raise ValueError(f"{path}: corrupted record at byte {at}")
    yield data
    at = end


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """Each tag's points ``(step, value)`` in a TensorBoard run as TensorBoard
  shows them: the event files in name order, and a point at step ``s``
  replacing the tag's earlier points at steps ``>= s`` (a resumed run's
  rewrite). Values are float32, as stored.

  Raises:
    ImportError: tensorboardX is not installed.
    ValueError: a record fails its checksum (names the file).
  """
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
