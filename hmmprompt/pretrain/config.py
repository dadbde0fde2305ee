"""Pretraining configuration and its named presets (numbers stated once)."""

import dataclasses
import json

import jax
import numpy as np

from hmmprompt import identity as identity_lib
from hmmprompt import corpus as corpus_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import validation
from hmmprompt.backbones import transformer

TARGETS = ("sampled", "exact")
OPTIMIZERS = ("adamw", "muon")
FALLBACK_INITS = ("scratch", "warm")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """Defaults: Appendix D (lr 1e-5, batch 8, 3 epochs, 500 warmup steps).
  ``target_gap`` is checked at each evaluation (with ``cycles``, at a
  cycle's end), ``steps`` then a cap; a cycle is a warmup then a linear decay
  to 0; ``retain``'s steps are kept under ``retained/`` (``load_retained``)."""

  model: transformer.MLMConfig = transformer.MLMConfig()
  corpus: corpus_lib.CorpusConfig = corpus_lib.CorpusConfig()
  lr: float = 1e-5
  warmup_steps: int = 500
  batch_size: int = 8
  epochs: int = 3
  steps: int | None = None
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  eval_every: int = 1000
  target_gap: float | None = None  # stop once mlm_ce - bayes_ce <= this
  cycles: tuple[int, ...] | None = None  # lr cycles' steps, summing to steps
  cycle_lr: float = 0.5  # the later cycles' peak, times ``lr``
  seed: int = 0
  targets: str = "sampled"  # or "exact" (docs/pretraining.md)
  # Added after results were keyed (identity_lib.ADDED; muon: optax.contrib).
  optimizer: str = identity_lib.added("adamw")
  # An auxiliary CE from model.state_readout to the exact P[H_t | input],
  # decaying to 0 at state_loss_steps (0: constant); experiments only.
  state_loss: float = identity_lib.added(0.0)
  state_loss_steps: int = identity_lib.added(0)
  # A trial above target_gap at the cap (fallback_gap(s): at earlier cycle
  # ends) trains again deeper (docs/pretraining.md, "The fallback").
  fallback_layers: int = identity_lib.added(0)
  fallback_gap: float = identity_lib.added(0.0)
  fallback_gaps: tuple[float, ...] = identity_lib.added(())
  fallback_init: str = identity_lib.added("scratch")
  # Runtime settings (identity_lib.RUNTIME; exact_*: docs/hmm.md).
  log_every: int = identity_lib.runtime(100)
  ckpt_every: int = identity_lib.runtime(1000)
  keep: int = identity_lib.runtime(3)
  eval_batch: int = identity_lib.runtime(64)
  trials_per_vmap: int = identity_lib.runtime(0)  # at a time (0: all)
  retain: tuple[int, ...] = identity_lib.runtime(())  # steps kept (0: init)
  exact_method: str = identity_lib.runtime("auto")
  exact_window: int = identity_lib.runtime(0)

  def __post_init__(self):
    validation.require_choices(
        self, targets=TARGETS, optimizer=OPTIMIZERS,
        fallback_init=FALLBACK_INITS, exact_method=hmm_lib.METHODS)
    if self.state_loss < 0 or self.state_loss_steps < 0:
      raise ValueError("PretrainConfig.state_loss and state_loss_steps must "
                       "be >= 0")
    if self.state_loss and self.model.causal:
      raise ValueError("PretrainConfig.state_loss is for the masked LM; "
                       "model.causal is set")
    if self.fallback_layers and not (
        isinstance(self.fallback_layers, int)
        and self.fallback_layers > self.model.num_layers
        and self.target_gap is not None):
      raise ValueError(
          f"PretrainConfig.fallback_layers = {self.fallback_layers} must be "
          f"0 or an int above model.num_layers = {self.model.num_layers}, "
          f"with a target_gap to fall short of (got {self.target_gap})")
    if self.fallback_gap and not (
        self.fallback_layers and self.cycles is not None
        and len(self.cycles) > 1 and self.fallback_gap > self.target_gap):
      raise ValueError(
          f"PretrainConfig.fallback_gap = {self.fallback_gap} needs "
          f"fallback_layers, two or more cycles and a gap above target_gap "
          f"(got fallback_layers = {self.fallback_layers}, cycles = "
          f"{self.cycles}, target_gap = {self.target_gap})")
    if self.fallback_gaps and not (
        self.fallback_gap and self.cycles is not None
        and len(self.fallback_gaps) <= len(self.cycles) - 2
        and all(g == 0 or g > self.fallback_gap for g in self.fallback_gaps)):
      raise ValueError(
          f"PretrainConfig.fallback_gaps = {self.fallback_gaps} needs "
          f"fallback_gap and at most {len(self.cycles or ()) - 2} values, "
          f"each 0 or above fallback_gap = {self.fallback_gap}")
    if self.corpus.chunk_len > self.model.max_len:
      raise ValueError(f"corpus chunk_len {self.corpus.chunk_len} exceeds the "
                       f"model context max_len {self.model.max_len}")
    validation.require_ints(self, ["exact_window"], 0, "0: by backend")
    validation.require_positive(self, "batch_size", "epochs", "log_every",
                                "eval_every", "ckpt_every", "keep",
                                "eval_batch", optional=("steps",))
    if self.corpus.fresh and self.steps is None:
      raise ValueError("a fresh-sample corpus has no epochs: set steps")
    if self.cycles is not None:
      if not self.cycles or min(self.cycles) < 1:
        raise ValueError(f"PretrainConfig.cycles must be positive step "
                         f"counts, got {self.cycles}")
      if self.steps != sum(self.cycles):
        raise ValueError(f"PretrainConfig.steps = {self.steps} must equal "
                         f"sum(cycles) = {sum(self.cycles)}")
    validation.require_ints(self, ["trials_per_vmap"], 0,
                            "0: all trials in one vmap")
    retain = self.retain
    if (not isinstance(retain, tuple)
        or not all(isinstance(s, int) and not isinstance(s, bool)
                   and 0 <= s <= self.total_steps for s in retain)
        or any(a >= b for a, b in zip(retain, retain[1:]))):
      raise ValueError(f"PretrainConfig.retain must be a tuple of strictly "
                       f"increasing int steps in [0, total_steps = "
                       f"{self.total_steps}], got {retain!r}")
    for name in ("lr", "cycle_lr", "target_gap"):
      value = getattr(self, name)
      if not (value is None and name == "target_gap" or value > 0):
        raise ValueError(f"PretrainConfig.{name} must be > 0, got {value}")

  @property
  def total_steps(self) -> int:
    return (self.steps if self.steps is not None else
            self.epochs * max(self.corpus.num_chunks // self.batch_size, 1))

  @property
  def cycle_ends(self) -> tuple[int, ...]:
    """Steps after which a cycle ends (``(total_steps,)`` without cycles)."""
    return ((self.total_steps,) if self.cycles is None
            else tuple(int(x) for x in np.cumsum(self.cycles)))

  def with_overrides(self, **overrides) -> "PretrainConfig":
    """``dataclasses.replace`` keeping ``steps`` = ``sum(cycles)`` (a
    ``steps`` override cuts or lengthens the last cycle that fits)."""
    if (overrides.get("steps") is not None and "cycles" not in overrides
        and self.cycles is not None):
      steps, starts = int(overrides["steps"]), (0, *self.cycle_ends)
      n = next((i for i, end in enumerate(starts[1:]) if end >= steps),
               len(self.cycles) - 1)
      overrides["cycles"] = (*self.cycles[:n], steps - starts[n])
    elif overrides.get("cycles") and overrides.get("steps") is None:
      overrides["steps"] = sum(overrides["cycles"])
    return dataclasses.replace(self, **overrides)

  def to_json(self) -> dict:
    """Every field (what ``config.json`` records)."""
    return dataclasses.asdict(self)

  def falls_back(self, line: dict) -> bool:
    """Whether metrics ``line`` sends its trial to its fallback run."""
    if not self.fallback_layers or "ce_gap" not in line:
      return False
    ends = self.cycle_ends
    checks = {self.total_steps: self.target_gap, **({
        ends[-2]: self.fallback_gap, **{ends[i]: g for i, g in enumerate(
            self.fallback_gaps) if g}} if self.fallback_gap else {})}
    return line["step"] in checks and line["ce_gap"] > checks[line["step"]]

  def fallback(self, k: int) -> "PretrainConfig":
    """Trial ``k``'s fallback run: the deeper model, seeded as trial ``k``."""
    return self.with_overrides(
        model=dataclasses.replace(self.model, num_layers=self.fallback_layers),
        seed=self.seed + k, fallback_layers=0, fallback_gap=0.0,
        fallback_gaps=())

  def identity(self) -> dict:
    """The fields that decide results, JSON-normalised (no runtime ones)."""
    return json.loads(json.dumps(identity_lib.identity(self)))

  @classmethod
  def from_json(cls, d: dict) -> "PretrainConfig":
    d = dict(d, model=transformer.MLMConfig(**d["model"]),
             corpus=corpus_lib.CorpusConfig(**d["corpus"]))
    # JSON lists; retain and fallback_gaps are absent from older files.
    for name in ("cycles", "retain", "fallback_gaps"):
      if d.get(name) is not None:
        d[name] = tuple(d[name])
    return cls(**d)


def _tiny(vocab_size: int) -> PretrainConfig:
  return PretrainConfig(
      model=transformer.MLMConfig(vocab_size=vocab_size, d_model=32,
                                  num_heads=2, d_ff=64, num_layers=1,
                                  max_len=32),
      corpus=corpus_lib.CorpusConfig(chunk_len=32, mask_rate=0.15,
                                     fresh=True, val_seqs=16),
      lr=3e-3, warmup_steps=5, batch_size=8, steps=40, log_every=10,
      eval_every=20, ckpt_every=10, keep=2, trials_per_vmap=1)


def _cpu(vocab_size: int) -> PretrainConfig:
  # Context 80 as the authors' tuning scripts; all 13 Figure 3 HMMs in 0.04.
  return PretrainConfig(
      model=transformer.MLMConfig(vocab_size=vocab_size, d_model=64,
                                  num_heads=4, d_ff=256, num_layers=2,
                                  max_len=80),
      corpus=corpus_lib.CorpusConfig(chunk_len=80, mask_rate=0.15,
                                     fresh=True, val_seqs=256),
      lr=3e-3, warmup_steps=200, batch_size=64, steps=31000, trials_per_vmap=1,
      cycles=(1000, 2000, 4000, 8000, 16000), target_gap=0.04,
      eval_every=500, ckpt_every=500, keep=2, targets="exact")


def _cpu_adamw(vocab_size: int) -> PretrainConfig:
  # The main job's budget, AdamW, absolute positions (the committed curve's).
  cpu = _cpu(vocab_size)
  return cpu.with_overrides(
      batch_size=32, lr=5e-3, cycles=(500, 500, 1000), cycle_lr=1.0,
      model=dataclasses.replace(cpu.model, pos_init="sinusoid"),
      corpus=dataclasses.replace(cpu.corpus, corruption="mask"))


def _cpu_capped(vocab_size: int) -> PretrainConfig:
  # cpu_adamw's budget with the hard set's fixes (docs/pretraining.md).
  base = _cpu_adamw(vocab_size)
  return base.with_overrides(
      optimizer="muon", lr=1e-2, warmup_steps=100, cycles=(250, 250, 500, 1000),
      model=dataclasses.replace(base.model, rel_pos="bias"),
      corpus=dataclasses.replace(base.corpus, train_mask_rate=0.4))


def _paper(vocab_size: int) -> PretrainConfig:
  # Every default (PretrainConfig's, CorpusConfig's) is Appendix D's.
  return PretrainConfig(model=transformer.paper_config(vocab_size),
                        eval_every=2000, ckpt_every=2000)


PRESETS = {"tiny": _tiny, "cpu": _cpu, "cpu_adamw": _cpu_adamw,
           "cpu_capped": _cpu_capped, "paper": _paper}
"""``tiny`` (tests), ``cpu`` (the full recipe), ``cpu_capped`` (the main
job's, capped at 2000 steps), ``cpu_adamw``, ``paper`` (Appendix D)."""


def preset_config(name: str, vocab_size: int = 10) -> PretrainConfig:
  """The named preset; ``ValueError`` naming an unknown one."""
  if name not in PRESETS:
    raise ValueError(f"unknown pretraining preset {name!r}; known: "
                     f"{', '.join(PRESETS)}")
  return PRESETS[name](vocab_size)


def resolve_dtype(dtype: str) -> str:
  """``"auto"``: float32 on CPU, bfloat16 on accelerators."""
  if dtype == "auto":
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"
  return dtype


def configure(preset: str, vocab_size: int = 10, *, context: int | None = None,
              dtype: str = "auto", model: dict | None = None,
              corpus: dict | None = None, **overrides) -> PretrainConfig:
  """A preset with overrides: ``context`` sets the chunk length and ``max_len``,
  ``dtype`` :func:`resolve_dtype`, ``model`` and ``corpus`` fields, the rest
  :meth:`PretrainConfig.with_overrides`; ``ValueError`` names a bad value."""
  cfg = preset_config(preset, vocab_size)
  model = {**(model or {}), "dtype": resolve_dtype(dtype)}
  corpus = dict(corpus or {})
  if context is not None:
    corpus["chunk_len"] = model["max_len"] = context
  return cfg.with_overrides(
      model=dataclasses.replace(cfg.model, **model),
      corpus=dataclasses.replace(cfg.corpus, **corpus), **overrides)
