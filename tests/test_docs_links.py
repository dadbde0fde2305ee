"""Every relative link in the README and the docs points at a file that
exists: `[text](target)` and `![alt](target)` in README.md and every
docs/**/*.md (the committed results' reports included, which the mkdocs
build excludes), resolved against the linking file's folder. Web links,
mailto: and pure `#anchor` links are not checked, nor links inside code."""

import pathlib
import re
from urllib.parse import unquote

ROOT = pathlib.Path(__file__).resolve().parent.parent

# `[text](target)` or `![alt](target)`, target optionally in <...> and
# optionally followed by a "title".
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+).*?\1")
_EXTERNAL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|//|#)")

# Known dead links, (file, target) relative to the repository root, each
# with why it is allowed. Keep this empty when the link is fixed.
ALLOWED: set[tuple[str, str]] = set()


def markdown_files() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str):
  """``(line number, target)`` of every relative link outside code."""
  fenced = False
  for number, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if fenced:
      continue
    for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
      target = m.group(1)
      if not _EXTERNAL.match(target):
        yield number, target


def dead_links(files, root: pathlib.Path = ROOT) -> list[str]:
  """``file:line -> target`` for every relative link whose file (the
  target less its ``#fragment`` and ``?query``) does not exist."""
  out = []
  for path in files:
    rel = path.relative_to(root).as_posix()
    for number, target in relative_links(path.read_text(encoding="utf-8")):
      file_part = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
      if (rel, target) in ALLOWED:
        continue
      if not (path.parent / file_part).exists():
        out.append(f"{rel}:{number} -> {target}")
  return out


def test_every_relative_link_points_at_a_file():
  files = markdown_files()
  assert len(files) > 10  # the README and the docs were found
  dead = dead_links(files)
  assert not dead, "dead relative links:\n" + "\n".join(dead)


def test_the_allowed_dead_links_are_still_dead():
  """An allow-list entry whose link works again (or is gone) is stale."""
  for rel, target in ALLOWED:
    path = ROOT / rel
    assert path.exists(), rel
    links = [t for _, t in relative_links(path.read_text(encoding="utf-8"))]
    assert target in links and not (path.parent / target).exists(), (
        f"{rel} -> {target} is no longer dead: remove it from ALLOWED")


def test_a_dead_link_is_found(tmp_path):
  page = tmp_path / "page.md"
  (tmp_path / "there.md").write_text("x")
  page.write_text("[ok](there.md#a) [web](https://x.org/y.md) [top](#a)\n"
                  "```\n[code](nowhere.md)\n```\n`[span](nowhere.md)`\n"
                  "![img](missing.png) and [dir](./)\n")
  assert [t for _, t in relative_links(page.read_text())] == [
      "there.md#a", "missing.png", "./"]
  assert dead_links([page], tmp_path) == ["page.md:6 -> missing.png"]
