"""Peak memory and time of a Figure 3 sweep, bounded against unbounded
(docs/performance.md, "Bounded memory").

  python -m experiments.bench.bytes --preset=paper --workdir=/tmp/bench_mem

The sweep twice under ``/usr/bin/time -v``: in ``DIR/unbounded``
(``--config.lanes_per_vmap=0 --config.task_budget_mb=0``), then in
``DIR/bounded`` (the defaults). A rerun reuses their results (only the
time of a fresh directory means anything).
"""

import json
import os
import re
import sys

from absl import app
from absl import flags

from experiments.bench import harness

_PRESET = flags.DEFINE_string("preset", "paper", "figure3 preset")
_BACKBONE = flags.DEFINE_string("backbone", "exact", "exact | transformer")
_PANEL = flags.DEFINE_string("panel", "both", "left | right | both")
_WORKDIR = flags.DEFINE_string("workdir", None, "where both sweeps write",
                               required=True)

ARMS = {"unbounded": ["--config.lanes_per_vmap=0",
                      "--config.task_budget_mb=0"],
        "bounded": []}
_TIME_FIELDS = {  # field: its line in /usr/bin/time -v's output, its value
    "peak_rss_gb": (r"Maximum resident set size \(kbytes\): (\d+)",
                    lambda s: int(s) / 1e6),
    "user_s": (r"User time \(seconds\): ([\d.]+)", float),
    "sys_s": (r"System time \(seconds\): ([\d.]+)", float),
    "wall_s": (r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)",
               lambda s: sum(float(p) * 60 ** i
                             for i, p in enumerate(reversed(s.split(":")))))}


def run_arm(name: str, workdir: str) -> dict:
  """One sweep under ``/usr/bin/time -v``; its measured fields."""
  cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "experiments.figure3",
         f"--preset={_PRESET.value}", f"--backbone={_BACKBONE.value}",
         f"--panel={_PANEL.value}", f"--workdir={workdir}", *ARMS[name]]
  print("$", " ".join(cmd[2:]), flush=True)
  proc = harness.child(cmd, f"{name}: the sweep")
  out = {}
  for field, (pattern, value) in _TIME_FIELDS.items():
    if (m := re.search(pattern, proc.stderr)) is None:
      raise SystemExit(f"{name}: no {field!r} in /usr/bin/time's output")
    out[field] = value(m.group(1))
  return out


@harness.main(retain_freed_memory=False, devices=False)  # the sweeps: theirs
def main():
  if not os.path.exists("/usr/bin/time"):
    raise SystemExit("needs /usr/bin/time (GNU time) for peak RSS")
  workdir = os.path.abspath(_WORKDIR.value)  # the sweeps run in the root
  measured = {name: run_arm(name, os.path.join(workdir, name)) for name in ARMS}
  from hmmprompt.figure3 import schema  # pylint: disable=g-import-not-at-top
  a, b = ({r.key(): r for r in schema.read_results(os.path.join(
      workdir, name))} for name in ("unbounded", "bounded"))
  # The two arms share their setup fingerprint (runtime settings only).
  common = sorted(set(a) & set(b))
  if not common or len(common) != len(a) or len(a) != len(b):
    raise SystemExit(f"the arms' result lines differ in keys: {len(a)} vs "
                     f"{len(b)}, {len(common)} in common")
  acc_diff = [abs(a[k].test_accuracy - b[k].test_accuracy) for k in common]
  loss_diff = [abs(a[k].final_loss - b[k].final_loss) for k in common]
  print(f"\n{_PRESET.value} / {_BACKBONE.value} / {_PANEL.value}: "
        f"{len(common)} result lines")
  print("| arm | peak RSS | wall | user | sys |\n|---|---|---|---|---|")
  for name, m in measured.items():
    print(f"| {name} | {m['peak_rss_gb']:.2f} GB | {m['wall_s']:.0f} s | "
          f"{m['user_s']:.0f} s | {m['sys_s']:.0f} s |")
  ub, bd = measured["unbounded"], measured["bounded"]
  print(f"\nbounded / unbounded: peak RSS {bd['peak_rss_gb'] / ub['peak_rss_gb']:.2f}x, "
        f"wall {bd['wall_s'] / ub['wall_s']:.2f}x")
  print(f"test accuracy equal on {acc_diff.count(0.0)} of {len(common)} "
        f"lines (largest difference {max(acc_diff):.4f}); final loss within "
        f"{max(loss_diff):.2g}")
  print(json.dumps({"arms": measured, "lines": len(common),
                    "accuracy_equal": acc_diff.count(0.0),
                    "max_accuracy_diff": max(acc_diff),
                    "max_loss_diff": max(loss_diff)}))


if __name__ == "__main__":
  app.run(main)
