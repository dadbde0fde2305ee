"""Validation at the user-facing boundary (imports nothing from the package):
config checks, validated parameter pytrees (:class:`ValidatedParams`) and jitted
entry points over pure kernels (:func:`entry_point`). Checks see values of
concrete input only (:func:`is_concrete`); under ``jit``/``vmap``, dtypes,
shapes and Python numbers, or values under ``checkify.checkify``."""

import functools
from collections.abc import Callable
from typing import Any, ClassVar, ParamSpec, TypeVar

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

# Row sums must be 1 within this tolerance (float32 softmax rounding is ~1e-7
# per entry; a few hundred states stay far below 1e-4).
_SUM_ATOL = 1e-4


def require_positive(config, *names: str,
                     optional: tuple[str, ...] = ()) -> None:
  """``ValueError`` naming the first field < 1, or ``None`` but ``optional``."""
  given = [n for n in optional if getattr(config, n) is not None]
  for name in (*names, *given):
    value = getattr(config, name)
    require(config, name, not (value is None or value < 1), ">= 1")


def require_positive_ints(config, *names: str) -> None:
  """Raises ``ValueError`` naming the first field not a tuple of ints >= 1."""
  for name in names:
    sizes = getattr(config, name)
    require(config, name, all(isinstance(s, int) and s >= 1 for s in sizes),
            "positive integers")


def require_ints(config, names, low: int, why: str = "") -> None:
  """Raises ``ValueError`` naming the first field of ``names`` that is not
  an int >= ``low`` (nor ``None`` where ``None`` is its default)."""
  for name in names:
    v = getattr(config, name)
    if not (isinstance(v, int) and v >= low or v is None
            and config.__dataclass_fields__[name].default is None):
      raise ValueError(f"{type(config).__name__}.{name} must be an int >= "
                       f"{low}{f' ({why})' if why else ''}, got {v!r}")


def positive_int(name: str, value) -> int:
  """``value`` as an ``int``; ``ValueError`` naming it unless an int >= 1."""
  if not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def one_of(name: str, value, options):
  """``value``; ``ValueError`` naming ``name`` unless among ``options``."""
  if value not in options:
    raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
  return value


def require_choices(config, **options) -> None:
  """:func:`one_of` on each field named (``Class.field``) of ``config``."""
  for name, known in options.items():
    one_of(f"{type(config).__name__}.{name}", getattr(config, name), known)


def require(config, name: str, ok: bool, what: str) -> None:
  """``ValueError`` ``<Class>.<name> must be <what>, got <value>`` unless ok."""
  if not ok:
    raise ValueError(f"{type(config).__name__}.{name} must be {what}, got "
                     f"{getattr(config, name)}")


def is_concrete(x) -> bool:
  """Whether ``x`` is a concrete array-like (not a tracer), i.e. checkable."""
  return not isinstance(x, jax.core.Tracer) and isinstance(
      x, (np.ndarray, jax.Array, list, tuple))


def register_unchecked_pytree(cls):
  """Registers ``cls`` so JAX's rebuilds (gradients, tree maps) skip checks."""
  jax.tree_util.register_pytree_node(
      cls, lambda x: (tuple(x), None),
      lambda _, children: tuple.__new__(cls, children))
  return cls


class ValidatedParams(tuple):
  """The mixin of validated parameter NamedTuples: ``class HMM(ValidatedParams,
  _HMMFields, validate=_validate_hmm)``, with ``_HMMFields`` a
  ``typing.NamedTuple`` and ``validate`` raising ``ValueError`` on the fields as
  ``jnp`` arrays. Concrete fields (or nested lists) are converted and validated,
  ``_replace`` and ``_make`` included; tracers and ``vmap`` axis specs pass
  unchecked, as do JAX's rebuilds (:func:`register_unchecked_pytree`)."""

  __slots__ = ()
  _fields_cls: ClassVar[Any]  # a NamedTuple class
  _validate: ClassVar[Callable[..., None]]

  def __init_subclass__(cls, validate: Callable[..., None] | None = None,
                        **kwargs):
    super().__init_subclass__(**kwargs)
    if validate is not None:
      cls._validate = staticmethod(validate)
    cls._fields_cls = next(b for b in cls.__mro__[1:] if "_fields" in vars(b))
    # Set on the class: mypy holds a method named _make to NamedTuple's.
    setattr(cls, "_make", classmethod(lambda c, xs: c(*xs)))  # noqa: B010
    register_unchecked_pytree(cls)

  def __new__(cls, *args, **kwargs):
    fields = tuple(cls._fields_cls(*args, **kwargs))
    if all(is_concrete(f) for f in fields):
      fields = tuple(jnp.asarray(f) for f in fields)
      cls._validate(*fields)
    return tuple.__new__(cls, fields)

  # NamedTuple's own _replace and _make skip the check every entry trusts.
  def _replace(self, **changes):
    return type(self)(**{**dict(zip(self._fields_cls._fields, self)),
                         **changes})


def check_fields(params, validate):
  """``params``; ``validate`` runs on the host if every field is concrete."""
  if all(is_concrete(f) for f in params):
    validate(*(jnp.asarray(f) for f in params))
  return params


def check_event_shape(name: str, p: jax.Array, ndim: int) -> None:
  """Rank, dtype and size checks of a distribution, run on every field before
  the values: a transposed ``[V, H]`` emission is named by its shape."""
  if p.ndim < ndim:
    raise ValueError(f"{name} must have {ndim} dimension(s) (plus optional "
                     f"leading batch dimensions), got shape {p.shape}")
  if not jnp.issubdtype(p.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating-point array, got dtype "
                     f"{p.dtype}")
  if p.size == 0:
    raise ValueError(f"{name} is empty (shape {p.shape})")


def checkify_distribution(name: str, p: jax.Array, ndim: int) -> None:
  """:func:`check_distribution` for traced ``p`` under ``checkify.checkify``
  only: shape and dtype raise ``ValueError`` at once, bad values become its
  error value (``err.throw()`` raises ``checkify.JaxRuntimeError``)."""
  check_event_shape(name, p, ndim)
  checkify.check(jnp.all(jnp.isfinite(p)), f"{name} has a non-finite entry")
  checkify.check(jnp.all(p >= 0), f"{name} has a negative entry {{low:.3g}}",
                 low=jnp.min(p))
  # Summed in at least float32 (bfloat16's rounding would pass _SUM_ATOL):
  # ~n * 6e-8 for n entries, below it for rows of up to ~1000 entries.
  wide = p.astype(jnp.promote_types(p.dtype, jnp.float32))
  off = jnp.max(jnp.abs(jnp.sum(wide, axis=-1) - 1.0))
  checkify.check(off <= _SUM_ATOL, f"{name} must sum to 1 along its last axis, "
                 f"but a row is off by {{off:.6g}}", off=off)


def check_distribution(name: str, p: jax.Array, ndim: int) -> None:
  """Validates concrete probability vectors along the last axis: ``p`` has
  ``ndim`` event dimensions after any leading batch dimensions."""
  check_event_shape(name, p, ndim)
  p_np = np.asarray(p, dtype=np.float64)
  if not np.all(np.isfinite(p_np)):
    bad = np.argwhere(~np.isfinite(p_np))[0].tolist()
    raise ValueError(f"{name} has a non-finite entry at index {bad}")
  if np.any(p_np < 0):
    bad = np.argwhere(p_np < 0)[0].tolist()
    raise ValueError(f"{name} has a negative entry {p_np[tuple(bad)]:.3g} at "
                     f"index {bad}")
  sums = np.atleast_1d(p_np.sum(axis=-1))
  if np.any(off := np.abs(sums - 1.0) > _SUM_ATOL):
    where = np.argwhere(off)[0]
    what = f"row {where.tolist()}" if p.ndim > 1 else "it"
    raise ValueError(f"{name} must sum to 1 along its last axis, but {what} "
                     f"sums to {float(sums[tuple(where)]):.6g}")


P = ParamSpec("P")
R = TypeVar("R")


class _KernelArgs(tuple):
  """A check's result: the kernel's positional arguments."""


def kernel_args(*args) -> Any:
  """What an :func:`entry_point` check returns: the kernel's positional
  arguments (typed ``Any``: the check keeps its own return annotation)."""
  return _KernelArgs(args)


def entry_point(kernel: Callable[..., Any], *, static_argnums=(),
                field: str | None = None
                ) -> Callable[[Callable[P, R]], Callable[P, R]]:
  """Makes a validating entry point over a pure ``kernel`` (a decorator).

  The decorated function is the check, with the entry point's signature and
  docstring: it raises ``ValueError`` on bad input, else returns the
  :func:`kernel_args` that ``kernel``, jitted once here (``static_argnums`` as
  ``jax.jit``'s), runs on; ``field`` picks a field of a NamedTuple result inside
  the jit, so XLA drops the others' work. Traced code calls ``.kernel``."""
  jitted = jax.jit(kernel if field is None else lambda *args: getattr(
      kernel(*args), field), static_argnums=static_argnums)
  def decorate(check: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(check)
    def entry(*args: P.args, **kwargs: P.kwargs) -> R:
      checked = check(*args, **kwargs)
      if not isinstance(checked, _KernelArgs):
        raise TypeError(f"{check.__qualname__}: an entry point's check must "
                        f"return validation.kernel_args(...), got "
                        f"{type(checked).__name__}")
      return jitted(*checked)
    vars(entry)["kernel"] = kernel  # (an attribute mypy does not type)
    return entry
  return decorate
