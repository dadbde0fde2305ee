"""Every binary that writes to a directory refuses one it cannot use (a
file, or one it cannot create) before any work, as a usage error naming
it, saying nothing of resuming (issue 66: ``[Errno 17] File exists ...;
rerun the same command to resume (finished work is kept in FILE)``)."""

import os

import binaries  # tests/integration/binaries.py


def test_a_workdir_that_cannot_be_one_is_a_usage_error(tmp_path):
  a_file = str(tmp_path / "some-file")
  with open(a_file, "w") as f:
    f.write("kept")
  under = os.path.join(a_file, "w")  # cannot be created, even by root
  is_file = f"--workdir {a_file} is a file, not a directory"
  cannot = f"--workdir {under}: cannot create: {a_file} is a file"
  out = str(tmp_path / "out")
  workdirs = [([f"--workdir={a_file}"], is_file),
              ([f"--workdir={under}"], cannot)]
  cases = [(module, case) for module, theirs in [
      ("experiments.figure3.__main__", workdirs),
      ("experiments.pretrain", workdirs),
      ("experiments.pretraining_curve.__main__", workdirs),
      ("experiments.icl", workdirs),
      ("experiments.noise_floor", workdirs),
      ("experiments.in_chunks", [
          ([f"--out={out}", *args], refusal) for args, refusal in workdirs]
       + [([f"--out={a_file}"], f"--out {a_file} is a file, not a "
           f"directory"),
          ([f"--merge={a_file}", f"--results={under}"],
           f"--results {under}: cannot create: {a_file} is a file")])]
      for case in theirs]
  ends = binaries.run_binaries([(module, ["--preset=tiny", *args])
                                for module, (args, _) in cases])
  for (module, (args, refusal)), end in zip(cases, ends):
    assert end["returncode"] == 2, (module, args, end["stderr"][-2000:])
    assert end["stderr"].strip().splitlines() == [f"error: {refusal}"], (
        module, args, end["stderr"][-2000:])
  with open(a_file) as f:
    assert f.read() == "kept"
  assert not os.path.exists(out)


def test_a_missing_ginc_release_is_refused_before_any_workdir(tmp_path):
  """ICL on GINC's released HMMs, without them: one line pointing to the
  converter, and no workdir made; the converter names what it lacks."""
  out = str(tmp_path / "icl")
  end, lacks, unset = binaries.run_binaries([
      ("experiments.icl", [
          "--preset=tiny", "--config.concepts=released",
          "--config.released_path=/nonexistent/ginc.npz", f"--workdir={out}"]),
      ("experiments.ginc_release", [f"--source={tmp_path}",
                                    f"--out={out}.npz"]),
      ("experiments.ginc_release", [])])
  assert end["returncode"] == 2, end["stderr"][-2000:]
  [line] = end["stderr"].strip().splitlines()
  assert "/nonexistent/ginc.npz" in line and "experiments.ginc_release" in line
  assert not os.path.exists(out)
  assert (lacks["returncode"], unset["returncode"]) == (2, 2)
  assert lacks["stderr"].strip().splitlines() == [
      f"error: {tmp_path} lacks GINC's id_hmms.pkl, ood_hmms.pkl, "
      f"id_params.pkl, ood_params.pkl, fixed_params.pkl"], lacks["stderr"]
  assert unset["stderr"].strip().splitlines() == [
      "error: --source is required"], unset["stderr"]
