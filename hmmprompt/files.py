"""Result files: atomic writes, typed JSONL lines (:class:`Line`, keyed for
resume) and workdir stamps (:func:`stamp`: one workdir, one setup)."""

import contextlib
import dataclasses
import glob
import io
import json
import os
import re
import tarfile
import tempfile
import time
from typing import Any, cast
from collections.abc import Iterable, Iterator, Sequence

from hmmprompt import identity as identity_lib


# The mode open() gives a new file (mkstemp's 0o600 would hide results).
# Reading the umask sets it: once, at import, before threads.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_FILE_MODE = 0o666 & ~_UMASK


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
  """Re-raises an ``OSError`` that names no file (full disk) naming ``path``."""
  try:
    yield
  except OSError as e:
    if e.filename is not None:
      raise
    raise OSError(e.errno, e.strerror, path) from None


def atomic_write_bytes(path: str, data: bytes) -> None:
  """Writes ``data`` to ``path`` atomically, with a plain ``open()``'s mode."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-",
                             suffix=os.path.basename(path))
  try:
    os.fchmod(fd, _FILE_MODE)
    with naming(path), os.fdopen(fd, "wb") as f:
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
  """``matplotlib.pyplot`` on the Agg backend, imported on first use."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def atomic_write_png(path: str, fig, dpi: int = 110) -> None:
  """Saves a matplotlib figure as a PNG at ``path`` atomically; closes it."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi)
  plt.close(fig)
  atomic_write_bytes(path, buf.getvalue())


def read_jsonl(path: str) -> list[dict]:
  """A JSONL file's records ([] if missing); ``ValueError`` at a bad line."""
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
  atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n"
                                  for r in [*read_jsonl(path), *records]))


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]
                   ) -> list[str]:
  """A markdown table's lines (header, rule, one line per row)."""
  row = lambda r: "| " + " | ".join(map(str, r)) + " |"
  return [row(header), "|" + "---|" * len(header)] + [row(r) for r in rows]


def stamp(path: str, identity: dict, what: str = "setup",
          write: bool = True, defaults: dict | None = None) -> None:
  """Records ``identity`` (JSON) at ``path`` on a workdir's first use
  (``write``); later, ``ValueError`` naming every field that differs
  (``defaults``: :func:`identity.added_defaults`)."""
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      identity_lib.check_same(json.load(f), identity,
                              os.path.dirname(path) or ".", what, defaults)
  elif write:
    atomic_write_text(path, json.dumps(identity, indent=1, sort_keys=True))


class Line:
  """A typed result line: a frozen dataclass whose ``KEY_FIELDS`` name the
  fields a rerun looks up (:meth:`key`); see :func:`read_lines`."""

  KEY_FIELDS: tuple[str, ...] = ()
  WHAT = "result line"  # what errors call a line

  def key(self) -> tuple:
    return tuple(getattr(self, f) for f in self.KEY_FIELDS)

  def to_json(self) -> dict:
    return dataclasses.asdict(cast(Any, self))  # subclasses are dataclasses

  @classmethod
  def from_json(cls, d: dict):
    """``cls(**d)``; ``ValueError`` naming missing or unknown fields."""
    fields = {f.name for f in dataclasses.fields(cast(Any, cls))}
    if unknown := sorted(set(d) - fields):
      raise ValueError(f"{cls.WHAT} has unknown fields {unknown}")
    try:
      return cls(**d)
    except TypeError as e:
      raise ValueError(f"{cls.WHAT} is incomplete: {e}") from None


def read_lines(pattern: str, cls) -> list:
  """The lines of every JSONL file matching ``pattern`` (a path or a glob)
  as ``cls``; ``ValueError`` naming the file and line of a bad one."""
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
  and those whose values differ (``ignore`` aside; the file's win)."""
  if not (lines := list(lines)):
    return [], 0, []
  had = {r.key(): r for r in read_lines(path, type(lines[0]))}
  added, conflicts = [], []
  values = lambda r: {k: v for k, v in r.to_json().items() if k not in ignore}
  for r in lines:
    if r.key() not in had:
      had[r.key()] = r
      added.append(r)
    elif values(had[r.key()]) != values(r):
      conflicts.append(r.key())
  append_lines(path, added)
  return added, len(lines) - len(added), conflicts


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
  returns their names. ``ValueError`` (before any write) for a member that
  is no regular file or whose name ``allowed`` does not fully match."""
  with tarfile.open(path, "r:gz") as tar:
    members = tar.getmembers()
    for member in members:
      if not (member.isfile() and allowed.fullmatch(member.name)):
        raise ValueError(f"{path}: unexpected member {member.name!r}")
    for member in members:  # regular files (checked): extractfile gives one
      with cast(Any, tar.extractfile(member)) as src:
        atomic_write_bytes(os.path.join(into, member.name), src.read())
  return [m.name for m in members]
