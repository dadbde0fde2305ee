"""The linter and the type checker pass, so the suite (and CI) keeps them so.

Both are configured in pyproject.toml (``[tool.ruff]``, ``[tool.mypy]``) and
pinned in the ``test`` extra; by hand, from the repository root::

  .venv/bin/ruff check hmmprompt tests experiments   # --fix: UP rules
  .venv/bin/mypy                              # hmmprompt/ (pyproject)

Their caches live under .pytest_cache/ (ruff's and mypy's), so a rerun
checks only what changed.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# What ruff checks here: every Python file of the project.
RUFF_PATHS = ("hmmprompt", "tests", "experiments")


def _run(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)


def test_ruff_is_clean():
  proc = _run("ruff", "check", "--no-fix", *RUFF_PATHS)
  assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_is_clean_over_the_library():
  # The files and the cache dir come from pyproject.toml.
  proc = _run("mypy")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "no issues found" in proc.stdout, proc.stdout
