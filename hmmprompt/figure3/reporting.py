"""The report: mean and 95% interval per curve beside the paper's numbers,
the plot, and the pretrained models' table and gap curves."""

import os
import shlex

import numpy as np

from hmmprompt.figure3 import configs
from hmmprompt.figure3 import noise
from hmmprompt.figure3 import schema
from hmmprompt import files as files_lib
from hmmprompt import protocol
from hmmprompt.pretrain import report as pretrain_report

# Read off the authors' Figure 3 (approximate), test accuracy in %.
PAPER_LEFT = {"prompt": {4: 100, 8: 97, 10: 93, 15: 87, 25: 75, 30: 75},
              "head": {4: 94, 8: 84, 10: 80, 15: 75, 25: 66, 30: 66}}
PAPER_RIGHT = {"memory": {8: 100, 12: 100, 20: 100, 28: 98},
               "vanilla": {8: 83, 12: 81, 20: 64, 28: 66}}

# Arms beyond the paper's (Setup.prompt_attention, Setup.head_optimum):
# their column names, and a note under a table that shows them.
_ARMS = {
    "head_linear_lbfgs": ("head optimum", "the linear head solved to its "
                          "L2-regularised optimum on the frozen features "
                          "(full-batch L-BFGS, TuneConfig.optimizer = "
                          "lbfgs) instead of the paper's epochs of Adam."),
    "prompt_attention": ("attention prompt", "prompt tuning with the "
                         "attention head on the memory HMM (Theorem 4.6)."),
}


def mean_ci(values) -> tuple[float, float]:
  """Mean and half-width of the 95% t-interval."""
  v = np.asarray(values, np.float64)
  if len(v) < 2:
    return float(v.mean()), float("nan")
  # Imported here: slow to import, and most processes never report.
  import scipy.stats  # pylint: disable=g-import-not-at-top
  t = scipy.stats.t.ppf(0.975, len(v) - 1)
  return float(v.mean()), float(t * v.std(ddof=1) / np.sqrt(len(v)))


def _cells(lines) -> list[tuple]:
  """Sorted ``(curve key, size, per trial its tasks' test accuracies (%))``."""
  cells: dict = {}
  for r in lines:
    cells.setdefault((r.summary_key, r.size), {}).setdefault(
        r.trial, []).append(100.0 * r.test_accuracy)
  return [(k, size, list(by_trial.values()))
          for (k, size), by_trial in sorted(cells.items())]


def summarize(lines: list[schema.ResultLine]) -> dict:
  """(backbone, panel, hmm, method, features) -> {size: (mean, ci, n)}:
  over ``n`` trials, each trial's tasks averaged first; with one trial,
  over its ``n`` tasks (task noise only)."""
  out: dict = {}
  for k, size, trials in _cells(lines):
    values = [np.mean(v) for v in trials] if len(trials) > 1 else trials[0]
    out.setdefault(k, {})[size] = (*mean_ci(values), len(values))
  return out


def variance_components(lines: list[schema.ResultLine]) -> dict:
  """Curve key -> {size: (SD of the trial means, pooled SD of tasks around
  their trial's mean)} in points, where >= 2 trials have >= 2 tasks."""
  out: dict = {}
  for k, size, trials in _cells(lines):
    if len(trials) < 2 or min(len(v) for v in trials) < 2:
      continue
    between = np.std([np.mean(v) for v in trials], ddof=1)
    dev = [x - np.mean(v) for v in trials for x in v]
    dof = sum(len(v) - 1 for v in trials)
    within = np.sqrt(np.sum(np.square(dev)) / dof)
    out.setdefault(k, {})[size] = (float(between), float(within))
  return out


def trial_table(lines: list[schema.ResultLine]) -> str:
  """Markdown, one row per (backbone, panel, size, trial): HMM
  fingerprint, pretraining gap and mean accuracy in every arm."""
  out = ["## Per trial (HMM draw): test accuracy (%), mean over its tasks", ""]
  panels: dict = {}
  for r in lines:
    panels.setdefault((r.backbone, r.panel), []).append(r)
  for (backbone, panel), rs in sorted(panels.items()):  # left before right
    arms = sorted({(r.hmm, r.method, r.features) for r in rs})
    rows: dict = {}
    for r in rs:
      row = rows.setdefault((r.size, r.trial), {"fp": {}, "gap": {}})
      row["fp"][r.hmm] = r.hmm_fingerprint
      if r.pretrain_ce_gap is not None:  # a fallback's depth named
        row["gap"][r.hmm] = f"{r.pretrain_ce_gap:.4f}" + (
            f" ({r.pretrain_layers} layers)" if r.pretrain_layers else "")
      row.setdefault((r.hmm, r.method, r.features), []).append(
          100.0 * r.test_accuracy)
    hmms = sorted({a[0] for a in arms})
    gaps = hmms if backbone == "transformer" else []
    head = (["size", "trial"] + [f"{h} HMM" for h in hmms]
            + [f"{h} gap" for h in gaps]
            + [f"{h}: {_method_label(m)} ({f})" for h, m, f in arms])
    out += [f"### {backbone}, {panel} panel", ""] + files_lib.markdown_table(
        head, [[size, trial] + [row["fp"].get(h, "") for h in hmms]
               + [row["gap"].get(h, "") for h in gaps]
               + [f"{np.mean(row[a]):.1f}" if a in row else "" for a in arms]
               for (size, trial), row in sorted(rows.items())]) + [""]
  return "\n".join(out) if lines else ""


def wins_table(lines: list[schema.ResultLine], floor: dict | None = None
               ) -> str:
  """Markdown: per backbone and left-panel size, on how many draws prompt
  tuning beats head tuning (each draw's tasks averaged). With ``floor``
  (:func:`noise.read_floor`), a difference within the backbone's
  :func:`noise.difference_floor` is a tie, not a win; without, only
  equal accuracies tie."""
  by: dict = {}
  for r in lines:
    if r.panel == "left":
      by.setdefault((r.backbone, r.features, r.size), {}).setdefault(
          r.trial, {}).setdefault(r.method, []).append(r.test_accuracy)
  rows = []
  for (backbone, features, size), trials in sorted(by.items()):
    pairs = [(np.mean(m["prompt_linear"]), np.mean(m["head_linear"]))
             for m in trials.values()
             if "prompt_linear" in m and "head_linear" in m]
    if pairs:
      p, h = 100 * np.array(pairs).T
      tie = noise.difference_floor(floor or {}, backbone) or 0.0
      rows.append((backbone, features, size, len(pairs),
                   int((p - h > tie).sum()), int((abs(p - h) <= tie).sum()),
                   int((h - p > tie).sum())))
  return _section("Prompt vs head tuning, draw by draw (left panel)",
                  ("backbone", "features", "size", "draws", "prompt wins",
                   "ties", "head wins"), rows)


def _points(x: float) -> str:
  """``x`` to a tenth; blank where not measured (NaN)."""
  return "" if np.isnan(x) else f"{x:.1f}"


def noise_floor_command(workdir: str, lines) -> str:
  """The command measuring the noise floor of ``workdir``'s ``lines``:
  their left panel's backbones, sizes, draws (at most 5) and arms; the
  binary reads the setup from the workdir."""
  arms = set(_LEFT_ARMS) | ({r.method for r in lines} - _FIGURE3_ARMS)
  rs = [r for r in lines if r.panel == "left" and r.method in arms]  # left
  ran = {"backbone": {r.backbone for r in rs}, "sizes": {r.size for r in rs},
         "trials": {min(5, len({r.trial for r in rs}))}, "arms": {
             _LEFT_ARMS.get(r.method) or _arm_label(r).replace(" r", " ")
             .replace(" ", "-") for r in rs}}  # none: the binary's defaults
  return shlex.join(["python", "-m", "experiments.noise_floor",
                     f"--workdir={workdir}"] + [
      f"--{k}={','.join(map(str, sorted(v)))}" for k, v in ran.items() if rs])


def floor_note(floor: dict, command: str = "") -> str:
  """Markdown stating each arm's noise floor (:func:`noise.read_floor`):
  what the tables' differences are measured against, or the ``command``."""
  if not floor:
    return (f"No noise floor is measured for these lines (`{command}`, "
            f"docs/noise_floor.md): the draw-by-draw table counts any "
            f"difference.\n")
  rows = [(b, m, ", ".join(map(str, v["sizes"])), f"{v['seed_sd']:.1f}",
           f"{v['seed_range']:.1f}", _points(v["perturbed"]),
           "" if m == "head" or (d := noise.difference_floor(
               floor, b, m, "head")) is None else f"{d:.1f}")
          for (b, m), v in sorted(floor.items())]
  return _section(
      "The noise floor of each arm (test accuracy, points; how it is "
      "measured: docs/noise_floor.md)",
      ("backbone", "arm", "sizes measured", "tuning seeds (sd)",
       "largest seed range", "largest change at a 1e-6 perturbation",
       "arm - head floor"), rows) + (
           "\nOne draw's difference of two arms within their floor "
           "(2 sqrt(sd_a^2 + sd_b^2), twice the sd of a difference of two "
           "independent tunings) is a tie in the draw-by-draw tables.\n")


def diverged_table(lines: list[schema.ResultLine]) -> str:
  """Markdown naming every cell whose tuning loss ended non-finite."""
  bad = [r for r in lines if not np.isfinite(r.final_loss)]
  return _section(
      f"Diverged tuning: {len(bad)} cell(s) ended with a non-finite loss "
      "(their accuracies are in the tables)",
      ("backbone", "panel", "size", "trial", "task", "arm", "HMM", "test acc"),
      [(r.backbone, r.panel, r.size, r.trial, r.task,
        f"{r.hmm} {r.method} ({r.features})", r.hmm_fingerprint,
        f"{100 * r.test_accuracy:.1f}") for r in bad])


def components_table(lines: list[schema.ResultLine]) -> str:
  return _section(
      "Variance components (points): SD between trials (HMM draws) / SD "
      "within a trial (task draws)", ("curve", "size", "between", "within"),
      [(_label(k), size, f"{b:.1f}", f"{w:.1f}")
       for k, d in variance_components(lines).items()
       for size, (b, w) in d.items()])


def _section(title: str, header: tuple[str, ...], rows: list) -> str:
  """``## title`` over a markdown table of ``rows``; "" without rows."""
  if not rows:
    return ""
  return "\n".join([f"## {title}", ""]
                   + files_lib.markdown_table(header, rows) + [""])


def _method_label(method: str) -> str:
  """``prompt_linear`` -> ``prompt linear``, or its :data:`_ARMS` label."""
  return _ARMS[method][0] if method in _ARMS else method.replace("_", " ")


def _label(k) -> str:
  backbone, _, hmm, method, features = k
  return f"{backbone}: {hmm} + {_method_label(method)} ({features})"


def _cell(m: float, ci: float, n: int) -> str:
  return f"{m:.1f} ± {ci:.1f} ({n})" if np.isfinite(ci) else f"{m:.1f} ({n})"


def inputs_note(lines) -> str:
  """One sentence: the tuning inputs of ``lines`` beside the paper's."""
  shapes = set()
  for r in lines:
    if r.method.startswith("prompt"):
      t, p = r.task_config["seq_len"], r.tune_config["prompt_len"]
      m = r.tune_config.get("max_len")  # truncation, prompt included
      shapes.add((t if m is None else min(t, m - p - 1), p))
  if not shapes:
    return ""
  ours = "; ".join(f"{t} tokens after the MASK, {p + 1 + t} positions with "
                   f"{p} prompt vectors" for t, p in sorted(shapes))
  return (f"Tuning inputs here: {ours}. The paper's: 128 tokens (Appendix "
          f"D; the authors' scripts truncated every input to 80 positions, "
          f"prompt included).")


# The report's first words and the plot's title for the tiny preset's lines.
SMOKE_TITLE = "A smoke test, not a result"


def smoke(ran: bool, drew: str, results: str) -> str:
  """A smoke run's (``ran``) first words: what it ``drew``, the ``results``."""
  return "" if not ran else (
      f"**{SMOKE_TITLE}.** These lines are {drew}: they show that the run "
      f"goes end to end, not what it measures. The results: {results}.")


def smoke_note(lines) -> str:
  """What heads the report of the ``tiny`` preset's lines (any setup of
  its fingerprint: its trial counts, sizes and arms may differ)."""
  t = configs.get_setup("tiny")
  return smoke(bool({r.setup for r in lines} & {
      t.fingerprint(b) for b in protocol.BACKBONES}), f"the `tiny` preset's "
      f"({t.trials} HMM draws per size, {t.task.num_train} training and "
      f"{t.task.num_test} test examples of {t.task.seq_len} tokens, "
      f"{t.tune.epochs} epochs of tuning)", "`--preset=cpu` (the main job) "
      "or the committed `docs/results/` (docs/figure3.md)")


def write_table(summary: dict, path: str, extra: str = "",
                inputs: str = "", smoke: str = "") -> None:
  """``path``: the panels' tables beside the paper's numbers, then
  ``extra``; ``smoke`` (:func:`smoke_note`) first where given."""
  out = ["# Figure 3: test accuracy (%)", ""] + ([smoke, ""] if smoke else [])
  out += ["Mean ± 95% t-interval over trials (n): a trial is an HMM draw "
          "with its own backbone and tasks, its tasks averaged first (with "
          "one trial, the interval is over its tasks). Paper values (20 "
          "trials left, 5 right) read off the authors' Figure 3 "
          "(approximate)." + (" " + inputs if inputs else ""), ""]
  for panel, title in (("left", "Left: head vs prompt tuning, vanilla HMM, "
                        "|X| = 10, x = |H|"),
                       ("right", "Right: memory HMM + attention head vs "
                        "vanilla HMM + linear head, x = |M||H|")):
    if not (cols := [k for k in summary if k[1] == panel]):
      continue
    sizes = sorted({s for k in cols for s in summary[k]})
    paper = PAPER_LEFT if panel == "left" else PAPER_RIGHT
    head = ["size"] + [f"paper {p}" for p in paper] + [_label(k) for k in cols]
    out += [f"## {title}", ""] + files_lib.markdown_table(head, [
        [s] + [f"~{paper[p][s]}" if s in paper[p] else "" for p in paper]
        + [_cell(*summary[k][s]) if s in summary[k] else "" for k in cols]
        for s in sizes]) + [""]
    notes = [f"* {label}: {note}" for m, (label, note) in _ARMS.items()
             if any(k[3] == m for k in cols)]
    out += notes + [""] if notes else []
  if extra:
    out.append(extra)
  files_lib.atomic_write_text(path, "\n".join(out))


# The plot's styles (write_plot): an arm, (hmm, method), has a marker and a
# colour in both panels (the paper's curve of that arm: its marker, open, on
# a grey dotted line); the backbone sets the line style, the features the
# marker's fill; other keys take the spares in turn.
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
  if key in choices:
    return choices[key]
  return seen.setdefault(key, spares[len(seen) % len(spares)])


def _curve_order(k) -> tuple:
  """Exact before transformer, head before prompt, raw features first."""
  fills = list(_FEATURE_FILLS)
  return (*k[:4], fills.index(k[4]) if k[4] in fills else len(fills), k[4])


def _panels(summary: dict) -> list[str]:
  """The panels with result lines, left first; both where there are none."""
  ran = [p for p in ("left", "right") if any(k[1] == p for k in summary)]
  return ran or ["left", "right"]


def write_plot(summary: dict, path: str, note: str = "") -> None:
  """A panel per panel that ran: each curve's means and its 95% band beside
  the paper's curves; a smoke test's title where ``note`` (:func:`smoke`)."""
  plt = files_lib.pyplot()
  import matplotlib.transforms as mtransforms  # pylint: disable=g-import-not-at-top
  panels = _panels(summary)
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.2),
                           squeeze=False)
  seen: dict = {"arm": {}, "backbone": {}, "features": {}}
  arm_style = lambda a: _style(_ARM_STYLES, _MORE_ARM_STYLES, seen["arm"], a)
  prompted = any(k[1] == "right" and k[3].startswith("prompt")
                 for k in summary)  # Theorem 4.6's arm
  titles = {"left": (PAPER_LEFT, "hidden states |H|", "Head vs prompt tuning"),
            "right": (PAPER_RIGHT, "|M||H|", "Memory vs vanilla HMM"
                      + ("" if prompted else " (head tuning)"))}
  for ax, panel in zip(axes[0], panels):
    paper, xlabel, title = titles[panel]
    for name, pts in paper.items():
      xs = sorted(pts)
      ax.plot(xs, [pts[x] for x in xs], marker=arm_style(_PAPER_ARMS[name])[0],
              label=f"paper: {name}", **_PAPER_STYLE)
    ours = sorted((k for k in summary if k[1] == panel), key=_curve_order)
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
              label=_label(k), transform=shift, **(rim if fill == "full"
                                                   else {}))
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


# Figure 3's arms; a line of any other is an adaptation arm (Setup.arms).
_FIGURE3_ARMS = {"head_linear", "prompt_linear", "finetune_linear",
                 "head_attention", "prompt_attention", *_ARMS}
_LEFT_ARMS = {"head_linear": "head", "prompt_linear": "prompt",  # noise.ARMS
              "finetune_linear": "finetune"}
_FAMILY_MARKERS = {"head": "s", "prompt": "o", "prefix": "^", "lora": "D",
                   "finetune": "P"}


def _arm_label(r) -> str:
  """``prompt 20 tokens``, ``prefix 5``, ``lora r4``: an arm's settings."""
  family, c = r.method.split("_")[0], r.tune_config
  return " ".join([family] + (
      [str(c["prompt_len"])] if family in ("prompt", "prefix") else [])
      + (["tokens"] if family == "prompt" and c.get("prompt_init_mode")
         == "tokens" else []) + ([f"r{c['lora_r']}"] if family == "lora"
                                 else []))


def _adaptation_cells(lines) -> dict:
  """(backbone, panel, size) -> {(method, features): (trainable params: the
  fewest and the most (a deeper fallback's), label, {trial: %})}: each
  features transform its own arm, never averaged with another."""
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


def adaptation_section(lines, floor: dict | None = None,
                       bayes: dict | None = None) -> str:
  """Markdown, where ``lines`` hold adaptation arms: per backbone, panel,
  size and arm, its trainable parameters, accuracy, the paired difference
  from the head on the same draws, draws above / within / below the head
  (within: the pair's own floor, :func:`pair_floor`; blank where either
  arm's is not measured), the exact backbone's prompt tuning less the arm;
  ``bayes``: ``{(panel, size): %}``, the task's Bayes classifier."""
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
  return _section(
      "Adaptation arms: test accuracy (%), mean ± 95% interval (draws)",
      ("backbone", "panel", "size", "arm", "trainable params", "accuracy",
       "arm - head (paired)", "pair floor", "draws above / within floor / "
       "below head", "exact prompt - arm"), rows) + (
           "\nA blank pair floor: an arm's noise floor is not measured "
           "(docs/noise_floor.md); no draw is called above or below. A blank "
           "exact prompt - arm: no exact prompt arm of Figure 3's length "
           "(`--config.tune.prompt_len`) ran on these features at that size.\n")


def write_adaptation_plot(lines, path: str, bayes: dict | None = None
                          ) -> None:
  """A panel per size: each arm's test accuracy (mean and 95% interval over
  draws), an arm per column (by method, then length or rank), a colour and
  offset per backbone, a marker per method (hollow: tokens init); the
  head's mean dotted and the Bayes classifier's accuracy (``bayes``) dashed."""
  plt, bayes = files_lib.pyplot(), bayes or {}
  cells = _adaptation_cells(lines)
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


def write_figure3_report(workdir: str) -> dict:
  """Writes ``figure3.md``, ``figure3.png`` and ``pretraining.png`` in
  ``workdir``; returns :func:`summarize`'s summary."""
  lines = schema.read_results(workdir)
  schema.check_one_setup(lines, workdir)
  summary = summarize(lines)
  smoke = smoke_note(lines)
  floor = noise.read_floor(os.path.join(workdir, noise.FLOOR))
  bayes = read_bayes(workdir)
  extra = [diverged_table(lines), floor_note(floor, noise_floor_command(
      workdir, lines)), adaptation_section(lines, floor, bayes),
           wins_table(lines, floor), components_table(lines),
           trial_table(lines), pretrain_report.section(workdir)]
  write_table(summary, os.path.join(workdir, "figure3.md"),
              extra="\n".join(e for e in extra if e), inputs=inputs_note(lines),
              smoke=smoke)
  write_plot(summary, os.path.join(workdir, "figure3.png"), smoke)
  if {r.method for r in lines} - _FIGURE3_ARMS:
    write_adaptation_plot(lines, os.path.join(workdir, "adaptation.png"),
                          bayes)
  return summary
