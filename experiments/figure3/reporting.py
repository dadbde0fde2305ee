"""The report: mean and 95% interval per curve, the table beside the
paper's numbers, the plot, and the table of pretrained models."""

from __future__ import annotations

import glob
import io
import os

import numpy as np

from experiments.figure3 import records
from hmmprompt import results as results_lib

# Read off the authors' Figure 3 (approximate), test accuracy in %.
PAPER_LEFT = {"prompt": {4: 100, 8: 97, 10: 93, 15: 87, 25: 75, 30: 75},
              "head": {4: 94, 8: 84, 10: 80, 15: 75, 25: 66, 30: 66}}
PAPER_RIGHT = {"memory": {8: 100, 12: 100, 20: 100, 28: 98},
               "vanilla": {8: 83, 12: 81, 20: 64, 28: 66}}

_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262,
        2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093,
        2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
        2.042]


def mean_ci(values) -> tuple[float, float]:
  """Mean and half-width of the 95% t-interval."""
  v = np.asarray(values, np.float64)
  if len(v) < 2:
    return float(v.mean()), float("nan")
  t = _T95[len(v) - 2] if len(v) - 1 <= len(_T95) else 1.96
  return float(v.mean()), float(t * v.std(ddof=1) / np.sqrt(len(v)))


def summarize(lines: list[records.ResultLine]) -> dict:
  """(backbone, panel, hmm, method, features) -> {size: (mean, ci, n)}."""
  buckets = {}
  for r in lines:
    buckets.setdefault(r.summary_key, {}).setdefault(r.size, []).append(
        100.0 * r.test_accuracy)
  return {k: {s: (*mean_ci(v), len(v)) for s, v in sorted(d.items())}
          for k, d in sorted(buckets.items())}


def _label(k) -> str:
  backbone, _, hmm, method, features = k
  return f"{backbone}: {hmm} + {method.replace('_', ' ')} ({features})"


def write_table(summary: dict, path: str, extra: str = "") -> None:
  out = ["# Figure 3: test accuracy (%)", "",
         "Mean ± 95% t-interval over seeds (n); paper values read off the "
         "authors' Figure 3 (approximate).", ""]
  for panel, title in (("left", "Left: head vs prompt tuning, vanilla HMM, "
                        "|X| = 10, x = |H|"),
                       ("right", "Right: memory HMM + attention head vs "
                        "vanilla HMM + linear head, x = |M||H|")):
    cols = [k for k in summary if k[1] == panel]
    if not cols:
      continue
    sizes = sorted({s for k in cols for s in summary[k]})
    paper = PAPER_LEFT if panel == "left" else PAPER_RIGHT
    head = ["size"] + [f"paper {p}" for p in paper] + [_label(k) for k in cols]
    out += [f"## {title}", "", "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head)]
    for s in sizes:
      row = [str(s)]
      row += [f"~{paper[p][s]}" if s in paper[p] else "" for p in paper]
      for k in cols:
        if s in summary[k]:
          m, ci, n = summary[k][s]
          row.append(f"{m:.1f} ± {ci:.1f} ({n})" if np.isfinite(ci)
                     else f"{m:.1f} ({n})")
        else:
          row.append("")
      out.append("| " + " | ".join(row) + " |")
    out.append("")
  if extra:
    out.append(extra)
  results_lib.atomic_write_text(path, "\n".join(out))


def write_plot(summary: dict, path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  colors = {}  # one colour per (backbone, hmm, method); style per features
  for ax, panel, paper, xlabel in (
      (axes[0], "left", PAPER_LEFT, "hidden states |H|"),
      (axes[1], "right", PAPER_RIGHT, "|M||H|")):
    for name, pts in paper.items():
      xs = sorted(pts)
      ax.plot(xs, [pts[x] for x in xs], ":", color="gray", alpha=0.7,
              marker="x", label=f"paper: {name}")
    for k, d in summary.items():
      if k[1] != panel:
        continue
      xs = sorted(d)
      m = np.array([d[x][0] for x in xs])
      ci = np.nan_to_num(np.array([d[x][1] for x in xs]))
      style = "-" if k[4] == "raw" else "--"
      color = colors.setdefault(k[:4], f"C{len(colors)}")
      marker = {"exact": "s", "transformer": "o"}.get(k[0], "^")
      ax.plot(xs, m, style, marker=marker, color=color, label=_label(k))
      ax.fill_between(xs, np.maximum(m - ci, 0), np.minimum(m + ci, 100),
                      color=color, alpha=0.12)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(top=101)
    ax.set_title({"left": "Head vs prompt tuning",
                  "right": "Memory vs vanilla HMM (head tuning)"}[panel])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=120)
  plt.close(fig)
  results_lib.atomic_write_bytes(path, buf.getvalue())


def pretraining_table(workdir: str) -> str:
  """Markdown: the final held-out evaluation of every pretrained model."""
  rows = []
  for path in sorted(glob.glob(os.path.join(workdir, "pretrain", "*",
                                            "metrics.jsonl"))):
    metrics = results_lib.read_jsonl(path)
    if metrics:
      rows.append((os.path.basename(os.path.dirname(path)), metrics[-1]))
  if not rows:
    return ""
  out = ["## Pretraining (transformer): held-out masked-position CE vs the "
         "exact Bayes CE", "",
         "| model | steps | wall (s) | mlm CE | Bayes CE | gap | TV | "
         "gap <= 0.05 |", "|---|---|---|---|---|---|---|---|"]
  for name, m in rows:
    out.append(f"| {name} | {m['step']} | {m.get('wall_s', float('nan')):.0f}"
               f" | {m['mlm_ce']:.4f} | {m['bayes_ce']:.4f} | "
               f"{m['ce_gap']:.4f} | {m['tv']:.4f} | "
               f"{'yes' if m['ce_gap'] <= 0.05 else 'NO'} |")
  total = sum(m.get("wall_s", 0.0) for _, m in rows)
  out += ["", f"Total pretraining wall time: {total:.0f} s.", ""]
  return "\n".join(out)


def report(workdir: str) -> dict:
  """Writes ``figure3.md`` and ``figure3.png``; returns the summary."""
  summary = summarize(records.read_results(workdir))
  write_table(summary, os.path.join(workdir, "figure3.md"),
              extra=pretraining_table(workdir))
  write_plot(summary, os.path.join(workdir, "figure3.png"))
  return summary
