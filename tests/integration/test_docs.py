"""The documentation builds strictly, so it cannot rot.

``mkdocs build --strict`` (mkdocs.yml) fails on a broken link, anchor or
autorefs cross-reference (the API reference's links included), a docs page
missing from the nav and a nav entry without its page. The tests here add
what the build cannot see: every public module has an API page, and the
README's links into the repository point at files that exist.
"""

import os
import pkgutil
import re
import subprocess
import sys

import hmmprompt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def test_mkdocs_build_is_strict_and_clean(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict",
       "--site-dir", str(tmp_path / "site")],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log
  assert "WARNING" not in log, log
  # The API reference rendered the docstrings (not just the page titles),
  # and Sphinx roles became links or code, never raw text.
  with open(tmp_path / "site" / "api" / "tuning" / "index.html",
            encoding="utf-8") as f:
    html = f.read()
  assert 'id="hmmprompt.tuning.loop.tune"' in html
  assert 'href="#hmmprompt.tuning.loop.run_seed"' in html  # a resolved :func:
  assert ":func:" not in html and ":class:" not in html
  # A field's trailing comment is its docstring, its roles linked too
  # (docs/griffe_roles.py: FieldComments).
  field = html[html.index('id="hmmprompt.tuning.config.TuneConfig.head"'):]
  field = field[:field.index('class="doc doc-object doc-attribute"')]
  assert "a key of" in field
  assert 'href="../heads/#hmmprompt.heads.HEADS"' in field


def public_modules():
  """Every module of the package whose dotted name has no ``_`` part."""
  names = {"hmmprompt"}
  for info in pkgutil.walk_packages(hmmprompt.__path__, "hmmprompt."):
    if not any(part.startswith("_") for part in info.name.split(".")):
      names.add(info.name)
  return names


def test_every_public_module_has_an_api_page():
  documented = set()
  api = os.path.join(ROOT, "docs", "api")
  for name in os.listdir(api):
    if name.endswith(".md"):
      with open(os.path.join(api, name), encoding="utf-8") as f:
        documented |= set(re.findall(r"^::: (hmmprompt[\w.]*)", f.read(),
                                     flags=re.M))
  missing = public_modules() - documented - {"hmmprompt"}
  assert not missing, f"modules without a ::: block under docs/api/: {missing}"


def github_anchor(heading):
  """The anchor GitHub gives a Markdown heading (where the README is read)."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def test_readme_links_point_at_files_and_headings():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme)
             if not re.match(r"[a-z]+://", t)]
  assert targets, "the README links to no docs page"
  broken = []
  for target in targets:
    path, _, anchor = target.partition("#")
    full = os.path.join(ROOT, path) if path else os.path.join(ROOT,
                                                              "README.md")
    if not os.path.exists(full):
      broken.append(target)
    elif anchor:
      with open(full, encoding="utf-8") as f:
        headings = re.findall(r"^#+ (.*)$", f.read(), flags=re.M)
      if anchor not in {github_anchor(h) for h in headings}:
        broken.append(target)
  assert not broken, f"README links to missing files or headings: {broken}"
