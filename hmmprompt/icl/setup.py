"""In-context learning on GINC, its setup: :class:`IclSetup` and its presets."""

import dataclasses
import json
import os
from typing import Any
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from hmmprompt import config_flags
from hmmprompt import ginc as ginc_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import identity as identity_lib
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import validation

LAYOUT = 1  # bumped when a line's meaning changes for the same setup
CONCEPTS = ("released", "drawn")
RELEASED = "ginc_hmms.npz"  # ginc.convert_release's, from GINC's files
REFERENCE = "concept:1e-06"  # the exact predictive every line's KL is to


@dataclasses.dataclass(frozen=True, kw_only=True)
class IclSetup:
  """Everything that decides the lines besides their keys. ``concepts``:
  ``"drawn"`` (:func:`hmmprompt.ginc.concepts` of ``ginc``, GINC's
  settings, under ``seed``) or ``"released"`` (GINC's own); ``lengths``
  count an example's symbols before its delimiter."""

  seeds: int  # causal transformers, trial ``k`` seeded ``pretrain.seed + k``
  lengths: tuple[int, ...] = (3, 5, 8, 10)  # an example's symbols
  examples: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)  # k before the test
  protocols: tuple[str, ...] = ginc_lib.PROTOCOLS
  prompts: int = 500  # per ``(protocol, length, k)`` cell, every backbone's
  smoothings: tuple[str, ...] = ("0", REFERENCE)  # exact variants (smoothing)
  context: int = 1024  # the exact backbone's longest prompt (GINC's 1024)
  concepts: str = "drawn"
  ginc: ginc_lib.GincConfig = ginc_lib.GincConfig()
  pretrain: pretrain_lib.PretrainConfig  # causal, on GINC's symbols
  seed: int = 0  # root of the prompts (and of drawn concepts)
  released_path: str = identity_lib.runtime(RELEASED)  # convert_release's

  def __post_init__(self):
    validation.require_choices(self, concepts=CONCEPTS)
    validation.require_positive(self, "seeds", "prompts", "context")
    for p in self.protocols:
      validation.one_of("IclSetup.protocols", p, ginc_lib.PROTOCOLS)
    validation.require(self, "lengths", min(self.lengths, default=0) >= 2,
                       ">= 2 (an example's x and its label)")
    if not self.examples or min(self.examples) < 0:
      raise ValueError(f"IclSetup.examples must be >= 0, got {self.examples}")
    for v in self.smoothings:
      smoothing(v)
    model = self.pretrain.model
    if not model.causal:
      raise ValueError("IclSetup.pretrain.model.causal must be set: GINC's "
                       "models read left to right")
    if (v := model.vocab_size) != self.ginc.num_symbols:
      raise ValueError(f"IclSetup.pretrain.model.vocab_size = {v} must be "
                       f"GINC's num_symbols = {self.ginc.num_symbols}")

  def identity(self) -> dict:
    """What DIR/icl.json records: every result-deciding field."""
    return json.loads(json.dumps({**identity_lib.identity(self),
                                  "layout": LAYOUT}))

  def fingerprint(self) -> str:
    """12 hex digits keying the lines: :meth:`identity` less what picks them."""
    return identity_lib.fingerprint({
        k: v for k, v in self.identity().items()
        if k not in ("seeds", "lengths", "examples", "protocols",
                     "smoothings", "context")})

  def fits(self, length: int, k: int, backbone: str) -> bool:
    """Whether ``backbone``'s context holds ``k`` examples of ``length``."""
    size = prompt_len(length, k) + (backbone == "transformer")  # start symbol
    return size <= (self.pretrain.model.max_len if backbone == "transformer"
                    else self.context)


def prompt_len(length: int, k: int) -> int:
  """Symbols in a prompt (:func:`hmmprompt.ginc.prompt`)."""
  return (k + 1) * (length + 1) - 2


def _tiny() -> IclSetup:
  """Seconds: tests and smoke runs (2 drawn concepts of 12 states)."""
  small = ginc_lib.GincConfig(num_values=3, num_slots=4, num_symbols=8,
                              num_concepts=4)
  return IclSetup(
      seeds=2, lengths=(3, 5), examples=(0, 1, 4), prompts=16, ginc=small,
      concepts="drawn", context=64, pretrain=pretrain_lib.configure(
          "tiny", small.num_symbols, context=32, model={"causal": True},
          targets="exact"))


def _cpu() -> IclSetup:
  """41 minutes on 2 cores: drawn concepts (committed: ``concepts="released"``),
  5 CPU-width transformers at context 256 (GINC's 1024 cut: docs/icl.md)."""
  return IclSetup(seeds=5, smoothings=("0", REFERENCE, "concept:0.001",
                                       "mixture:1e-06"),
                  pretrain=pretrain_lib.configure(
      "cpu", 50, context=256, model={"causal": True, "pos_init": "sinusoid"},
      corpus={"val_seqs": 64}, optimizer="muon", lr=1e-2, warmup_steps=100,
      batch_size=32, steps=1500, cycles=None, target_gap=None,
      eval_every=250, ckpt_every=250, trials_per_vmap=0))


PRESETS = {"tiny": _tiny, "cpu": _cpu}


def get_setup(preset: str = "cpu", overrides: Mapping[str, Any] | None = None,
              **fields) -> IclSetup:
  """The named preset with overrides (:func:`config_flags.from_preset`)."""
  return config_flags.from_preset(PRESETS, preset, overrides, **fields)


def check_inputs(setup: IclSetup, error: type[Exception] = ValueError) -> None:
  """``error`` naming ``released_path`` if needed and missing (usage error)."""
  if setup.concepts == "released" and not os.path.exists(setup.released_path):
    raise error(f"GINC's released HMMs are not at {setup.released_path}: "
                f"convert GINC's own files with `python -m "
                f"experiments.ginc_release --source=DIR --out=FILE` and set "
                f"--config.released_path=FILE (docs/icl.md), or drop "
                f"--config.concepts=released")


def load_concepts(setup: IclSetup, kind: str = "id") -> hmm_lib.HMM:
  """The concepts ``[K]``: ``"id"``, the pretraining text's, or ``"ood"``, those
  labelling ``OOD_sample`` (``FileNotFoundError``: a missing released file)."""
  if setup.concepts == "drawn":
    concepts, _ = ginc_lib.concepts(jax.random.PRNGKey(setup.seed), setup.ginc)
    half = max(setup.ginc.num_concepts // 2, 1)
    return jax.tree.map(lambda x: x[:half] if kind == "id" else x[half:],
                        concepts)
  check_inputs(setup, FileNotFoundError)
  return ginc_lib.load_released(setup.released_path)[kind]


def smoothing(variant: str) -> tuple[str, float]:
  """``(where, eps)`` of an exact variant (``ValueError`` naming a bad one):
  ``"0"`` the exact zeros; ``"concept:EPS"`` adds ``eps`` to each concept's
  transitions, keeping the mixture block-diagonal: the Bayes predictor of GINC's
  documents (one concept each, every transition possible); ``"mixture:EPS"``
  smooths the mixture: documents that may switch concept at any symbol."""
  where, _, eps = variant.partition(":")
  try:
    if variant == "0" or (where in ("concept", "mixture")
                          and 0 < float(eps) < 1):
      return ("concept", 0.0) if variant == "0" else (where, float(eps))
  except ValueError:
    pass
  raise ValueError(f"IclSetup.smoothings: {variant!r} is not '0', "
                   f"'concept:EPS' or 'mixture:EPS' with 0 < EPS < 1")


def exact_model(concepts_K: hmm_lib.HMM, variant: str) -> hmm_lib.HMM:
  """The mixture a variant (:func:`smoothing`) predicts with."""
  where, eps = smoothing(variant)
  if where == "mixture":
    return ginc_lib.smoothed(ginc_lib.mixture(concepts_K), eps)
  return ginc_lib.mixture(ginc_lib.smoothed(concepts_K, eps))


def memory_of(concepts_K: hmm_lib.HMM, setup: IclSetup) -> jax.Array:
  """``int [V, S]``: the memory matrix the concepts' emissions read."""
  symbols = jnp.argmax(concepts_K.emission[0], -1)
  return symbols.reshape(setup.ginc.num_values, setup.ginc.num_slots)
