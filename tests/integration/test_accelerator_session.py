"""experiments/accelerator_session.sh protocol's retry, and a second
command on the same machine, with a stand-in ``python`` on the PATH: the
script's own logic, no device and no model."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Answers the script's version line and its bias-check key "stub"; as
# in_chunks, writes an archive and exits 0 when its arguments hold
# exact_window=1 or STUB_RC is 0, else exits STUB_RC with no archive.
_STUB = r"""#!/usr/bin/env bash
[ "$1" = -c ] && { echo stub; echo "key: stub"; exit 0; }
[ "$2" = experiments.check_cudnn_bias ] && { echo check; exit "$CHECK_RC"; }
echo "in_chunks $*"
out=""
for a in "$@"; do case "$a" in --out=*) out=${a#--out=} ;; esac; done
if [[ "$*" == *exact_window=1* ]] || [ "$STUB_RC" = 0 ]; then
  echo '{}' > "$out/results.jsonl"
  tar czf "$out/figure3-chunk.tar.gz" -C "$out" results.jsonl
  exit 0
fi
exit "$STUB_RC"
"""


@pytest.mark.parametrize("rc,extra,runs", [
    (1, "", 2),  # a failure: once more with the targets in each step
    (0, "", 1),
    (124, "", 1),  # timeout's SIGTERM backstop: the deadline, no failure
    (1, "--config.pretrain.exact_window=4", 1),  # a window chosen: kept
])
def test_a_failed_chunk_runs_again_with_the_targets_inside_each_step(
    tmp_path, rc, extra, runs):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python").write_text(_STUB)
  (bin_dir / "python").chmod(0o755)
  out = tmp_path / "out"
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
             OUT=str(out), CHECK="0", RESULTS=str(tmp_path / "results"),
             STUB_RC=str(rc), EXTRA=extra, STATE=str(tmp_path / "state"))
  subprocess.run(["bash", "experiments/accelerator_session.sh", "protocol",
                  "200"], cwd=ROOT, env=env, check=True, timeout=60,
                 capture_output=True)
  calls = [line for line in (out / "protocol.log").read_text().splitlines()
           if line.startswith("in_chunks ")]
  assert len(calls) == runs, calls
  assert ("exact_window=1" in calls[-1]) == (runs == 2)
  assert "exact_window=1" not in calls[0]
  archives = sorted(p.parent.name for p in out.glob("*/figure3-chunk.tar.gz"))
  assert archives == ([str(runs)] if rc == 0 or runs == 2 else [])


@pytest.mark.parametrize("check_rc,stub_rc", [(0, 0), (1, 1)])
def test_a_second_command_on_the_machine_goes_on_from_the_first(
    tmp_path, check_rc, stub_rc):
  """Called at once, while the machine is warm: the second command starts
  from the first's last archive (not the committed results), skips the
  bias check and keeps its verdict, keeps the exact_window=1 fallback if
  the first took it, and computes in the first's workdir, which
  checkpoints only at a deadline's stop."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python").write_text(_STUB)
  (bin_dir / "python").chmod(0o755)
  state = tmp_path / "state"
  logs = []
  for n in (1, 2):
    out = tmp_path / f"out{n}"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               OUT=str(out), STATE=str(state), CHECK_RC=str(check_rc),
               STUB_RC=str(stub_rc))
    env.pop("RESULTS", None)
    subprocess.run(["bash", "experiments/accelerator_session.sh", "protocol",
                    "200"], cwd=ROOT, env=env, check=True, timeout=60,
                   capture_output=True)
    logs.append((out / "protocol.log").read_text().splitlines())
  checks = [sum(line == "check" for line in log) for log in logs]
  assert checks == [1, 0]
  first, second = ([line for line in log if line.startswith("in_chunks ")]
                   for log in logs)
  manual = "--config.pretrain.model.attention=manual"
  assert all((manual in c) == bool(check_rc) for c in first + second)
  assert "--results=docs/results/figure3-gpu" in first[0]
  assert f"--results={state}/results" in second[0]
  assert (state / "results" / "results.jsonl").exists()
  # A failed first chunk ran again with the targets inside each step; the
  # second command starts with them.
  assert [("exact_window=1" in c) for c in first] == (
      [False, True] if stub_rc else [False])
  assert ("exact_window=1" in second[0]) == bool(stub_rc)
  assert all({f"--workdir={state}/workdir", "--checkpoints=deadline"}
             <= set(c.split()) for c in first + second)


@pytest.mark.parametrize("listed,check_rc", [(True, 1), (False, 0), (False, 1)])
def test_the_bias_check_runs_once_per_jax_cudnn_and_gpu(
    tmp_path, listed, check_rc):
  """A key that passed before (a line of VERIFIED) skips the check, even
  where it would now fail; otherwise the check runs, and a pass writes the
  key to $OUT/cudnn_bias_verified to be committed."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python").write_text(_STUB)
  (bin_dir / "python").chmod(0o755)
  verified = tmp_path / "verified"
  verified.write_text("# a comment\nstub\n" if listed else "# a comment\n")
  out = tmp_path / "out"
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
             OUT=str(out), STATE=str(tmp_path / "state"), STUB_RC="0",
             CHECK_RC=str(check_rc), VERIFIED=str(verified),
             RESULTS=str(tmp_path / "results"))
  subprocess.run(["bash", "experiments/accelerator_session.sh", "protocol",
                  "200"], cwd=ROOT, env=env, check=True, timeout=60,
                 capture_output=True)
  log = (out / "protocol.log").read_text().splitlines()
  assert log.count("check") == (0 if listed else 1)
  calls = [line for line in log if line.startswith("in_chunks ")]
  manual = "--config.pretrain.model.attention=manual"
  assert calls and all((manual in c) == (check_rc and not listed)
                       for c in calls)
  written = out / "cudnn_bias_verified"
  assert written.exists() == (not listed and check_rc == 0)
  if written.exists():
    assert written.read_text() == "stub\n"
