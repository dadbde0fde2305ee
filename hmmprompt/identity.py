"""What a result is: config identities, fingerprints and their differences. A
config's identity is the JSON-able dict of its result-deciding fields (not
:data:`RUNTIME` ones, nor :data:`ADDED` ones at their default)."""

import dataclasses
import hashlib
import json
from typing import Any

RUNTIME = {"runtime": True}
"""``dataclasses.field(metadata=RUNTIME)`` marks a field of how a run goes
(speed, logging, what is kept), never what it computes: :func:`identity`
leaves it out, so changing it neither re-runs nor invalidates anything."""

ADDED = {"added": True}
"""``dataclasses.field(default=..., metadata=ADDED)`` marks a result field added
after results had been keyed: :func:`identity` leaves it out at its default (so
existing names and fingerprints stand); any other value moves the identity."""


def runtime(default) -> Any:
  """A :data:`RUNTIME` dataclass field with ``default``."""
  return dataclasses.field(default=default, metadata=RUNTIME)


def added(default) -> Any:
  """An :data:`ADDED` dataclass field with ``default``."""
  return dataclasses.field(default=default, metadata=ADDED)


def identity(cfg) -> dict:
  """``cfg``'s identity (subtrees too): what fingerprints and resumes use."""
  out = {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if not (f.metadata.get("runtime")
            or f.metadata.get("added") and v == f.default):
      out[f.name] = identity(v) if dataclasses.is_dataclass(v) else v
  return out


def fingerprint(blob: Any, digits: int = 12) -> str:
  """``digits`` hex digits of the SHA-256 of ``blob`` as sorted-key JSON:
  the one recipe behind setup fingerprints and run directory names."""
  return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()
                        ).hexdigest()[:digits]


def added_defaults(cfg) -> dict:
  """The defaults of ``cfg``'s :data:`ADDED` fields, nested as its
  :func:`identity`: what such a field holds where an identity lacks it."""
  out = {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if f.metadata.get("added"):
      out[f.name] = f.default
    elif dataclasses.is_dataclass(v) and (sub := added_defaults(v)):
      out[f.name] = sub
  return out


# A key neither identity nor ``defaults`` holds (an older record's).
_ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "absent"})()


def _json(x) -> Any:
  """``x`` as JSON reads it back (a tuple as a list); absent as ``None``."""
  return None if x is _ABSENT else json.loads(json.dumps(x))


def differences(old: dict, new: dict, prefix: str = "",
                defaults: dict | None = None) -> list[str]:
  """``"a.b: old -> new"`` for every leaf where two config identities
  differ; a key one side lacks is an :data:`ADDED` field at its default,
  named as that default (``defaults``: :func:`added_defaults`) or absent."""
  out, defaults = [], defaults or {}
  for key in sorted(set(old) | set(new)):
    fill = defaults.get(key, _ABSENT)
    a, b = old.get(key, fill), new.get(key, fill)
    if isinstance(a, dict) and isinstance(b, dict):
      out += differences(a, b, f"{prefix}{key}.",
                         fill if isinstance(fill, dict) else None)
    elif _json(a) != _json(b):
      out.append(f"{prefix}{key}: {a!r} -> {b!r}")
  return out


def check_same(had: dict, want: dict, where: str, what: str = "setup",
               defaults: dict | None = None) -> None:
  """``ValueError`` naming each field where ``had`` and ``want`` differ."""
  if diff := differences(had, json.loads(json.dumps(want)), defaults=defaults):
    raise ValueError(
        f"{where} holds results of another {what} ({'; '.join(diff)}); use "
        f"a new --workdir (or the same config) to resume")
