"""hmmprompt.config_flags: typed path overrides of frozen config trees."""

import dataclasses

from absl import flags
import pytest

from experiments import cli
from hmmprompt import config_flags


@dataclasses.dataclass(frozen=True)
class Inner:
  width: int = 4
  rate: float = 0.5
  name: str = "a"

  def __post_init__(self):
    if self.width < 1:
      raise ValueError(f"Inner.width must be >= 1, got {self.width}")


@dataclasses.dataclass(frozen=True)
class Outer:
  inner: Inner = Inner()
  sizes: tuple[int, ...] = (1, 2)
  cap: int | None = None
  on: bool = False


def test_leaves_and_typed_parsing():
  assert set(config_flags.leaves(Outer())) == {
      "inner.width", "inner.rate", "inner.name", "sizes", "cap", "on"}
  cfg = config_flags.apply(Outer(), {
      "inner.width": "8", "inner.rate": "1e-3", "inner.name": "b",
      "sizes": "4:8,16", "cap": "none", "on": "true"})
  assert cfg == Outer(Inner(8, 1e-3, "b"), (4, 8, 16), None, True)
  assert config_flags.apply(cfg, {"cap": "3"}).cap == 3
  # Typed values pass through unparsed; untouched subtrees are kept.
  assert config_flags.apply(Outer(), {"cap": 5}).inner is Outer().inner


@pytest.mark.parametrize("overrides,match", [
    ({"inner.depth": "1"}, "unknown config key 'inner.depth'"),
    ({"inner.width": "wide"}, "config.inner.width='wide' is not a valid int"),
    ({"on": "maybe"}, "config.on='maybe' is not a valid bool"),
    ({"sizes": "1,x"}, "not a valid tuple of int"),
    ({"inner.width": "0"}, "Inner.width must be >= 1"),  # __post_init__ ran
])
def test_bad_overrides_are_named(overrides, match):
  with pytest.raises(ValueError, match=match):
    config_flags.apply(Outer(), overrides)


def test_define_registers_one_flag_per_leaf():
  fv = flags.FlagValues()
  holder = cli.define_config(Outer(), flag_values=fv)
  fv(["prog", "--config.inner.width=7", "--config.sizes=3,4"])
  assert holder.value() == {"inner.width": "7", "sizes": "3,4"}
  assert config_flags.apply(Outer(), holder.value()).inner.width == 7
  with pytest.raises(flags.UnrecognizedFlagError):
    fv(["prog", "--config.inner.depth=1"])
