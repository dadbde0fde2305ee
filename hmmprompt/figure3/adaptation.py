"""The adaptation arms' report (docs/adaptation.md): per backbone, panel,
size and arm, its trainable parameters, accuracy, the paired difference
from the head against the pair's noise floor, the exact backbone's prompt
arm and the Bayes classifier beside it; ``adaptation.png``."""

import os

import numpy as np

from hmmprompt import files as files_lib
from hmmprompt import protocol
from hmmprompt.figure3 import noise
from hmmprompt.figure3.reporting import (_FIGURE3_ARMS, _LEFT_ARMS,
                                         _arm_label, _cell, table_section,
                                         mean_ci, smoke_note)
from hmmprompt.figure3.plots import write_png

_FAMILY_MARKERS = {"head": "s", "prompt": "o", "prefix": "^", "lora": "D",
                   "finetune": "P"}


def _adaptation_cells(lines) -> dict:
  """(backbone, panel, size) -> {(method, features): ((fewest, most
  trainable params: a deeper fallback's), label, {trial: %})}."""
  out: dict = {}
  for r in lines:
    label = _arm_label(r) + ("" if r.features == "raw" else f" ({r.features})")
    arm = out.setdefault((r.backbone, r.panel, r.size), {}).setdefault(
        (r.method, r.features), (set(), label, {}))
    arm[0].add(r.trainable_params or 0)
    arm[2].setdefault(r.trial, []).append(100.0 * r.test_accuracy)
  return {k: {m: ((min(n), max(n)), label, {
      t: float(np.mean(v)) for t, v in tr.items()})
              for m, (n, label, tr) in arms.items()} for k, arms in out.items()}


def pair_floor(floor: dict, backbone: str, a: str, b: str) -> float | None:
  """:func:`noise.difference_floor` of two result-line methods, each arm's
  floor under its own name or Figure 3's (``head``, ``prompt``)."""
  name = lambda m: m if (backbone, m) in floor else _LEFT_ARMS.get(m) or m
  return noise.difference_floor(floor, backbone, name(a), name(b))


def section(lines, floor: dict | None = None, bayes: dict | None = None
            ) -> str:
  """Markdown of the module's table where ``lines`` hold adaptation arms
  (``bayes``: :func:`read_bayes`'s), with draws above / within / below the
  head (within: :func:`pair_floor`; blank where either arm's is unmeasured)."""
  if not {r.method for r in lines} - _FIGURE3_ARMS:
    return ""
  cells, rows, bayes = _adaptation_cells(lines), [], bayes or {}
  for (b, panel, size), arms in sorted(cells.items()):
    head_name = "head_linear" if panel == "left" else "head_attention"
    if (panel, size) in bayes and b == "exact":
      rows.append((b, panel, size, "Bayes classifier (the ceiling)", "",
                   f"{bayes[(panel, size)]:.1f}", "", "", "", ""))
    for (method, features), (n, label, acc) in sorted(arms.items(),
                                                      key=lambda a: a[1][0]):
      head = arms.get((head_name, features))  # never across features
      ref = cells.get(("exact", panel, size), {}).get((
          "prompt_linear" if panel == "left" else "prompt_attention", features))
      d = np.array([v - head[2][t] for t, v in acc.items()
                    if head and t in head[2]])
      tie = pair_floor(floor or {}, b, method, head_name)
      mean = mean_ci(list(acc.values()))
      rows.append((b, panel, size, label,
                   "-".join(map(str, sorted(set(n)))), _cell(*mean, len(acc)),
                   _cell(*mean_ci(d), len(d)) if len(d) else "",
                   "" if tie is None or method == head_name else f"{tie:.1f}",
                   "" if not len(d) or tie is None or method == head_name
                   else f"{(d > tie).sum()} / {(abs(d) <= tie).sum()} / "
                   f"{(d < -tie).sum()}",
                   f"{np.mean(list(ref[2].values())) - mean[0]:.1f}"
                   if ref else ""))
  return table_section(
      "Adaptation arms: test accuracy (%), mean ± 95% interval (draws)",
      ("backbone", "panel", "size", "arm", "trainable params", "accuracy",
       "arm - head (paired)", "pair floor", "draws above / within floor / "
       "below head", "exact prompt - arm"), rows) + (
           "\nA blank pair floor: an arm's noise floor is not measured "
           "(docs/noise_floor.md); no draw is called above or below. A blank "
           "exact prompt - arm: no exact prompt arm of Figure 3's length "
           "(`--config.tune.prompt_len`) ran on these features at that size.\n")


def write_plot(lines, path: str, bayes: dict | None = None) -> None:
  """A panel per size: each arm's test accuracy (mean, 95% interval), an
  arm per column, a colour per backbone, a marker per method (hollow:
  tokens init); the head's mean dotted, the Bayes classifier's dashed."""
  plt, bayes, cells = files_lib.pyplot(), bayes or {}, _adaptation_cells(lines)
  panels = sorted({(p, s) for _, p, s in cells})
  cols = min(3, len(panels))
  rows = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 4.6 * rows),
                           squeeze=False, sharey=True)
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  rank = lambda a: (list(_FAMILY_MARKERS).index(a.split()[0]), int(
      "0" + "".join(c for c in a if c.isdigit())), a)
  low = 100.0
  for ax, (panel, size) in zip(axes.flat, panels):
    order = sorted({label for b in protocol.BACKBONES for _, label, _ in
                    cells.get((b, panel, size), {}).values()}, key=rank)
    for i, b in enumerate(protocol.BACKBONES):
      for (method, _), (_, label, acc) in cells.get((b, panel, size),
                                                   {}).items():
        mean, ci = mean_ci(list(acc.values()))
        ci = np.nan_to_num(ci)  # the band clipped to [0, 100]
        low = min(low, mean - ci)
        ax.errorbar(order.index(label) + 0.18 * (2 * i - 1), mean,
                    yerr=[[min(ci, mean)], [min(ci, 100 - mean)]],
                    color=f"C{i}", capsize=2, markersize=5,
                    marker=_FAMILY_MARKERS.get(label.split()[0], "x"),
                    fillstyle="none" if "tokens" in label else "full")
        if method.startswith("head_"):
          ax.axhline(mean, color=f"C{i}", ls=":", lw=0.8)
    if (panel, size) in bayes:
      ax.axhline(bayes[(panel, size)], color="k", ls="--", lw=0.8)
    ax.set_xticks(range(len(order)), order, rotation=55, ha="right", fontsize=7)
    ax.set(ylabel="test accuracy (%)",
           title=f"{panel}: {'|H|' if panel == 'left' else '|M||H|'} = {size}")
    ax.grid(alpha=0.3, axis="y")
  handles = [plt.Line2D([], [], color=f"C{i}", marker="o", ls="", label=b)
             for i, b in enumerate(protocol.BACKBONES)] + [
      plt.Line2D([], [], color="k", ls=":", label="head (each backbone's)"),
      plt.Line2D([], [], color="k", ls="--", label="Bayes classifier")]
  axes[0][0].legend(handles=handles, fontsize=7, loc="lower right")
  axes[0][0].set_ylim(max(low, 0.0) - 2, 102)  # shared: every panel
  write_png(path, fig, 120, smoke_note(lines))


BAYES = "bayes.jsonl"  # {"panel", "size", "accuracy"}: the Bayes classifier


def read_bayes(workdir: str) -> dict:
  """``{(panel, size): %}`` from DIR/bayes.jsonl (experiments.bayes_ceiling)."""
  return {(d["panel"], d["size"]): d["accuracy"]
          for d in files_lib.read_jsonl(os.path.join(workdir, BAYES))}
