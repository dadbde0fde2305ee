"""Atomic result files: a crash never leaves a half-written file behind.

Every write goes to a temporary file in the same directory, is flushed and
fsynced, then renamed over the target (``os.replace`` is atomic on POSIX).
JSONL results are one line per finished cell, so a rerun can skip them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tempfile
from typing import Any, Iterable


def atomic_write_bytes(path: str, data: bytes) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                             suffix=os.path.basename(path))
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def atomic_write_text(path: str, text: str) -> None:
  atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_png(path: str, fig, dpi: int = 110) -> None:
  """Saves a matplotlib figure as a PNG at ``path`` atomically (no half
  plot after a crash) and closes it. Takes the figure, so this module
  never imports matplotlib."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi)
  plt.close(fig)
  atomic_write_bytes(path, buf.getvalue())


def line_from_json(cls, d: dict, what: str) -> Any:
  """``cls(**d)`` for a dataclass of result lines; ``ValueError`` naming
  ``what`` and the unknown or missing fields (a file of another version,
  a hand edit)."""
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
  if unknown:
    raise ValueError(f"{what} has unknown fields {unknown}")
  try:
    return cls(**d)
  except TypeError as e:
    raise ValueError(f"{what} is incomplete: {e}") from None


def read_lines(path: str, cls, what: str) -> list:
  """The lines of a JSONL file as ``cls`` (:func:`line_from_json`; [] if
  missing); ``ValueError`` naming the file and line of a bad one."""
  out = []
  for i, d in enumerate(read_jsonl(path), 1):
    try:
      out.append(line_from_json(cls, d, what))
    except ValueError as e:
      raise ValueError(f"{path}:{i}: {e}") from None
  return out


def read_jsonl(path: str) -> list[dict]:
  """All records of a JSONL file ([] if missing).

  Raises:
    ValueError: a line that is not JSON (names the file and line).
  """
  if not os.path.exists(path):
    return []
  records = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      if line.strip():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{i} is not valid JSON ({e})") from e
  return records


def append_jsonl(path: str, records: Iterable[dict]) -> None:
  """Appends records by atomically rewriting the whole file."""
  lines = [json.dumps(r, sort_keys=True) for r in read_jsonl(path)]
  lines += [json.dumps(r, sort_keys=True) for r in records]
  atomic_write_text(path, "".join(line + "\n" for line in lines))
