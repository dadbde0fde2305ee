"""Pretraining report: a table of final gaps to Bayes, a plot of the curves."""

import glob
import math
import os
import re
from typing import Any

import numpy as np

from hmmprompt import files as files_lib
from hmmprompt.pretrain import workdir as pretrain_workdir

# protocol.pretrain_dir's name of a stack's part (rows from 0): its first trial.
_PART = re.compile(r"-trials(\d+)-\d+-[0-9a-f]+$")
# Drawn where a run's config sets no target (the cpu presets' gap).
TARGET_GAP = 0.04
PLOT = "pretraining.png"


def runs(workdir: str) -> list[tuple[str, Any, dict]]:
  """``(run name, PretrainConfig, {trial: [metrics lines]})`` of every run
  under ``DIR/pretrain/``, vanilla then memory, sizes numerically."""
  runs = []
  for mpath in glob.glob(os.path.join(workdir, "pretrain", "*",
                                      "metrics.jsonl")):
    run_dir = os.path.dirname(mpath)
    _, cfg = pretrain_workdir.read_config(pretrain_workdir.Paths.of(run_dir))
    by_trial: dict[int, list[dict]] = {}
    for m in files_lib.read_jsonl(mpath):
      by_trial.setdefault(m.get("trial", 0), []).append(m)
    name = os.path.basename(run_dir)
    first = int(part.group(1)) if (part := _PART.search(name)) else 0
    # A trial that fell back is reported by its deeper run, the one tuned.
    for k, ms in sorted(by_trial.items()):
      deep = pretrain_workdir.Paths.of(
          pretrain_workdir.fallback_dir(run_dir, k))
      if cfg.falls_back(ms[-1]) and os.path.exists(deep.metrics):
        del by_trial[k]
        runs.append((f"{name}/fallback-{k}",
                     pretrain_workdir.read_config(deep)[1],
                     {first + k: [{**m, "trial": first + k}
                                  for m in files_lib.read_jsonl(deep.metrics)]}))
    if by_trial:
      runs.append((name, cfg, {first + k: ms for k, ms in by_trial.items()}))
  return sorted(runs, key=lambda r: (
      not r[0].startswith("vanilla"),
      [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", r[0])]))


def table(runs) -> str:
  """Markdown: every trial's final held-out evaluation."""
  rows = [(name, k, ms[-1]) for name, _, by_trial in runs
          for k, ms in sorted(by_trial.items())]
  if not rows:
    return ""
  total = sum(max(m.get("wall_s", 0.0) for ms in by_trial.values()
                  for m in ms) for _, _, by_trial in runs)
  out = ["## Pretraining (transformer): held-out masked-position CE vs the "
         "exact Bayes CE", ""] + files_lib.markdown_table(
      ("model", "trial", "steps", "stack wall (s)", "mlm CE", "Bayes CE",
       "gap", "TV"),
      [(name, k, m["step"], f"{m.get('wall_s', float('nan')):.0f}",
        f"{m['mlm_ce']:.4f}", f"{m['bayes_ce']:.4f}", f"{m['ce_gap']:.4f}",
        f"{m['tv']:.4f}") for name, k, m in rows])
  gaps = np.array([m["ce_gap"] for _, _, m in rows])
  out += ["", f"{len(rows)} trials; gap median {np.median(gaps):.4f}, max "
          f"{gaps.max():.4f}; total pretraining wall time {total:.0f} s.", ""]
  return "\n".join(out)


# Trial colours without red, which marks the trials above the target.
_TRIAL_COLORS = [f"C{i}" for i in range(10) if i != 3]


def write_plot(runs, path: str) -> list[tuple[str, int]]:
  """Plots every trial's held-out gap (log scale, floored at 1e-3) against
  its training tokens, one panel per run, the target dashed, trials that
  ended above it red; returns those, ``(run name, trial)``."""
  cols = min(len(runs), 4)
  rows = math.ceil(len(runs) / cols)
  fig, axes = files_lib.pyplot().subplots(
      rows, cols, figsize=(4 * cols, 3.2 * rows), sharey=True, squeeze=False)
  stalled = []
  for ax, (name, cfg, by_trial) in zip(axes.flat, runs):
    target = cfg.target_gap or TARGET_GAP
    tokens_per_step = cfg.batch_size * cfg.corpus.chunk_len
    reached = 0
    for k, ms in sorted(by_trial.items()):
      x = [m["step"] * tokens_per_step for m in ms]
      gap = np.maximum([m["ce_gap"] for m in ms], 1e-3)
      ok = ms[-1]["ce_gap"] <= target
      reached += ok
      ax.plot(x, gap, "-", lw=1.0 if ok else 1.8, alpha=0.8 if ok else 1.0,
              color=_TRIAL_COLORS[k % len(_TRIAL_COLORS)] if ok else "red",
              marker="o" if ok else "X", markevery=[len(ms) - 1])
      if not ok:
        stalled.append((name, k))
        ax.annotate(f"trial {k}", (x[-1], gap[-1]), fontsize=7,
                    color="red", xytext=(3, 3), textcoords="offset points")
    ax.axhline(target, color="black", ls="--", lw=1, label=f"target {target:g}")
    ax.set(yscale="log", xlabel="training tokens per trial")
    ax.set_title(f"{name}: {reached}/{len(by_trial)} at target", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower left")  # early gaps are high
  for ax in axes[:, 0]:
    ax.set_ylabel("held-out CE gap to Bayes (nats)")
  for ax in list(axes.flat)[len(runs):]:
    ax.set_visible(False)
  fig.tight_layout()
  files_lib.atomic_write_png(path, fig, dpi=110)
  return stalled


def section(workdir: str) -> str:
  """Writes ``DIR/pretraining.png`` (:func:`write_plot`); returns
  :func:`table`, the plot linked, the stalled trials named ("" if none)."""
  if not (found := runs(workdir)):
    return ""
  text = table(found) + (
      f"\n![Held-out Bayes gap of every pretrained trial against training "
      f"tokens, one panel per model]({PLOT})\n")
  if stalled := write_plot(found, os.path.join(workdir, PLOT)):
    text += ("\nEnded above the target gap: "
             + ", ".join(f"{name} trial {k}" for name, k in stalled) + ".\n")
  return text


def write_report(workdir: str) -> str:
  """Writes ``DIR/pretraining.md`` (:func:`section`); returns it."""
  text = section(workdir)
  files_lib.atomic_write_text(os.path.join(workdir, "pretraining.md"), text)
  return text
