"""In-context learning on GINC, its sweep: prompts scored into DIR/icl.jsonl."""

import dataclasses
import functools
import os
import time
from typing import Any, cast

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import files as files_lib
from hmmprompt import generative
from hmmprompt import ginc as ginc_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import identity as identity_lib
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import protocol
from hmmprompt import scheduling
from hmmprompt.backbones import transformer
from hmmprompt.icl.setup import (REFERENCE, IclSetup, check_inputs,
                                 exact_model, load_concepts, memory_of)

_PROMPT_STREAM = 7_000  # prompts: fold_in(root, this), then their cell


@dataclasses.dataclass(frozen=True)
class IclLine(files_lib.Line):
  """One backbone variant (a smoothing of the exact mixture, or a seed's
  transformer) on one cell's prompts, keyed by ``KEY_FIELDS``."""

  backbone: str  # exact | transformer
  variant: str  # exact: its smoothing ("0", "concept:1e-06"); seed "k"
  protocol: str
  length: int
  examples: int
  setup: str
  hmm_fingerprint: str  # the mixture's (generative.model_fingerprint)
  test_accuracy: float  # argmax right; an impossible prompt counts wrong
  impossible: float  # the share of prompts of probability 0 (exact only)
  label_prob: float  # the mean probability of the label
  ce_gap: float  # transformer: its held-out next-symbol CE gap; exact: 0
  kl: float | None  # mean KL(REFERENCE || this) at the label, nats; None: inf
  prompts: int
  seconds: float  # the cell's program

  KEY_FIELDS = ("backbone", "variant", "protocol", "length", "examples",
                "setup")
  WHAT = "icl line"


def lines_path(workdir: str) -> str:
  return os.path.join(workdir, "icl.jsonl")


def read_icl_lines(workdir: str) -> list[IclLine]:
  """The lines of DIR/icl.jsonl; ``ValueError`` naming a bad one."""
  return files_lib.read_lines(lines_path(workdir), IclLine)


@dataclasses.dataclass(frozen=True)
class Backbone:
  """A stack of :func:`protocol.run_stacks`: one backbone, all its variants."""

  tag: str  # exact | transformer
  size: int = 0


@dataclasses.dataclass(frozen=True)
class Group:
  """One backbone on one protocol and example length: one append."""

  backbone: str
  protocol: str
  length: int

  def __str__(self) -> str:
    return f"{self.protocol} length {self.length}"

  def variants(self, setup: IclSetup) -> list[str]:
    return (list(setup.smoothings) if self.backbone == "exact"
            else [str(k) for k in range(setup.seeds)])

  def keys(self, setup: IclSetup) -> dict[tuple, tuple]:
    """``{(variant, k): key}`` of the lines this group writes."""
    fp = setup.fingerprint()
    return {(v, k): (self.backbone, v, self.protocol, self.length, k, fp)
            for v in self.variants(setup) for k in setup.examples
            if setup.fits(self.length, k, self.backbone)}


def plan(setup: IclSetup) -> dict[Backbone, list[Group]]:
  """The groups by backbone, exact first."""
  return {Backbone(b): [Group(b, p, n) for p in setup.protocols
                        for n in setup.lengths]
          for b in ("exact", "transformer")}


def check_workdir(workdir: str, setup: IclSetup) -> None:
  """Stamps DIR/icl.json (``ValueError`` if it holds another setup's,
  lines of other concepts, or GINC's released HMMs are missing)."""
  check_inputs(setup)
  files_lib.stamp(os.path.join(workdir, "icl.json"), setup.identity(),
                  "icl setup", defaults=identity_lib.added_defaults(setup))
  # The released file is named by a runtime path: its content is checked.
  if had := {r.hmm_fingerprint for r in read_icl_lines(workdir)}:
    now = generative.model_fingerprint(ginc_lib.mixture(load_concepts(setup)))
    if had != {now}:
      raise ValueError(f"{workdir} holds lines of other concepts (mixture "
                       f"{', '.join(sorted(had))}; {setup.released_path}'s "
                       f"is {now})")


def cell_prompts(setup: IclSetup, concepts: dict, protocol_name: str,
                 length: int, k: int) -> dict:
  """The cell's :func:`ginc.prompts`, a pure function of its coordinates:
  ``ID_sample`` from ``concepts["id"]``, ``OOD_sample`` labelled by
  ``concepts["ood"]`` (GINC's ``hmms=ood_hmms``)."""
  key = jax.random.fold_in(jax.random.PRNGKey(setup.seed), _PROMPT_STREAM)
  cell = ginc_lib.PROTOCOLS.index(protocol_name) * 1_000_000 + 1000 * length + k
  source = concepts["id" if protocol_name == "ID_sample" else "ood"]
  return ginc_lib.prompts(jax.random.fold_in(key, cell), source,
                          memory_of(source, setup), protocol_name, k, length,
                          setup.prompts)


@functools.partial(jax.jit, static_argnums=0)
def next_symbol(model_cfg: transformer.MLMConfig, params_K, tokens_NxT):
  """``[K, N, V]``: each stacked causal model's next-symbol distribution
  after each prompt (read after a start-of-text ``MASK``)."""
  inputs = jnp.pad(tokens_NxT, ((0, 0), (1, 0)), constant_values=hmm_lib.MASK)
  return jax.vmap(lambda p: jax.nn.softmax(cast(jax.Array, transformer.MLM(
      model_cfg).apply(p, inputs))[:, -1], -1))(params_K)


_BATCH = 100  # prompts a transformer reads at a time (attention memory)


def kl_to(reference_NxX, next_NxX) -> float | None:
  """Mean ``KL(reference || next)`` over rows in float64 (None: infinite)."""
  p, q = (np.asarray(a, np.float64) for a in (reference_NxX, next_NxX))
  if np.any((p > 0) & (q <= 0)):
    return None
  logs = np.log(np.where(p > 0, p, 1.0) / np.where(p > 0, q, 1.0))
  return float(np.sum(p * logs, -1).mean())


def score_group(setup: IclSetup, g: Group, stack: dict) -> list[IclLine]:
  """``g``'s lines: every variant on every fitting ``k``'s prompts."""
  out = []
  for k in [k for k in setup.examples if setup.fits(g.length, k, g.backbone)]:
    t0 = time.perf_counter()
    batch = cell_prompts(setup, stack["concepts"], g.protocol, g.length, k)
    labels = np.asarray(batch["label"])
    tokens, concepts = batch["tokens"], stack["concepts"]["id"]
    reference = ginc_lib.predict_all(exact_model(concepts, REFERENCE), tokens)
    if g.backbone == "exact":
      rows = [reference if v == REFERENCE else ginc_lib.predict_all(
          exact_model(concepts, v), tokens) for v in setup.smoothings]
      gaps = [0.0] * len(rows)
    else:
      rows = list(np.concatenate([np.asarray(next_symbol(
          stack["model_cfg"], stack["params"], tokens[i:i + _BATCH]))
                                  for i in range(0, len(labels), _BATCH)], 1))
      gaps = stack["ce_gaps"]
    seconds = time.perf_counter() - t0
    out += [IclLine(
        backbone=g.backbone, variant=v, protocol=g.protocol, length=g.length,
        examples=k, setup=setup.fingerprint(),
        hmm_fingerprint=stack["fingerprint"], **{
            "test_accuracy" if n == "accuracy" else n: x
            for n, x in ginc_lib.scores(row, labels).items()},
        ce_gap=float(gap), kl=kl_to(reference, row), prompts=setup.prompts,
        seconds=seconds)
            for v, row, gap in zip(g.variants(setup), rows, gaps)]
  return out


def pretrain_dir(workdir: str, setup: IclSetup, fingerprint: str) -> str:
  """``DIR/pretrain/ginc-<8 hex digits>``: the recipe, concepts and seed."""
  fp = identity_lib.fingerprint(
      {"pretrain": setup.pretrain.identity(), "mixture": fingerprint,
       "state_layout": protocol.PRETRAIN_DIR_VERSION}, digits=8)
  return os.path.join(workdir, "pretrain", f"ginc-{fp}")


def prepare(workdir: str, setup: IclSetup, backbone: Backbone) -> dict:
  """A stack: concepts, their mixture, transformers (resumed bit for bit)."""
  concepts = {kind: load_concepts(setup, kind) for kind in ("id", "ood")}
  mix = ginc_lib.mixture(concepts["id"])
  stack: dict[str, Any] = {"concepts": concepts, "mixture": mix,
                           "fingerprint": generative.model_fingerprint(mix)}
  if backbone.tag == "transformer":
    pdir = pretrain_dir(workdir, setup, stack["fingerprint"])
    pretrain_lib.run_trials(pdir, setup.pretrain, generative.stack(
        [mix] * setup.seeds), log=logging.info)
    _, params, infos = pretrain_lib.load_trials(pdir)
    stack.update(model_cfg=setup.pretrain.model, params=params, infos=infos,
                 ce_gaps=[i.metrics.get("ce_gap", np.nan) for i in infos])
  return stack


def run_icl(setup: IclSetup, workdir: str,
            schedule: scheduling.Schedule = scheduling.EVERYTHING
            ) -> list[IclLine]:
  """Runs the groups without lines in DIR/icl.jsonl; returns all lines
  (``ValueError``: the workdir holds another setup's)."""
  check_workdir(workdir, setup)
  return protocol.run_lines(
      plan(setup), lambda: read_icl_lines(workdir), lambda g: g.keys(setup),
      lambda b, _: prepare(workdir, setup, b),
      lambda g, stack: score_group(setup, g, stack), lines_path(workdir),
      schedule)
