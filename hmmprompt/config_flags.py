"""Typed config trees (frozen, validating dataclasses): named presets and
``--config.<path>=<value>`` overrides of their :func:`leaves`, parsed by type
(``4,8`` or ``4:8`` for a tuple, ``none``), applied so every check runs."""

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any


PREFIX = "config"


def leaves(cfg, prefix: str = "") -> dict[str, Any]:
  """``{"a.b.c": type hint}`` for every non-dataclass field of ``cfg``."""
  out, hints = {}, typing.get_type_hints(type(cfg))
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      out.update(leaves(value, f"{prefix}{f.name}."))
    else:
      out[prefix + f.name] = hints[f.name]
  return out


def describe(cfg) -> list[str]:
  """``"path = value"`` for every leaf of ``cfg`` (``--print_config``)."""
  return [f"{path} = {functools.reduce(getattr, path.split('.'), cfg)!r}"
          for path in leaves(cfg)]


def parse(text: str, hint, path: str = "value"):
  """Parses ``text`` as ``hint``; ``ValueError`` naming ``path``."""
  text = text.strip()
  origin = typing.get_origin(hint)
  if origin in (typing.Union, types.UnionType):
    if text.lower() == "none":
      return None
    return parse(text, next(a for a in typing.get_args(hint)
                            if a is not type(None)), path)
  if origin is tuple:
    (elem, *_) = typing.get_args(hint) or (str,)
    parts = [p for p in text.replace(":", ",").split(",") if p.strip()]
    try:
      return tuple(parse(p, elem, path) for p in parts)
    except ValueError:
      raise ValueError(f"--{PREFIX}.{path}={text!r} is not a valid "
                       f"tuple of {elem.__name__} (e.g. 4,8)") from None
  try:
    if hint is bool:
      return {"true": True, "1": True, "yes": True, "false": False,
              "0": False, "no": False}[text.lower()]
    if hint in (int, float, str):
      return hint(text)
  except (KeyError, ValueError):
    raise ValueError(f"--{PREFIX}.{path}={text!r} is not a valid "
                     f"{getattr(hint, '__name__', hint)}") from None
  raise ValueError(f"--{PREFIX}.{path}: cannot parse type {hint}")


def apply(cfg, overrides: Mapping[str, Any]):
  """``cfg`` with ``{"a.b": value}`` overrides (strings are parsed);
  ``ValueError`` for an unknown path (named) or a bad value."""
  known = leaves(cfg)
  if unknown := [path for path in overrides if path not in known]:
    raise ValueError(f"unknown config key {unknown[0]!r}; known keys: "
                     + ", ".join(sorted(known)))
  parsed = {p: parse(v, known[p], p) if isinstance(v, str)
            and known[p] is not str else v for p, v in overrides.items()}
  return _apply_nested(cfg, parsed)


def from_preset(presets: Mapping[str, Callable[[], Any]], preset: str,
                overrides: Mapping[str, Any] | None = None, **fields):
  """``presets[preset]()`` with top-level ``fields`` and path ``overrides``
  applied (:func:`apply`); ``ValueError`` names an unknown preset."""
  if preset not in presets:
    raise ValueError(f"unknown preset {preset!r}; known: {', '.join(presets)}")
  return apply(presets[preset](), {**fields, **dict(overrides or {})})


def _apply_nested(cfg, overrides: Mapping[str, Any]):
  direct: dict[str, Any] = {}
  nested: dict[str, dict[str, Any]] = {}
  for path, value in overrides.items():
    head, _, rest = path.partition(".")
    if rest:
      nested.setdefault(head, {})[rest] = value
    else:
      direct[head] = value
  for head, sub in nested.items():
    direct[head] = _apply_nested(getattr(cfg, head), sub)
  if not direct:
    return cfg
  return (cfg.with_overrides(**direct) if hasattr(cfg, "with_overrides")
          else dataclasses.replace(cfg, **direct))
