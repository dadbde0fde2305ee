"""Figure 3's plot (``figure3.png``: accuracy against size per panel, the
paper's curves beside ours) and every report's PNG writer."""

import numpy as np

from hmmprompt import files as files_lib
from hmmprompt.figure3.reporting import (PAPER_LEFT, PAPER_RIGHT, SMOKE_TITLE,
                                         _label)

# An arm (hmm, method) keeps its marker and colour in both panels and on its
# paper curve (open, grey, dotted); backbones set line styles, features fills.
_ARM_STYLES = {("vanilla", "head_linear"): ("s", "C0"),
               ("vanilla", "prompt_linear"): ("o", "C3"),
               ("vanilla", "head_linear_lbfgs"): ("D", "C4"),
               ("vanilla", "finetune_linear"): ("P", "C1"),
               ("memory", "head_attention"): ("^", "C2"),
               ("memory", "prompt_attention"): ("v", "C6")}
_MORE_ARM_STYLES = (("X", "C5"), ("*", "C8"), ("h", "C9"), ("<", "C7"))
_PAPER_ARMS = {"prompt": ("vanilla", "prompt_linear"),  # in our keys
               "head": ("vanilla", "head_linear"),
               "memory": ("memory", "head_attention"),
               "vanilla": ("vanilla", "head_linear")}
_BACKBONE_LINES = {"exact": "-", "transformer": "--"}
_MORE_LINES = ("-.", (0, (5, 1, 1, 1, 1, 1)))
_FEATURE_FILLS = {"raw": "full", "log": "none", "standardized": "bottom"}
_MORE_FILLS = ("left", "top")
_PAPER_STYLE = dict(color="0.55", linestyle=":", fillstyle="none",
                    markersize=6, zorder=1.5)
# Curves tied at a size are drawn side by side: each of a panel's curves
# (and its band) _DODGE_PT points right of the one before, the first to the
# last at most _DODGE_SPAN apart; the paper's curves and all data stay put.
_DODGE_PT, _DODGE_SPAN = 5.5, 16.0


def _style(choices: dict, spares: tuple, seen: dict, key):
  """``choices[key]``, else ``key``'s spare (the same in every panel)."""
  return (choices[key] if key in choices
          else seen.setdefault(key, spares[len(seen) % len(spares)]))


def write_plot(summary: dict, path: str, note: str = "") -> None:
  """A panel per panel that ran: each curve's means and its 95% band beside
  the paper's curves; a smoke test's title where ``note`` (:func:`smoke`)."""
  plt = files_lib.pyplot()
  import matplotlib.transforms as mtransforms  # pylint: disable=g-import-not-at-top
  # The panels with result lines, left first; both where there are none.
  panels = [p for p in ("left", "right")
            if any(k[1] == p for k in summary)] or ["left", "right"]
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.2),
                           squeeze=False)
  seen: dict = {"arm": {}, "backbone": {}, "features": {}}
  arm_style = lambda a: _style(_ARM_STYLES, _MORE_ARM_STYLES, seen["arm"], a)
  prompted = any(k[1] == "right" and k[3].startswith("prompt")
                 for k in summary)  # Theorem 4.6's arm
  titles = {"left": (PAPER_LEFT, "hidden states |H|", "Head vs prompt tuning"),
            "right": (PAPER_RIGHT, "|M||H|", "Memory vs vanilla HMM"
                      + ("" if prompted else " (head tuning)"))}
  # Exact before transformer, head before prompt, raw features first.
  order = lambda k: (*k[:4], [*_FEATURE_FILLS, k[4]].index(k[4]), k[4])
  for ax, panel in zip(axes[0], panels):
    paper, xlabel, title = titles[panel]
    for name, pts in paper.items():
      xs = sorted(pts)
      ax.plot(xs, [pts[x] for x in xs], marker=arm_style(_PAPER_ARMS[name])[0],
              label=f"paper: {name}", **_PAPER_STYLE)
    ours = sorted((k for k in summary if k[1] == panel), key=order)
    step = min(_DODGE_PT, _DODGE_SPAN / max(len(ours) - 1, 1))
    for i, k in enumerate(ours):
      backbone, _, hmm, method, features = k
      xs = sorted(summary[k])
      m = np.array([summary[k][x][0] for x in xs])
      ci = np.nan_to_num(np.array([summary[k][x][1] for x in xs]))
      marker, color = arm_style((hmm, method))
      fill = _style(_FEATURE_FILLS, _MORE_FILLS, seen["features"], features)
      line = _style(_BACKBONE_LINES, _MORE_LINES, seen["backbone"], backbone)
      shift = ax.transData + mtransforms.ScaledTranslation(
          (i - (len(ours) - 1) / 2) * step / 72, 0, fig.dpi_scale_trans)
      # A white rim parts the full markers of curves tied at a size.
      rim = dict(markeredgecolor="white", markeredgewidth=0.7)
      ax.plot(xs, m, color=color, marker=marker, markersize=5.5,
              linestyle=line, fillstyle=fill, markerfacecoloralt="white",
              label=_label(k), transform=shift,
              **(rim if fill == "full" else {}))
      lo, hi = np.maximum(m - ci, 0), np.minimum(m + ci, 100)
      ax.fill_between(xs, lo, hi, color=color, alpha=0.08, linewidth=0,
                      transform=shift)
      # A shifted artist leaves the data limits alone: its data set them.
      ax.update_datalim(np.column_stack([xs + xs, np.concatenate([lo, hi])]))
    ax.autoscale_view()
    ax.set(xlabel=xlabel, ylabel="test accuracy (%)", ylim=(None, 102),
           title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, handlelength=3.5, ncol=2, loc="upper center",
              bbox_to_anchor=(0.5, -0.14), frameon=False)
  write_png(path, fig, 120, note)


def write_png(path: str, fig, dpi: int, note: str = "") -> None:
  """``fig`` laid out at ``path``; a smoke ``note``'s :data:`SMOKE_TITLE`."""
  if note:
    fig.suptitle(SMOKE_TITLE, color="firebrick", fontsize=11)
  if fig.get_layout_engine() is None:  # a constrained one lays out on draw
    fig.tight_layout()
  files_lib.atomic_write_png(path, fig, dpi=dpi)
