"""Result files: atomic writes, typed lines, identities and workdir stamps.

Every write goes to a temporary file in the same directory, is flushed and
fsynced, then renamed over the target (``os.replace`` is atomic on POSIX):
a crash never leaves a half-written file behind. Results are typed lines
(:class:`Line` dataclasses), one JSONL line per finished cell, keyed for
resume; a workdir is known by the identity its :func:`stamp` records
(:mod:`hmmprompt.identity`), so that one workdir never mixes two setups.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from typing import Any, cast
from collections.abc import Iterable, Sequence

from hmmprompt import identity as identity_lib


def _file_mode() -> int:
  """The mode ``open()`` gives a new file: 0o666 less the umask. mkstemp
  makes its file 0o600, so results, reports and plots written through it
  would be unreadable to the people they are shared with. The umask is
  read by setting it (the only portable way), which is process-wide: once,
  at import, before any thread of ours runs."""
  mask = os.umask(0o022)
  os.umask(mask)
  return 0o666 & ~mask


_FILE_MODE = _file_mode()


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes ``data`` to ``path`` through a temporary file and a rename (a
  crash leaves the old file or the new one, never half of one), with the
  mode a plain ``open()`` would give it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                             suffix=os.path.basename(path))
  try:
    os.fchmod(fd, _FILE_MODE)
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


def pyplot():
  """``matplotlib.pyplot`` on the Agg backend (no display needed),
  imported on first use: the library never needs matplotlib otherwise."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


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


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
  """A markdown table's lines (header, rule, one line per row)."""
  return (["| " + " | ".join(map(str, header)) + " |",
           "|" + "---|" * len(header)]
          + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def stamp(path: str, identity: dict, what: str = "setup",
          write: bool = True) -> None:
  """Records ``identity`` (JSON) at ``path`` on a workdir's first use; on
  later uses checks that it is the same.

  Raises:
    ValueError: ``path`` records another identity; names every field that
      differs, so a workdir never holds results of two setups.
  """
  want = json.loads(json.dumps(identity))
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      had = json.load(f)
    identity_lib.check_same(had, want, os.path.dirname(path) or ".", what)
  elif write:
    atomic_write_text(path, json.dumps(want, indent=1, sort_keys=True))


class Line:
  """A typed result line: a frozen dataclass whose ``KEY_FIELDS`` name the
  fields a rerun looks up (:meth:`key`); written and read as one JSON
  object per line through :func:`append_lines` and :func:`read_lines`."""

  KEY_FIELDS: tuple[str, ...] = ()
  WHAT = "result line"  # what errors call a line

  def key(self) -> tuple:
    return tuple(getattr(self, f) for f in self.KEY_FIELDS)

  def to_json(self) -> dict:
    return dataclasses.asdict(cast(Any, self))  # subclasses are dataclasses

  @classmethod
  def from_json(cls, d: dict):
    """Raises ``ValueError`` naming missing or unknown fields."""
    return line_from_json(cls, d, cls.WHAT)


def read_lines(pattern: str, cls) -> list:
  """The lines of every JSONL file matching ``pattern`` (a path or a glob;
  sorted; [] if none) as ``cls`` (:func:`line_from_json`); ``ValueError``
  naming the file and line of a bad one."""
  out = []
  for path in sorted(glob.glob(pattern)):
    for i, d in enumerate(read_jsonl(path), 1):
      try:
        out.append(cls.from_json(d))
      except ValueError as e:
        raise ValueError(f"{path}:{i}: {e}") from None
  return out


def append_lines(path: str, lines: Iterable[Line]) -> None:
  """Appends typed lines to ``path`` (the file rewritten atomically)."""
  append_jsonl(path, [line.to_json() for line in lines])


def merge_lines(path: str, lines: Iterable[Line],
                ignore: Sequence[str] = ()) -> tuple[list, int, list]:
  """Adds to ``path`` the ``lines`` whose key it lacks; returns ``(added,
  kept, conflicts)``: the lines added, how many keys were already there,
  and those of them whose values differ (fields in ``ignore``, timings,
  aside). The file's lines win."""
  lines = list(lines)
  if not lines:
    return [], 0, []
  had = {r.key(): r for r in read_lines(path, type(lines[0]))}
  added, kept, conflicts = [], 0, []

  def values(r):
    return {k: v for k, v in r.to_json().items() if k not in ignore}

  for r in lines:
    if r.key() in had:
      kept += 1
      if values(had[r.key()]) != values(r):
        conflicts.append(r.key())
      continue
    had[r.key()] = r
    added.append(r)
  append_lines(path, added)
  return added, kept, conflicts


def write_archive(path: str, root: str, members: Sequence[str],
                  extra: dict[str, bytes] | None = None) -> None:
  """Writes a gzipped tar of ``root``'s ``members`` (relative paths) and
  ``extra`` (name -> contents) to ``path``, atomically."""
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    for name in members:
      tar.add(os.path.join(root, name), arcname=name, recursive=False)
    for name, blob in (extra or {}).items():
      info = tarfile.TarInfo(name)
      info.size, info.mtime = len(blob), int(time.time())
      tar.addfile(info, io.BytesIO(blob))
  atomic_write_bytes(path, buf.getvalue())


def read_archive(path: str, into: str, allowed: re.Pattern) -> list[str]:
  """Unpacks the regular files of the archive ``path`` into ``into``;
  returns their names. ``ValueError`` naming a member whose name
  ``allowed`` does not fully match, or that is no regular file, before
  anything is written: no path escapes ``into``."""
  with tarfile.open(path, "r:gz") as tar:
    members = tar.getmembers()
    for member in members:
      if not (member.isfile() and allowed.fullmatch(member.name)):
        raise ValueError(f"{path}: unexpected member {member.name!r}")
    for member in members:
      dest = os.path.join(into, member.name)
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      src = tar.extractfile(member)
      assert src is not None  # a regular file, checked above
      with src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
  return [m.name for m in members]
