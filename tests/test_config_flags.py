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


_CACHE_PROGRAM = """
import sys
from absl import flags
import jax, jax.numpy as jnp
from experiments import cli
events = []
jax.monitoring.register_event_listener(lambda name, **_: events.append(name))
flags.FLAGS(["prog", "--compilation_cache=" + sys.argv[1]])
cli.start(["prog"])
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
print(events.count("/jax/compilation_cache/cache_hits"),
      events.count("/jax/compilation_cache/cache_misses"))
"""


@pytest.mark.slow
def test_the_compilation_cache_flag_persists_programs_for_the_next_run(
    tmp_path):
  """``--compilation_cache=DIR`` (opt-in) writes each compiled program to
  DIR; a second process running the same programs loads every one of them
  from there (JAX's own cache-hit events) and adds none."""
  import os
  import subprocess
  import sys
  cache = tmp_path / "jax-cache"
  run = lambda: [int(n) for n in subprocess.run(
      [sys.executable, "-c", _CACHE_PROGRAM, str(cache)], check=True,
      capture_output=True, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ).stdout.split()[-2:]]
  hits, misses = run()
  first = sorted(os.listdir(cache))
  assert hits == 0 and misses > 0
  assert any(name.startswith("jit__lambda") for name in first), first
  hits, misses = run()
  assert hits > 0 and misses == 0
  assert sorted(os.listdir(cache)) == first
