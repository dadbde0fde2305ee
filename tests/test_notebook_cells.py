"""The notebooks' cells are what they say they are (reads JSON; no kernel).

A markdown cell that holds code renders as raw text in Colab and Jupyter:
the Colab notebook once had a markdown copy of its next code cell where the
"The whole sweep" prose belonged.
"""

import glob
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "experiments", "notebooks",
                                          "*.ipynb")))


def _cells(path):
  with open(path, encoding="utf-8") as f:
    nb = json.load(f)
  for cell in nb["cells"]:
    source = cell["source"]
    yield cell["cell_type"], "".join(source) if isinstance(source, list) \
        else source


def _lines(text):
  """Non-blank lines, stripped, so indentation and blank lines don't hide a
  copy."""
  return [line.strip() for line in text.splitlines() if line.strip()]


def markdown_holding_code(path):
  """``(markdown index, code index)`` for every markdown cell that contains
  the source of a code cell (all its non-blank lines, in order)."""
  cells = list(_cells(path))
  found = []
  for i, (kind, md) in enumerate(cells):
    if kind != "markdown":
      continue
    md_text = "\n".join(_lines(md))
    for j, (other, code) in enumerate(cells):
      code_text = "\n".join(_lines(code))
      if other == "code" and code_text and code_text in md_text:
        found.append((i, j))
  return found


def test_there_are_notebooks():
  assert NOTEBOOKS, "no notebooks under experiments/notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_no_markdown_cell_contains_a_code_cell(path):
  kinds = [kind for kind, _ in _cells(path)]
  assert "markdown" in kinds and "code" in kinds
  assert markdown_holding_code(path) == [], (
      "markdown cells (index, code cell index) that hold a code cell's "
      "source; they render as raw text")


def test_the_check_catches_a_markdown_copy(tmp_path):
  code = 'RUN_SWEEP = False\nif RUN_SWEEP:\n    print("sweep")\n'
  nb = {"cells": [
      {"cell_type": "markdown", "metadata": {}, "source": ["# Title"]},
      {"cell_type": "markdown", "metadata": {},
       "source": code.replace("    ", "  ").splitlines(keepends=True)},
      {"cell_type": "code", "metadata": {}, "outputs": [],
       "execution_count": None, "source": code.splitlines(keepends=True)},
  ], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
  path = tmp_path / "copy.ipynb"
  path.write_text(json.dumps(nb), encoding="utf-8")
  assert markdown_holding_code(str(path)) == [(1, 2)]
