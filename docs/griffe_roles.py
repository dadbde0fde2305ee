"""Griffe extension for the API reference: Sphinx roles in docstrings.

The package's docstrings are Google-style (Args / Returns / Raises) with
reST inline markup: ``code`` in double backticks (a valid Markdown code
span already) and cross-reference roles such as :func:`tune`,
:class:`hmm.HMM`, :mod:`~hmmprompt.pretrain.config` or :data:`METHODS`,
which Markdown would print as raw text. This rewrites each role before the
docstring is parsed:

* to an autorefs link, ``[`tune`][hmmprompt.tuning.loop.tune]``, when its
  target resolves to a public object of the package (looked up as written,
  then in the scopes around the docstring's object out to the package
  root, then as the one public object whose path ends with it), so the
  strict build checks it like any other link;
* to plain code, ``tune``, otherwise (private names, objects outside the
  package such as ``experiments.*``), so no link can break.

A leading ``~`` shows the last component only, as in Sphinx.

Loaded by mkdocstrings-python from mkdocs.yml (``extensions``); it is not
part of the installed package.
"""

from __future__ import annotations

import io
import re
import tokenize
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const|type):"
    r"`(?P<tilde>~?)(?P<target>[^`]+)`")


def _lookup(collection, path: str):
  """The object at dotted ``path``, or None."""
  try:
    return collection.get_member(path)
  except Exception:  # KeyError, AliasResolutionError, ...
    return None


def _public(obj) -> bool:
  """Whether ``obj`` (final target) and every parent are public, so the
  API pages render it and autorefs can resolve a link to it."""
  try:
    obj = obj.final_target if obj.is_alias else obj
  except Exception:
    return False
  node = obj
  while node is not None:
    if node.name.startswith("_") and not node.name.startswith("__"):
      return False
    node = node.parent
  return True


def _resolve(obj, target: str, index: dict[str, list[str]]) -> str | None:
  """The canonical path of ``target`` as seen from ``obj``'s docstring;
  ``index`` maps a name to the paths of the public objects so named."""
  collection = obj.modules_collection
  scopes = []
  node = obj
  while node is not None:
    scopes.append(node.path)
    node = node.parent
  # As written, then from the innermost scope out to the package root.
  candidates = [target] + [f"{s}.{target}" for s in scopes]
  for path in candidates:
    found = _lookup(collection, path)
    if found is not None and _public(found):
      try:
        found = found.final_target if found.is_alias else found
      except Exception:
        continue
      return found.path
  name = target.rsplit(".", 1)[-1]
  matches = [p for p in index.get(name, ()) if p.endswith("." + target)]
  return matches[0] if len(matches) == 1 else None


def rewrite(obj, text: str, index: dict[str, list[str]]) -> str:
  """``text`` with every Sphinx role replaced (see the module docstring)."""

  def replace(match: re.Match) -> str:
    target = match["target"].strip().rstrip("()")
    label = target.rsplit(".", 1)[-1] if match["tilde"] else target
    path = _resolve(obj, target, index)
    if path is None:
      return f"``{label}``"
    return f"[``{label}``][{path}]"

  return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
  """Rewrites Sphinx roles once the whole package is loaded."""

  def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
    objects = list(_walk(pkg))
    index: dict[str, list[str]] = {}
    for obj in objects:
      if _public(obj):
        index.setdefault(obj.name, []).append(obj.path)
    for obj in objects:
      if obj.docstring is not None and ":" in obj.docstring.value:
        obj.docstring.value = rewrite(obj, obj.docstring.value, index)


def _walk(obj):
  """``obj`` and every object defined (not imported) under it."""
  yield obj
  for member in obj.members.values():
    if not member.is_alias:
      yield from _walk(member)


class FieldComments(griffe.Extension):
  """A class field's trailing comment as its docstring.

  Fields are described on their own line (``lr: float = 0.01  # Adam's
  peak learning rate``); this shows that text in the API reference, as
  an ``Attributes:`` entry would. Full-line comments are left alone: they
  say why, not what. Runs before :class:`SphinxRoles`, which then rewrites
  the roles in these docstrings too.
  """

  def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute,
                            agent: Any = None, **kwargs: Any) -> None:
    if attr.docstring is not None or not (attr.parent and attr.parent.is_class):
      return
    try:
      source = "\n".join(attr.lines) + "\n"
      comments = [tok.string.lstrip("#").strip() for tok in
                  tokenize.generate_tokens(io.StringIO(source).readline)
                  if tok.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError, OSError):
      return
    if comments := [c for c in comments if c]:
      # Shapes such as [K][S] are text, not Markdown reference links.
      text = " ".join(comments).replace("[", r"\[").replace("]", r"\]")
      attr.docstring = griffe.Docstring(
          text, lineno=attr.lineno, endlineno=attr.endlineno,
          parent=attr, parser=getattr(agent, "docstring_parser", None),
          parser_options=getattr(agent, "docstring_options", None))
