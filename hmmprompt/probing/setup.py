"""Where the posterior lives, its setup: :class:`ProbeSetup` and its presets."""

import dataclasses
import json
from typing import Any
from collections.abc import Mapping

from hmmprompt import config_flags
from hmmprompt import icl
from hmmprompt import identity as identity_lib
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import validation
from hmmprompt.figure3 import configs as figure3

ADAPTATION_RESULTS = "docs/results/adaptation/results.jsonl"
"""Committed adaptation lines the report sets beside the same draws' probes."""
LAYOUT = 1  # bumped when a line's meaning changes for the same setup
STUDIES = ("mess3", "tasks", "ginc")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeSetup:
  """Everything that decides the lines besides their keys. Mess3's probe
  sequences have ``mess3.model.max_len`` tokens, every position probed (60%
  fit, 20% ridge choice, 20% held out); a task draw's splits fit, choose
  and score its probe; GINC's documents are probed every ``ginc_every``
  positions, its ``ID_sample`` prompts at the label."""

  studies: tuple[str, ...] = STUDIES  # which of :data:`STUDIES` run
  mess3_seeds: int = 3  # transformers, trial k seeded ``mess3.seed + k``
  mess3_sequences: int = 3000  # probe sequences
  mess3: pretrain_lib.PretrainConfig  # their recipe (causal, 3 symbols)
  tasks_preset: str = "adaptation"  # a figure3 preset, its draws and models
  tasks_sizes: tuple[int, ...] = (8, 12, 20, 30)  # its |H|
  tasks_memory_sizes: tuple[int, ...] = (3,)  # its |M|
  tasks_trials: int = 5  # its draws
  ginc_preset: str = "cpu"  # an :mod:`hmmprompt.icl` preset
  ginc_concepts: str = "released"  # its concepts
  ginc_seeds: int = 5  # its first transformers
  ginc_documents: int = 400  # documents of the mixture
  ginc_every: int = 8  # positions between probed ones in a document
  ginc_length: int = 5  # symbols of a prompt's example
  ginc_examples: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32)  # k, per prompt
  ginc_prompts: int = 500  # prompts per k
  released_path: str = identity_lib.runtime(icl.RELEASED)  # GINC's HMMs
  seed: int = 0  # root of the probe sequences

  def __post_init__(self):
    for s in self.studies:
      validation.one_of("ProbeSetup.studies", s, STUDIES)
    validation.require_positive(self, "mess3_seeds", "mess3_sequences",
                                "tasks_trials", "ginc_seeds",
                                "ginc_documents", "ginc_every", "ginc_prompts")
    if not self.mess3.model.causal or self.mess3.model.vocab_size != 3:
      raise ValueError("ProbeSetup.mess3 must be a causal model of Mess3's "
                       "3 symbols")
    validation.require_choices(self, tasks_preset=figure3.PRESETS,
                               ginc_preset=icl.PRESETS)
    self.tasks(), self.ginc()  # their own checks, named

  def tasks(self) -> figure3.Setup:
    """The paper's tasks: :attr:`tasks_preset` at these sizes and draws."""
    return figure3.get_setup(
        self.tasks_preset, trials=self.tasks_trials,
        right_trials=self.tasks_trials, left_sizes=self.tasks_sizes or (4,),
        memory_sizes=self.tasks_memory_sizes or (2,))

  def ginc(self) -> icl.IclSetup:
    """GINC: :attr:`ginc_preset`'s first seeds, these prompts."""
    return icl.get_setup(
        self.ginc_preset, seeds=self.ginc_seeds, concepts=self.ginc_concepts,
        released_path=self.released_path, lengths=(self.ginc_length,),
        examples=self.ginc_examples, prompts=self.ginc_prompts)

  def identity(self) -> dict:
    """DIR/probes.json: every result-deciding field, the studies' setups'."""
    return json.loads(json.dumps({
        **identity_lib.identity(self), "tasks_setup": self.tasks().identity(),
        "ginc_setup": self.ginc().identity(), "layout": LAYOUT}))

  def fingerprint(self) -> str:
    return identity_lib.fingerprint({k: v for k, v in self.identity().items()
                                     if k != "studies"})


def _mess3_recipe(preset: str, steps: int) -> pretrain_lib.PretrainConfig:
  """Shai et al.'s transformer (4 layers, d_model 64, 1 head, context 10)."""
  return pretrain_lib.configure(
      preset, 3, context=10, model={"causal": True, "num_layers": 4,
                                    "d_model": 64, "num_heads": 1,
                                    "d_ff": 256, "pos_init": "sinusoid"},
      corpus={"val_seqs": 64}, optimizer="adamw", lr=1e-3, warmup_steps=100,
      batch_size=64, steps=steps, cycles=None, target_gap=None,
      eval_every=steps, ckpt_every=steps, targets="exact")


def _tiny() -> ProbeSetup:
  """A minute: tests and smoke runs (figure3's and ICL's tiny presets)."""
  return ProbeSetup(mess3_seeds=2, mess3_sequences=200,
                    mess3=_mess3_recipe("tiny", 40), tasks_preset="tiny",
                    tasks_sizes=(4,), tasks_memory_sizes=(2,), tasks_trials=2,
                    ginc_preset="tiny", ginc_concepts="drawn", ginc_seeds=2,
                    ginc_documents=40, ginc_every=4, ginc_length=3,
                    ginc_examples=(0, 4), ginc_prompts=40)


def _cpu() -> ProbeSetup:
  """The committed run (docs/probes.md): Mess3 on 3 seeds, the adaptation
  comparison's 25 draws, ICL's 5 transformers on GINC's released concepts."""
  return ProbeSetup(mess3=_mess3_recipe("cpu", 1500))


PRESETS = {"tiny": _tiny, "cpu": _cpu}


def get_setup(preset: str = "cpu", overrides: Mapping[str, Any] | None = None,
              **fields) -> ProbeSetup:
  """The named preset with overrides (:func:`config_flags.from_preset`)."""
  return config_flags.from_preset(PRESETS, preset, overrides, **fields)


def check_inputs(setup: ProbeSetup) -> None:
  if "ginc" in setup.studies:
    try:
      icl.check_inputs(setup.ginc())
    except ValueError as e:  # name this study's flags, not the ICL binary's
      raise ValueError(str(e).replace(
          "drop --config.concepts=released", "set --config.ginc_concepts="
          "drawn, or leave GINC out: --config.studies=mess3,tasks")) from None
