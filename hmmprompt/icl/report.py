"""In-context learning on GINC, its report: DIR/icl.md and DIR/icl.png."""

import os

import numpy as np

from hmmprompt import files as files_lib
from hmmprompt.figure3 import plots
from hmmprompt.figure3 import reporting
from hmmprompt.icl.setup import REFERENCE, get_setup, smoothing
from hmmprompt.icl.sweep import IclLine, read_icl_lines


def summarize(lines: list[IclLine], field: str = "test_accuracy") -> dict:
  """``{(protocol, length, curve): {k: [values]}}`` of ``field``: curves
  ``"exact <variant>"``, ``"transformer"`` (a value per seed; no infinite KL);
  ``("impossible", protocol, length)``: the exact zeros' impossible shares."""
  out: dict[tuple, dict[int, list[float]]] = {}
  for r in sorted(lines, key=lambda r: (r.protocol, r.length, r.examples)):
    curve = f"exact {r.variant}" if r.backbone == "exact" else "transformer"
    cell = out.setdefault((r.protocol, r.length, curve), {})
    if (value := getattr(r, field)) is not None:
      cell.setdefault(r.examples, []).append(value)
    if r.backbone == "exact" and r.variant == "0":
      out.setdefault(("impossible", r.protocol, r.length), {})[r.examples] = [
          r.impossible]
  return {key: cells for key, cells in out.items() if cells}


def _order(item) -> tuple:
  """By length: exact zeros, concept then mixture smoothings, transformers."""
  (a, b, c), _ = item
  if a == "impossible":
    return (c,)
  return (b, c == "transformer", () if c == "transformer"
          else smoothing(c.split()[1]))


def _table(summary: dict, proto: str, ks: list, scale: float, fmt: str
           ) -> list[list]:
  """Rows ``[length, curve, cells...]``: mean (± sd over seeds)."""
  cell = lambda v: (f"{scale * np.mean(v):{fmt}}" + (
      f" ± {scale * np.std(v):{fmt}}" if len(v) > 1 else ""))
  return [[length, curve] + [cell(cells[k]) if k in cells else "" for k in ks]
          for (p, length, curve), cells in sorted(summary.items(), key=_order)
          if p == proto]


def markdown(summary: dict, kls: dict, gaps: list, smoke: str = "") -> str:
  """DIR/icl.md: per protocol, accuracy (%) and the KL to the reference
  against ``k``, a row per (length, curve), the transformers' mean ± sd
  over seeds; ``smoke`` (:func:`reporting.smoke`) first where given."""
  ks = sorted({k for cells in summary.values() for k in cells})
  prompts = "these prompts" if smoke else "GINC's prompts"
  out = ["# In-context learning on GINC", ""] + ([smoke, ""] if smoke else [])
  out += [f"Accuracy (%) on {prompts} against k, the examples before the "
         "test one. `exact <variant>`: the mixture of the concepts with the "
         "exact zeros (`0`; an impossible prompt counts wrong), each "
         "concept's transitions smoothed by EPS (`concept:EPS`), or the "
         "mixture's (`mixture:EPS`: documents that may switch concept at "
         "any symbol). `transformer`: the causal transformers' mean ± sd "
         "over seeds (held-out next-symbol CE gaps to the Bayes CE: "
         f"{', '.join(f'{g:.3f}' for g in gaps)} nats). Then the mean KL "
         f"(nats) from `exact {REFERENCE}`'s predictive at the label "
         "position to each curve's (exact zeros: infinite, no row). A "
         "blank: the prompt does not fit that backbone's context.", ""]
  header = lambda first: ["length", first, *(f"k = {k}" for k in ks)]
  for proto in sorted({key[0] for key in summary} - {"impossible"}):
    imp = [[length, "impossible (exact 0), %"] + [
        f"{100 * cells[k][0]:.0f}" if k in cells else "" for k in ks]
           for (tag, p, length), cells in sorted(summary.items(), key=_order)
           if tag == "impossible" and p == proto]
    out += [f"## {proto}", "", "Accuracy (%):", ""] + files_lib.markdown_table(
        header("curve"), _table(summary, proto, ks, 100, ".1f") + imp) + [
            "", f"KL from `exact {REFERENCE}` (nats):", ""
        ] + files_lib.markdown_table(header("curve"), [
            r for r in _table(kls, proto, ks, 1, ".3f")
            if r[1] != f"exact {REFERENCE}"]) + [""]
  return "\n".join(out)


def _style(curve: str) -> dict:
  """Solid reference, dotted exact 0, faint smoothings, dashed transformers."""
  variant = curve.split()[-1]
  if curve == "transformer":
    return dict(ls="--", marker="s", alpha=1.0)
  mixture = variant != "0" and smoothing(variant)[0] == "mixture"
  return {REFERENCE: dict(ls="-", marker="o", alpha=1.0),
          "0": dict(ls=":", marker="None", alpha=1.0)}.get(variant, dict(
              ls="-.", marker="^" if mixture else "None", alpha=0.45))


def write_plot(summary: dict, kls: dict, path: str, smoke: str = "") -> None:
  """Accuracy (top) and KL to the reference (bottom, log) against ``k``
  (symlog), a column per protocol, a colour per length, the transformers'
  seeds' spread; the legend in room made beside them; a ``smoke`` title."""
  plt = files_lib.pyplot()
  protos = sorted({key[0] for key in summary} - {"impossible"})
  lengths = sorted({key[1] for key in summary if key[0] != "impossible"})
  ks = sorted({k for cells in summary.values() for k in cells})
  fig, axes = plt.subplots(2, len(protos), figsize=(5 * len(protos) + 2, 7),
                           squeeze=False, sharex=True, layout="constrained")
  curves = set()
  for row, (data, scale) in enumerate(((summary, 100), (kls, 1))):
    for ax, proto in zip(axes[row], protos):
      for (p, length, curve), cells in data.items():
        if p != proto or (row and curve == f"exact {REFERENCE}"):
          continue
        curves.add(curve)
        at = sorted(cells)
        mean = np.asarray([scale * np.mean(cells[k]) for k in at])
        color = f"C{lengths.index(length)}"
        ax.plot(at, mean, color=color, markersize=3, **_style(curve))
        if curve == "transformer":
          sd = np.asarray([scale * np.std(cells[k]) for k in at])
          ax.fill_between(at, mean - sd, mean + sd, color=color, alpha=0.15)
      ax.set(xscale="symlog", xticks=ks, xticklabels=[str(k) for k in ks])
      ax.grid(alpha=0.3)
      if row:
        ax.set(yscale="log", xlabel="k (examples in the prompt)",
               ylabel=f"KL from exact {REFERENCE} (nats)")
      else:
        ax.set(ylabel="accuracy (%)", title=proto, ylim=(-2, 102))
  line = plt.Line2D
  handles = ([line([], [], color=f"C{i}", lw=3, label=f"length {n}")
              for i, n in enumerate(lengths)]
             + [line([], [], color="k", markersize=3, label=c, **_style(c))
                for c in sorted(curves, key=lambda c: _order(((0, 0, c), 0)))])
  fig.legend(handles=handles, loc="outside right", fontsize=7, frameon=False)
  plots.write_png(path, fig, 110, smoke)


def write_report(workdir: str) -> str:
  """Writes DIR/icl.md and .png from DIR/icl.jsonl; returns the former."""
  lines = read_icl_lines(workdir)
  summary, kls = summarize(lines), summarize(lines, "kl")
  # Each seed's first line's gap (a dict keeps the last: lines reversed).
  gap = {r.variant: r.ce_gap for r in lines[::-1] if r.backbone != "exact"}
  tiny = get_setup("tiny")
  smoke = reporting.smoke(tiny.fingerprint() in {r.setup for r in lines},
                          f"the `tiny` preset's ({tiny.ginc.num_concepts} "
                          f"concepts of {tiny.ginc.num_symbols} symbols, not "
                          f"GINC's)", "`--preset=cpu` or docs/results/icl")
  text = markdown(summary, kls, [gap[s] for s in sorted(gap)], smoke)
  files_lib.atomic_write_text(os.path.join(workdir, "icl.md"), text)
  if summary:
    write_plot(summary, kls, os.path.join(workdir, "icl.png"), smoke)
  return text
