"""The curve's report: DIR/curve.md (:func:`markdown`) and DIR/curve.png
(:func:`write_plot`)."""

import os
from typing import Any, cast

import numpy as np

from hmmprompt import pretraining_curve as curve
from hmmprompt import files as files_lib
from hmmprompt.figure3 import plots
from hmmprompt.figure3 import reporting

WITHIN = 0.02  # "within 2 points of the exact backbone"
# The log x axis has no 0: a gap at or below this (float noise) is drawn here.
GAP_FLOOR = 1e-3


def _spearman(x, y) -> float:
  if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
    return float("nan")
  # Imported here: slow to import, and most processes never report.
  import scipy.stats  # pylint: disable=g-import-not-at-top
  return float(scipy.stats.spearmanr(x, y).statistic)


def _per_decade(gaps, deficits) -> float:
  """Least-squares slope of the accuracy deficit (points) against log10 of
  the CE gap: how much accuracy a tenfold larger gap costs."""
  x = np.log10(np.maximum(np.asarray(gaps, np.float64), GAP_FLOOR))
  if len(x) < 2 or np.ptp(x) == 0:
    return float("nan")
  return float(100 * np.polyfit(x, np.asarray(deficits, np.float64), 1)[0])


def summarize(lines: list[curve.CurveLine]) -> dict:
  """``{model: {method: {"steps": [Q], "gap", "tv", "acc", "sd": [Q],
  "exact": mean, "within": (step, gap) | None, "points": [(gap, tv,
  deficit)], "trial_points": [(gap, accuracy)]}}}``: means over trials at
  each checkpoint; ``within``: the first checkpoint from which every later
  one is within :data:`WITHIN` of the exact backbone; ``points``: per
  (trial, checkpoint), the accuracy below that trial's exact backbone."""
  out: dict[str, dict[str, dict[str, Any]]] = {}
  models_seen = {r.model: (r.hmm != "vanilla", r.num_states
                           * max(r.memory_size, 1)) for r in lines}
  for tag in sorted(models_seen, key=lambda t: models_seen[t]):
    mine = [r for r in lines if r.model == tag]
    for method in sorted({r.method for r in mine}):
      ours = [r for r in mine if r.method == method]
      ex = {r.trial: r.test_accuracy for r in ours if r.backbone == "exact"}
      tr = [r for r in ours if r.backbone == "transformer"]
      steps = sorted({cast(int, r.step) for r in tr})
      at = {s: [r for r in tr if r.step == s] for s in steps}
      means = lambda f: [float(np.mean([getattr(r, f) for r in at[s]]))
                         for s in steps]
      d: dict[str, Any] = {
          "steps": steps, "gap": means("ce_gap"), "tv": means("tv"),
          "acc": means("test_accuracy"), "sd": [
              float(np.std([r.test_accuracy for r in at[s]])) for s in steps],
          "exact": float(np.mean(list(ex.values()))) if ex else float("nan"),
          "points": [(r.ce_gap, r.tv, ex[r.trial] - r.test_accuracy)
                     for r in tr if r.trial in ex],
          "trial_points": [(r.ce_gap, r.test_accuracy) for r in tr]}
      close = [a >= d["exact"] - WITHIN for a in d["acc"]]
      first = next((i for i in range(len(steps)) if all(close[i:])), None)
      d["within"] = None if first is None else (steps[first], d["gap"][first])
      out.setdefault(tag, {})[method] = d
  return out


def _pct(x: float) -> str:
  return "" if np.isnan(x) else f"{100 * x:.1f}"


def markdown(summary: dict, smoke: str = "") -> str:
  """DIR/curve.md: per model, accuracy at each retained checkpoint beside
  the exact backbone; when each method comes within :data:`WITHIN` of it;
  rank correlations of the deficit with the CE gap and TV; ``smoke`` first."""
  out = ["# Accuracy against pretraining quality", "",
         *([smoke, ""] if smoke else []),
         "Test accuracy (%), mean ± sd over trials, at each retained "
         "checkpoint with its mean held-out CE gap to the Bayes CE (nats) "
         "and TV at MASK; `exact` is the exact backbone (perfect "
         "pretraining) on the same tasks.", ""]
  for tag, methods in summary.items():
    names = list(methods)
    first = methods[names[0]]
    rows = [[step, f"{first['gap'][i]:.4f}", f"{first['tv'][i]:.4f}"]
            + [f"{_pct(methods[n]['acc'][i])} ± {_pct(methods[n]['sd'][i])}"
               if i < len(methods[n]["acc"]) else "" for n in names]
            for i, step in enumerate(first["steps"])]
    rows.append(["exact", 0, 0] + [_pct(methods[n]["exact"]) for n in names])
    out += [f"## {tag}", ""] + files_lib.markdown_table(
        ["step", "CE gap", "TV", *names], rows) + [""]
  out += ["## Summary", "",
          f"Within {100 * WITHIN:.0f} points: the first checkpoint from "
          f"which the mean accuracy stays within {100 * WITHIN:.0f} points "
          f"of the exact backbone's (its step and mean CE gap). Spearman "
          f"ρ: over every (trial, checkpoint), the accuracy below the "
          f"trial's exact backbone (the deficit) against the CE gap and "
          f"against TV. Per decade: the least-squares slope of the deficit "
          f"(points) against log10 of the gap.", "",
          "| model | method | within (step, gap) | ρ(deficit, gap) | "
          "ρ(deficit, TV) | per decade |", "|---|---|---|---|---|---|"]
  pooled: dict[str, list] = {}
  for tag, methods in summary.items():
    for name, d in methods.items():
      pts = np.asarray(d["points"]).reshape(-1, 3)
      pooled.setdefault(name.split("_")[0], []).append(pts)
      w = ("never" if d["within"] is None
           else f"{d['within'][0]}, {d['within'][1]:.4f}")
      out.append(f"| {tag} | {name} | {w} | {_correlations(pts)}")
  out += [f"| all | {method} | | {_correlations(np.concatenate(parts))}"
          for method, parts in pooled.items()]
  return "\n".join(out) + "\n"


def _correlations(pts) -> str:
  """The summary row's last cells from ``[(gap, tv, deficit)]``."""
  return (f"{_spearman(pts[:, 0], pts[:, 2]):.2f} | "
          f"{_spearman(pts[:, 1], pts[:, 2]):.2f} | "
          f"{_per_decade(pts[:, 0], pts[:, 2]):.1f} |")


def write_plot(summary: dict, path: str, smoke: str = "") -> None:
  """Test accuracy against CE gap (log x), a panel per model: each method's
  means, each trial a faint dot, the exact one dashed; a ``smoke`` title."""
  fig, axes = files_lib.pyplot().subplots(
      1, len(summary), figsize=(4 * len(summary), 3.8), squeeze=False)
  for ax, (tag, methods) in zip(axes[0], summary.items()):
    for i, (name, d) in enumerate(methods.items()):
      color = f"C{i}"
      gaps = np.maximum(d["gap"], GAP_FLOOR)
      ax.plot(gaps, 100 * np.asarray(d["acc"]), "-o", color=color,
              label=name.replace("_", " "))
      if d["trial_points"]:
        gap_t, acc_t = np.asarray(d["trial_points"]).T
        ax.scatter(np.maximum(gap_t, GAP_FLOOR), 100 * acc_t, s=8,
                   color=color, alpha=0.3)
      for gap, step, acc in zip(gaps, d["steps"], d["acc"]):
        ax.annotate(str(step), (gap, 100 * acc), fontsize=6, alpha=0.6,
                    textcoords="offset points", xytext=(2, 3))
      ax.axhline(100 * d["exact"], color=color, linestyle="--", alpha=0.7,
                 label=f"exact: {name.replace('_', ' ')}")
    ax.set(xscale="log", xlabel="held-out CE gap to Bayes (nats)",
           ylabel="test accuracy (%)", title=tag)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  plots.write_png(path, fig, 110, smoke)


def write_curve_report(workdir: str) -> str:
  """Writes DIR/curve.md and .png from DIR/curve.jsonl; returns the former."""
  lines, tiny = curve.read_curve_lines(workdir), curve.get_setup("tiny")
  summary, smoke = summarize(lines), reporting.smoke(
      tiny.fingerprint() in {r.setup for r in lines}, f"the `tiny` preset's "
      f"(transformers of {tiny.pretrain.steps} steps)", "`--preset=cpu` or "
      "docs/results/pretraining-curve (docs/pretraining_curve.md)")
  text = markdown(summary, smoke)
  files_lib.atomic_write_text(os.path.join(workdir, "curve.md"), text)
  if summary:
    write_plot(summary, os.path.join(workdir, "curve.png"), smoke)
  return text
