"""experiments.cli: a workdir refused before any work, and a fault's line
that says "rerun the same command to resume" only where work was kept
(issue 66)."""

import os
import re

import pytest

from experiments import cli


def test_make_dir_creates_a_workdir_or_names_why_it_cannot(tmp_path):
  new = str(tmp_path / "a" / "b")
  assert cli.make_dir(new) == new and os.path.isdir(new)
  assert cli.make_dir(new) == new and os.listdir(new) == []  # no probe left
  a_file = tmp_path / "some-file"
  a_file.write_text("")
  # A parent that is a regular file stops even root (chmod does not).
  for path, refusal in [
      (str(a_file), f"--workdir {a_file} is a file, not a directory"),
      (str(a_file / "sub"), f"--workdir {a_file / 'sub'}: cannot create: "
       f"{a_file} is a file"),
      (str(a_file / "sub" / "deeper"), f"--workdir "
       f"{a_file / 'sub' / 'deeper'}: cannot create: {a_file} is a file")]:
    with pytest.raises(ValueError, match="^" + re.escape(refusal) + "$"):
      cli.make_dir(path)
  with pytest.raises(ValueError, match=r"^--out /proc/hmmprompt-66: cannot "
                     r"create: no such file or directory$"):
    cli.make_dir("/proc/hmmprompt-66", "--out")
  assert a_file.read_text() == ""


def test_a_fault_says_resume_only_where_work_was_kept(tmp_path):
  kept = tmp_path / "kept"
  kept.mkdir()
  (kept / "sweep.json").write_text("{}")
  assert cli.resume_hint(str(kept)) == (
      f"; rerun the same command to resume (finished work is kept in "
      f"{kept})")
  # Nothing started: a rerun starts afresh, and nothing is kept.
  (tmp_path / "empty").mkdir()
  for nothing in ("empty", "missing"):
    assert cli.resume_hint(str(tmp_path / nothing)) == ""
  # No --workdir: the binary's own outputs say what is kept.
  assert cli.resume_hint(None) == "; rerun the same command to resume"
