"""A pretraining job: K draws of one HMM family and their recipe."""

import dataclasses

import jax

from hmmprompt import config_flags
from hmmprompt import generative
from hmmprompt import validation
from hmmprompt.pretrain import config as config_lib


@dataclasses.dataclass(frozen=True)
class Job:
  """The generating HMM (vocabulary ``pretrain.model.vocab_size``) and the
  recipe; every leaf is a ``--config.<path>`` flag. ``trials=K`` draws K
  HMMs, pretrained in one :func:`~hmmprompt.pretrain.run_trials`."""

  pretrain: config_lib.PretrainConfig
  model_kind: str = "vanilla"
  num_states: int = 10
  memory_size: int = 3
  hmm_seed: int = 0
  trials: int = 1

  def __post_init__(self):
    validation.one_of("model_kind", self.model_kind, generative.KINDS)
    if not isinstance(self.trials, int) or self.trials < 1:
      raise ValueError(f"trials must be an int >= 1, got {self.trials!r}")

  @classmethod
  def of(cls, preset: str = "cpu", **overrides) -> "Job":
    """The preset's recipe with ``{"a.b": value}`` overrides."""
    return config_flags.apply(cls(pretrain=config_lib.configure(preset)),
                              overrides)

  def make_model(self) -> generative.Model:
    """``[trials]`` stacked draws."""
    key = jax.random.PRNGKey(self.hmm_seed)
    args = (self.model_kind, self.num_states, self.pretrain.model.vocab_size,
            self.memory_size)
    if self.trials > 1:
      return generative.random_models(key, self.trials, *args)
    return generative.stack([generative.random_model(key, *args)])
