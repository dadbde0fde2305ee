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
_ARMS = {"head_linear_lbfgs": ("head optimum", (
             "the linear head solved to its L2-regularised optimum on the "
             "frozen features (full-batch L-BFGS, TuneConfig.optimizer = "
             "lbfgs) instead of the paper's epochs of Adam.")),
         "prompt_attention": ("attention prompt", (
             "prompt tuning with the attention head on the memory HMM "
             "(Theorem 4.6)."))}


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
    within = np.sqrt(np.sum(np.square(dev)) / sum(len(v) - 1 for v in trials))
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
  """Markdown: per backbone and left-panel size, on how many draws (tasks
  averaged) prompt tuning beats head tuning; a difference within ``floor``'s
  :func:`noise.difference_floor` ties (no ``floor``: equal ones alone)."""
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
  return table_section("Prompt vs head tuning, draw by draw (left panel)", (
      "backbone", "features", "size", "draws", "prompt wins", "ties",
      "head wins"), rows)


def points(x: float) -> str:
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
           f"{v['seed_range']:.1f}", points(v["perturbed"]),
           "" if m == "head" or (d := noise.difference_floor(
               floor, b, m, "head")) is None else f"{d:.1f}")
          for (b, m), v in sorted(floor.items())]
  return table_section(
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
  return table_section(
      f"Diverged tuning: {len(bad)} cell(s) ended with a non-finite loss "
      "(their accuracies are in the tables)",
      ("backbone", "panel", "size", "trial", "task", "arm", "HMM", "test acc"),
      [(r.backbone, r.panel, r.size, r.trial, r.task,
        f"{r.hmm} {r.method} ({r.features})", r.hmm_fingerprint,
        f"{100 * r.test_accuracy:.1f}") for r in bad])


def components_table(lines: list[schema.ResultLine]) -> str:
  return table_section(
      "Variance components (points): SD between trials (HMM draws) / SD "
      "within a trial (task draws)", ("curve", "size", "between", "within"),
      [(_label(k), size, f"{b:.1f}", f"{w:.1f}")
       for k, d in variance_components(lines).items()
       for size, (b, w) in d.items()])


def table_section(title: str, header: tuple[str, ...], rows: list) -> str:
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


# Figure 3's arms; a line of any other is an adaptation arm (Setup.arms).
_FIGURE3_ARMS = {"head_linear", "prompt_linear", "finetune_linear",
                 "head_attention", "prompt_attention", *_ARMS}
_LEFT_ARMS = {"head_linear": "head", "prompt_linear": "prompt",  # noise.ARMS
              "finetune_linear": "finetune"}
def _arm_label(r) -> str:
  """``prompt 20 tokens``, ``prefix 5``, ``lora r4``: an arm's settings."""
  family, c = r.method.split("_")[0], r.tune_config
  return " ".join(w for w, on in ((family, True), (
      str(c.get("prompt_len")), family in ("prompt", "prefix")), (
      "tokens", family == "prompt" and c.get("prompt_init_mode") == "tokens"),
      (f"r{c.get('lora_r')}", family == "lora")) if on)


def write_figure3_report(workdir: str) -> dict:
  """Writes ``figure3.md``, ``figure3.png`` and ``pretraining.png`` in
  ``workdir``; returns :func:`summarize`'s summary."""
  # Imported here: the adaptation tables and the plots use this module's parts.
  # pylint: disable-next=g-import-not-at-top
  from hmmprompt.figure3 import adaptation, plots
  lines = schema.read_results(workdir)
  schema.check_one_setup(lines, workdir)
  summary, smoke = summarize(lines), smoke_note(lines)
  floor = noise.read_floor(os.path.join(workdir, noise.FLOOR))
  bayes = adaptation.read_bayes(workdir)
  extra = [diverged_table(lines), floor_note(floor, noise_floor_command(
      workdir, lines)), adaptation.section(lines, floor, bayes),
           wins_table(lines, floor), components_table(lines),
           trial_table(lines), pretrain_report.section(workdir)]
  write_table(summary, os.path.join(workdir, "figure3.md"), "\n".join(
      e for e in extra if e), inputs_note(lines), smoke)
  plots.write_plot(summary, os.path.join(workdir, "figure3.png"), smoke)
  if {r.method for r in lines} - _FIGURE3_ARMS:
    adaptation.write_plot(lines, os.path.join(workdir, "adaptation.png"), bayes)
  return summary
