"""Shared checks for the config dataclasses."""


def require_positive(config, *names: str) -> None:
  """Raises ``ValueError`` naming the first field below 1 (``None`` skips)."""
  for name in names:
    value = getattr(config, name)
    if value is not None and value < 1:
      raise ValueError(f"{type(config).__name__}.{name} must be >= 1, got "
                       f"{value}")
