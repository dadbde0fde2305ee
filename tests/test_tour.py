"""The README's tour is experiments/tour.py's code, and it runs: the
exact backbone's head and prompt tuning, then a transformer pretrained to
the target and tuned the same way, with the accuracies the README shows."""

import contextlib
import io
import os
import re
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BEGIN, _END = "# README tour: begin\n", "# README tour: end\n"


def _tour_code() -> str:
  with open(os.path.join(ROOT, "experiments", "tour.py")) as f:
    text = f.read()
  return text[text.index(_BEGIN) + len(_BEGIN):text.index(_END)]


def _readme_blocks() -> list[str]:
  with open(os.path.join(ROOT, "README.md")) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def test_the_readme_shows_the_tour_file():
  assert _tour_code() in _readme_blocks()


@pytest.mark.default_compiler  # the README's numbers: python -m's compiler
def test_the_tour_runs_and_prints_what_the_readme_says():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    runpy.run_module("experiments.tour", run_name="__main__")
  got = dict(re.findall(r"^(exact \w+|transformer \w+) ([\d.]+)$",
                        out.getvalue(), re.M))
  assert set(got) == {"exact head", "exact prompt", "transformer head",
                      "transformer prompt"}, out.getvalue()[-2000:]
  # The right-padded batch equals its sequences alone, as the README says.
  assert re.search(r"^right-padded = unpadded: True$", out.getvalue(), re.M)
  # Prompt tuning beats the head on both backbones (the paper's claim on
  # a 30-state HMM), and the pretrained model stopped within the target.
  assert float(got["exact prompt"]) > float(got["exact head"])
  assert float(got["transformer prompt"]) > float(got["transformer head"])
  gap = float(re.search(r"^step \d+: ([\d.]+) nats above the Bayes CE$",
                        out.getvalue(), re.M).group(1))
  assert gap <= 0.04
  # The README's printout: the same to 10 of the 1000 test examples (the
  # float rounding of another CPU can flip a few predictions in tuning).
  with open(os.path.join(ROOT, "README.md")) as f:
    shown = dict(re.findall(r"^ *(exact \w+|transformer \w+) ([\d.]+)$",
                            f.read(), re.M))
  assert shown.keys() == got.keys()
  for name, value in got.items():
    assert float(value) == pytest.approx(float(shown[name]), abs=0.01), name
