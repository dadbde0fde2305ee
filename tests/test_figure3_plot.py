"""The Figure 3 plot (plots.write_plot), read from the matplotlib
objects it draws, and the tiny preset's report: a smoke test's, said
first."""

import dataclasses
import os

import numpy as np
import pytest

from conftest import CPU_PAPER
from hmmprompt import files as files_lib
from hmmprompt import protocol
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import plots
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import schema

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = float("nan")


def _captured(monkeypatch) -> dict:
  """path's name -> (figure, dpi) of each atomic_write_png, left open."""
  figs = {}

  def capture(path, fig, dpi=110):
    figs[os.path.basename(path)] = (fig, dpi)
    fig.savefig(path, format="png", dpi=dpi)  # the file, figure kept open

  monkeypatch.setattr(files_lib, "atomic_write_png", capture)
  return figs


def _plot(summary: dict, tmp_path, monkeypatch, note: str = ""):
  figs = _captured(monkeypatch)
  plots.write_plot(summary, str(tmp_path / "figure3.png"),
                       **({"note": note} if note else {}))
  return figs["figure3.png"]


def _rgba(color) -> tuple:
  import matplotlib.colors  # pylint: disable=g-import-not-at-top
  return tuple(matplotlib.colors.to_rgba(color))


def _style(line) -> tuple:
  """What tells a legend entry from another besides its text."""
  return (line.get_marker(), str(line.get_linestyle()),
          _rgba(line.get_color()), line.get_fillstyle())


def _entries(ax) -> dict:
  """label -> the legend's handle."""
  legend = ax.get_legend()
  return {t.get_text(): h for t, h in zip(legend.get_texts(),
                                          legend.legend_handles)}


def _every_arm() -> dict:
  """Both backbones, both panels, raw and log features, every arm beyond
  the paper's too."""
  arms = [("left", "vanilla", "head_linear"), ("left", "vanilla",
                                                "prompt_linear"),
          ("left", "vanilla", "head_linear_lbfgs"),
          ("right", "memory", "head_attention"),
          ("right", "memory", "prompt_attention"),
          ("right", "vanilla", "head_linear")]
  out = {}
  for backbone in ("exact", "transformer"):
    for i, (panel, hmm, method) in enumerate(arms):
      for j, features in enumerate(("raw", "log")):
        x = 4 if panel == "left" else 8
        out[(backbone, panel, hmm, method, features)] = {
            x: (90.0 - i - j, 2.0, 3), 3 * x: (70.0 - i - j, 5.0, 3)}
  out[("transformer", "left", "vanilla", "finetune_linear", "raw")] = {
      4: (80.0, 1.0, 3)}
  return out


def test_every_legend_entry_has_its_own_style(tmp_path, monkeypatch):
  """In each panel no two legend entries share marker, line style, colour
  and fill: the paper's curves neither with each other nor with ours, log
  features not with raw (an open marker), one backbone not with the
  other (the line style). A paper curve is grey, dotted, with the marker
  of our arm of its name; an arm has its marker and colour in both
  panels."""
  summary = _every_arm()
  fig, _ = _plot(summary, tmp_path, monkeypatch)
  left, right = fig.axes
  for ax, paper in ((left, reporting.PAPER_LEFT),
                    (right, reporting.PAPER_RIGHT)):
    entries = _entries(ax)
    ours = [reporting._label(k) for k in summary if ax.get_title().startswith(
        "Head" if k[1] == "left" else "Memory")]
    assert sorted(entries) == sorted([f"paper: {p}" for p in paper] + ours)
    styles = [_style(h) for h in entries.values()]
    assert len(set(styles)) == len(styles), ax.get_title()
    for name in paper:
      h = entries[f"paper: {name}"]
      assert (str(h.get_linestyle()), h.get_fillstyle()) == (":", "none")
      r, g, b, _ = _rgba(h.get_color())
      assert r == g == b  # grey
    for k in summary:
      if k[4] == "log" and reporting._label(k) in entries:
        raw = entries[reporting._label(k[:4] + ("raw",))]
        log = entries[reporting._label(k)]
        assert (raw.get_fillstyle(), log.get_fillstyle()) == ("full", "none")
        assert (raw.get_marker(), raw.get_linestyle()) == (
            log.get_marker(), log.get_linestyle())
  lines = {l.get_label(): l for ax in fig.axes for l in ax.get_lines()}
  # The paper's curve has the marker of our arm of the same name.
  for name, ours in (("prompt", "vanilla + prompt linear"),
                     ("head", "vanilla + head linear"),
                     ("memory", "memory + head attention"),
                     ("vanilla", "vanilla + head linear")):
    assert lines[f"paper: {name}"].get_marker() == lines[
        f"exact: {ours} (raw)"].get_marker()
  assert (lines["paper: prompt"].get_marker()
          != lines["paper: head"].get_marker())
  assert (lines["paper: memory"].get_marker()
          != lines["paper: vanilla"].get_marker())
  # The vanilla HMM's linear head: one marker and colour in both panels.
  head = [l for ax in fig.axes for l in ax.get_lines()
          if l.get_label() == "exact: vanilla + head linear (raw)"]
  assert len(head) == 2 and len({_style(l) for l in head}) == 1
  # Exact solid, transformer dashed.
  assert lines["transformer: vanilla + head linear (raw)"].get_linestyle() \
      == "--" and head[0].get_linestyle() == "-"


def test_tied_curves_are_drawn_side_by_side(tmp_path, monkeypatch):
  """Head and prompt tuning tie at 100% on the exact backbone at small |H|
  (docs/figure3.md): each curve is drawn a few points right of the one
  before, its band with it, so no curve hides another; the data are the
  sizes themselves, and the paper's curves are not moved."""
  tie = {4: (100.0, 0.0, 3), 8: (100.0, 0.0, 3)}
  summary = {(b, "left", "vanilla", m, "raw"): dict(tie)
             for b in ("exact", "transformer")
             for m in ("head_linear", "prompt_linear")}
  fig, _ = _plot(summary, tmp_path, monkeypatch)
  ax = fig.axes[0]  # the left panel
  ours = [l for l in ax.get_lines() if not l.get_label().startswith("paper")]
  assert len(ours) == 4
  for line in ours:
    assert list(line.get_xdata()) == [4, 8]
  at = lambda artist, x, y: artist.get_transform().transform([(x, y)])[0]
  shown = [at(l, 4, 100) for l in ours]
  xs = sorted(p[0] for p in shown)
  assert len({round(x, 3) for x in xs}) == 4  # side by side
  assert len({round(p[1], 3) for p in shown}) == 1  # at the same height
  # Apart by at least half a marker, together within 20 points.
  points = fig.dpi / 72
  assert min(np.diff(xs)) >= 2.5 * points and xs[-1] - xs[0] <= 20 * points
  # Each band moves with its curve.
  bands = ax.collections
  assert len(bands) == 4
  for line, band in zip(ours, bands):
    np.testing.assert_allclose(at(band, 4, 0)[0], at(line, 4, 100)[0])
  paper = next(l for l in ax.get_lines() if l.get_label() == "paper: prompt")
  np.testing.assert_allclose(at(paper, 4, 100),
                             ax.transData.transform([(4, 100)])[0])
  # The view holds every point, shifted or not.
  lo, hi = ax.get_xlim()
  assert lo < 4 and hi > 30


@pytest.mark.slow
def test_a_run_of_one_panel_draws_that_panel_alone(tmp_path, monkeypatch):
  """``--panel=left`` writes left-panel lines only: the plot has that
  panel alone (no right panel of the paper's curves), and the same for
  the right; both panels where both ran, or where nothing did."""
  left = {("exact", "left", "vanilla", "head_linear", "raw"): {
      4: (90.0, 1.0, 3)}}
  right = {("exact", "right", "memory", "head_attention", "raw"): {
      8: (99.0, 1.0, 3)}}
  for summary, titles in (
      (left, ["Head vs prompt tuning"]),
      (right, ["Memory vs vanilla HMM (head tuning)"]),
      ({**left, **right}, ["Head vs prompt tuning",
                           "Memory vs vanilla HMM (head tuning)"]),
      ({}, ["Head vs prompt tuning", "Memory vs vanilla HMM (head tuning)"])):
    fig, _ = _plot(summary, tmp_path, monkeypatch)
    assert [ax.get_title() for ax in fig.axes] == titles
  # The runner's path: the report of a left-panel run's lines.
  _write_lines(tmp_path, "abc", panels=("left",))
  figs = _captured(monkeypatch)
  reporting.write_figure3_report(str(tmp_path))
  fig, dpi = figs["figure3.png"]
  assert dpi == 120
  assert [ax.get_title() for ax in fig.axes] == ["Head vs prompt tuning"]


@pytest.mark.slow
def test_the_figure3_plot_draws_each_curve_with_its_interval(
    tmp_path, monkeypatch):
  """Left panel x = |H|, right x = |M||H|, the paper's points beside; a
  curve's band is its 95% interval clipped to [0, 100] (none with one
  trial), in its curve's colour."""
  summary = {
      ("exact", "left", "vanilla", "prompt_linear", "raw"): {
          4: (90.0, 5.0, 3), 8: (80.0, 30.0, 3), 15: (10.0, 30.0, 3)},
      ("exact", "left", "vanilla", "prompt_linear", "log"): {
          4: (70.0, NAN, 1)},
      ("exact", "left", "vanilla", "head_linear", "raw"): {4: (60.0, 1.0, 3)},
      ("transformer", "right", "memory", "head_attention", "raw"): {
          8: (99.0, 4.0, 3)}}
  fig, dpi = _plot(summary, tmp_path, monkeypatch)
  assert dpi == 120
  left, right = fig.axes
  assert (left.get_xlabel(), right.get_xlabel()) == ("hidden states |H|",
                                                     "|M||H|")
  assert left.get_title() == "Head vs prompt tuning"
  assert right.get_title() == "Memory vs vanilla HMM (head tuning)"
  assert left.get_ylabel() == right.get_ylabel() == "test accuracy (%)"
  assert left.get_ylim()[1] > 100  # a marker at 100 is drawn whole
  lines = {l.get_label(): l for l in left.get_lines()}
  prompt = lines["paper: prompt"]
  xs = sorted(reporting.PAPER_LEFT["prompt"])
  assert list(prompt.get_xdata()) == xs
  assert list(prompt.get_ydata()) == [reporting.PAPER_LEFT["prompt"][x]
                                      for x in xs]
  raw = lines["exact: vanilla + prompt linear (raw)"]
  assert (list(raw.get_xdata()), list(raw.get_ydata())) == (
      [4, 8, 15], [90.0, 80.0, 10.0])
  assert "paper: memory" in [l.get_label() for l in right.get_lines()]
  # Bands in curve order (head, prompt raw, prompt log): [m - ci, m + ci]
  # clipped to [0, 100] in the curve's colour; the one-trial curve's has
  # width 0.
  head_band, band, flat = left.collections
  y = band.get_paths()[0].vertices[:, 1]
  assert (y.min(), y.max()) == (0.0, 100.0)
  np.testing.assert_allclose(
      sorted(set(np.round(y, 6))), [0.0, 40.0, 50.0, 85.0, 95.0, 100.0])
  assert _rgba(band.get_facecolor()[0])[:3] == _rgba(raw.get_color())[:3]
  assert set(flat.get_paths()[0].vertices[:, 1]) == {70.0}
  head = lines["exact: vanilla + head linear (raw)"]
  assert _rgba(head_band.get_facecolor()[0])[:3] == _rgba(
      head.get_color())[:3]
  prompted = dict(summary)
  prompted[("exact", "right", "memory", "prompt_attention", "raw")] = {
      8: (99.0, 1.0, 3)}
  fig, _ = _plot(prompted, tmp_path, monkeypatch)
  assert fig.axes[1].get_title() == "Memory vs vanilla HMM"


def _write_lines(workdir, setup: str, panels=("left", "right")) -> None:
  """Two trials of head and prompt tuning (left) or the memory HMM's
  attention head (right), setup fingerprint ``setup``."""
  base = dict(backbone="exact", task=0, features="raw", setup=setup,
              hmm_fingerprint="f", val_accuracy=0.5, train_accuracy=0.5,
              final_loss=0.1, steps=3, seconds=1.0, task_redraws=0,
              assumptions={}, tune_config={"prompt_len": 4},
              task_config={"seq_len": 16}, test_accuracy=0.75)
  arms = {"left": [("vanilla", 4, 0, 4, "head_linear"),
                   ("vanilla", 4, 0, 4, "prompt_linear")],
          "right": [("memory", 4, 2, 8, "head_attention")]}
  files_lib.append_lines(schema.results_path(str(workdir)), [
      schema.ResultLine(**base, panel=p, hmm=h, num_states=n, memory_size=m,
                        size=s, method=method, trial=k)
      for p in panels for h, n, m, s, method in arms[p] for k in range(2)])


@pytest.mark.slow
def test_the_tiny_presets_report_says_it_is_a_smoke_test(tmp_path,
                                                         monkeypatch):
  """The tiny preset's report says first that its numbers are a smoke
  test's, and its plots (Figure 3's, the adaptation arms') say it over the
  panels; another setup's report (the committed ones included) says
  nothing of it."""
  tiny = configs.get_setup("tiny")
  for backbone in protocol.BACKBONES:
    workdir = tmp_path / backbone
    workdir.mkdir()
    _write_lines(workdir, tiny.fingerprint(backbone))
    files_lib.append_lines(schema.results_path(str(workdir)), [
        dataclasses.replace(r, method="prompt_linear_p3") for r in
        schema.read_results(str(workdir)) if r.method == "prompt_linear"])
    figs = _captured(monkeypatch)
    reporting.write_figure3_report(str(workdir))
    head = (workdir / "figure3.md").read_text().splitlines()[:3]
    assert head[0] == "# Figure 3: test accuracy (%)"
    assert head[2].startswith("**A smoke test, not a result.** These lines "
                              "are the `tiny` preset's (2 HMM draws per "
                              "size, 128 training and 64 test examples of "
                              "16 tokens, 2 epochs of tuning)"), head
    for png in ("figure3.png", "adaptation.png"):
      assert figs[png][0]._suptitle.get_text() == "A smoke test, not a result"
  other = tmp_path / "cpu"
  other.mkdir()
  _write_lines(other, configs.get_setup("cpu").fingerprint("exact"))
  figs = _captured(monkeypatch)
  reporting.write_figure3_report(str(other))
  text = (other / "figure3.md").read_text()
  assert "smoke" not in text.lower()
  assert text.splitlines()[2].startswith("Mean ± 95% t-interval")
  assert figs["figure3.png"][0]._suptitle is None
  for committed in (CPU_PAPER, os.path.join(_ROOT, "docs", "results",
                                            "figure3-gpu")):
    assert reporting.smoke_note(schema.read_results(committed)) == ""
