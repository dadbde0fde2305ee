"""hmmprompt.files: typed line files, merges, identities, workdir stamps
and archives, the mechanisms every experiment's resume rests on."""

import dataclasses
import io
import json
import os
import re
import tarfile

import pytest

from hmmprompt import identity as identity_lib
from hmmprompt import files
from hmmprompt.pretrain import curves


@dataclasses.dataclass(frozen=True)
class _Line(files.Line):
  name: str
  trial: int
  value: float
  seconds: float = 0.0

  KEY_FIELDS = ("name", "trial")
  WHAT = "test line"


def test_lines_append_read_and_merge_by_key(tmp_path):
  path = str(tmp_path / "lines.jsonl")
  a, b = _Line("x", 0, 1.0), _Line("x", 1, 2.0)
  files.append_lines(path, [a])
  files.append_lines(path, [b])
  assert files.read_lines(path, _Line) == [a, b]
  # A key already there keeps its line; other values under it are counted
  # as conflicts unless only an ignored (timing) field differs.
  added, kept, conflicts = files.merge_lines(path, [
      _Line("x", 0, 1.0, seconds=9.0), _Line("x", 1, 3.0), _Line("y", 0, 4.0)],
      ignore=("seconds",))
  assert added == [_Line("y", 0, 4.0)] and kept == 2
  assert conflicts == [("x", 1)]
  assert files.read_lines(path, _Line) == [a, b, _Line("y", 0, 4.0)]
  with open(path, "a") as f:
    f.write(json.dumps({"name": "z", "trial": 0, "value": 1, "bogus": 1})
            + "\n")
  with pytest.raises(ValueError, match=r"lines.jsonl:4: test line has "
                     r"unknown fields \['bogus'\]"):
    files.read_lines(path, _Line)


def test_fingerprint_is_of_the_content_not_the_order():
  assert (identity_lib.fingerprint({"a": 1, "b": [1, 2]})
          == identity_lib.fingerprint({"b": [1, 2], "a": 1}))
  assert identity_lib.fingerprint({"a": 1}) != identity_lib.fingerprint({"a": 2})
  assert len(identity_lib.fingerprint({}, digits=8)) == 8


def test_stamp_records_then_refuses_another_identity_naming_fields(tmp_path):
  path = str(tmp_path / "stamp.json")
  files.stamp(path, {"a": 1, "b": {"c": 2}}, write=False)
  assert not os.path.exists(path)  # a check only
  files.stamp(path, {"a": 1, "b": {"c": 2}})
  files.stamp(path, {"b": {"c": 2}, "a": 1})  # the same: fine
  with pytest.raises(ValueError, match=re.escape(
      "holds results of another setup (a: 1 -> 3; b.c: 2 -> absent; "
      "b.d: absent -> 4)")):
    files.stamp(path, {"a": 3, "b": {"d": 4}})
  # A key one side lacks is named by its default where one is given (an
  # identity.ADDED field at it, left out), and a default written out
  # equals it left out.
  with pytest.raises(ValueError, match=re.escape(
      "(b.c: 2 -> 0.0; b.d: 0.5 -> 4)")):
    files.stamp(path, {"a": 1, "b": {"d": 4}},
                defaults={"b": {"c": 0.0, "d": 0.5}})
  files.stamp(path, {"a": 1, "b": {"c": 2, "e": []}},
              defaults={"b": {"e": ()}})
  with open(path) as f:
    assert json.load(f) == {"a": 1, "b": {"c": 2}}  # untouched


def _tar(path, members):
  with tarfile.open(path, "w:gz") as tar:
    for name, kind in members:
      info = tarfile.TarInfo(name)
      if kind == "link":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
      else:
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))


def test_archives_round_trip_and_refuse_foreign_members(tmp_path):
  root = tmp_path / "root"
  (root / "sub").mkdir(parents=True)
  (root / "a.txt").write_text("A")
  (root / "sub" / "b.txt").write_text("B")
  archive = str(tmp_path / "x.tar.gz")
  files.write_archive(archive, str(root), ["a.txt", "sub/b.txt"],
                        {"run.json": b"{}"})
  allowed = re.compile(r"a\.txt|sub/b\.txt|run\.json")
  out = tmp_path / "out"
  assert files.read_archive(archive, str(out), allowed) == [
      "a.txt", "sub/b.txt", "run.json"]
  assert (out / "sub" / "b.txt").read_text() == "B"
  assert (out / "run.json").read_text() == "{}"
  # A path outside the allowed names (an escape) or a link is refused by
  # name, and nothing of that archive is written.
  for bad in [("../escape.txt", "file"), ("a.txt", "link")]:
    _tar(archive, [("run.json", "file"), bad])
    dest = tmp_path / f"dest-{bad[1]}"
    with pytest.raises(ValueError, match=re.escape(
        f"unexpected member {bad[0]!r}")):
      files.read_archive(archive, str(dest), allowed)
    assert not dest.exists()


def test_written_files_have_the_mode_open_would_give(tmp_path):
  """Results, reports and archives are shared: 0o666 less the umask (0644
  under the usual 022), not mkstemp's 0600."""
  mask = os.umask(0o022)
  os.umask(mask)
  want = 0o666 & ~mask
  paths = [str(tmp_path / "a.txt"), str(tmp_path / "b.bin"),
           str(tmp_path / "c.jsonl"), str(tmp_path / "d.tar.gz")]
  files.atomic_write_text(paths[0], "x")
  files.atomic_write_bytes(paths[1], b"x")
  files.append_jsonl(paths[2], [{"a": 1}])
  files.write_archive(paths[3], str(tmp_path), ["a.txt"])
  for path in paths:
    assert os.stat(path).st_mode & 0o777 == want, path


def test_a_write_to_a_full_disk_names_its_file(small_disk):
  """``write()`` raises ENOSPC naming no file; the atomic writes and the
  TensorBoard event files' appends name theirs (no temporary file left)."""
  disk = small_disk("size=64k")
  events = curves._EventFile(str(disk / "tb"))  # pylint: disable=protected-access
  for path, write in (
      (str(disk / "a.json"), lambda: files.atomic_write_bytes(
          str(disk / "a.json"), os.urandom(1 << 20))),
      (events.path, lambda: events.write([curves.event_pb2.Event(
          file_version="x" * (1 << 20))]))):
    with pytest.raises(OSError) as e:
      write()
    assert (e.value.errno, e.value.filename) == (28, path)
  assert [n for n in os.listdir(disk) if n.startswith(".tmp-")] == []


def test_the_package_is_typed_and_versioned():
  import tomllib
  import hmmprompt
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  assert hmmprompt.__version__ == project["project"]["version"]
  assert os.path.isfile(os.path.join(os.path.dirname(hmmprompt.__file__),
                                     "py.typed"))
  assert "py.typed" in project["tool"]["setuptools"]["package-data"][
      "hmmprompt"]


def test_the_lock_pins_every_runtime_dependency():
  """requirements.lock (the versions behind the committed results) pins
  every dependency pyproject.toml names, and each once."""
  import tomllib
  from packaging.requirements import Requirement
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
  norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
  with open(os.path.join(root, "requirements.lock")) as f:
    pins = [Requirement(l) for l in f.read().splitlines()
            if l and not l.startswith("#")]
  names = [norm(p.name) for p in pins]
  assert len(names) == len(set(names))
  assert all(str(p.specifier).startswith("==") for p in pins)
  versions = {norm(p.name): str(p.specifier)[2:] for p in pins}
  for dep in map(Requirement, deps):
    assert norm(dep.name) in versions, dep.name
    assert dep.specifier.contains(versions[norm(dep.name)]), dep
