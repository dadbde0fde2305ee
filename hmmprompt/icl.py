"""In-context learning on GINC (docs/icl.md; ``python -m experiments.icl``):
GINC's prompts scored by the exact mixture of its concepts (the
Bayes-optimal predictor: exact zeros, or smoothed per concept) and by causal
transformers pretrained on the mixture's text, one per seed, on the same
prompts; lines in DIR/icl.jsonl (:class:`IclLine`), the sweep's resume
loop (:func:`protocol.run_stacks`)."""

import dataclasses
import functools
import json
import os
import time
from typing import Any, cast
from collections.abc import Mapping

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import config_flags
from hmmprompt import files as files_lib
from hmmprompt import generative
from hmmprompt import ginc as ginc_lib
from hmmprompt import hmm as hmm_lib
from hmmprompt import identity as identity_lib
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import protocol
from hmmprompt import scheduling
from hmmprompt import validation
from hmmprompt.backbones import transformer
from hmmprompt.figure3 import reporting

LAYOUT = 1  # bumped when a line's meaning changes for the same setup
CONCEPTS = ("released", "drawn")
RELEASED = "ginc_hmms.npz"  # ginc.convert_release's, from GINC's files
REFERENCE = "concept:1e-06"  # the exact predictive every line's KL is to
_PROMPT_STREAM = 7_000  # prompts: fold_in(root, this), then their cell


@dataclasses.dataclass(frozen=True, kw_only=True)
class IclSetup:
  """Everything that decides the lines besides their keys.

  Attributes:
    seeds: causal transformers, trial ``k`` pretrained with ``pretrain.seed
      + k``: its own draw of the mixture's text.
    lengths: example lengths (symbols an example has before its delimiter).
    examples: ``k``, the examples before the test one.
    protocols: :data:`hmmprompt.ginc.PROTOCOLS`.
    prompts: prompts a ``(protocol, length, k)`` cell has, the same for
      every backbone and seed.
    smoothings: the exact backbone's variants (:func:`exact_model`):
      ``"0"`` the exact zeros, ``"concept:EPS"`` each concept smoothed,
      ``"mixture:EPS"`` the mixture smoothed.
    context: the longest prompt the exact backbone scores (GINC's 1024);
      the transformers score those within ``pretrain.model.max_len``.
    concepts: ``"drawn"`` (:func:`hmmprompt.ginc.concepts` of ``ginc``,
      GINC's settings, under ``seed``) or ``"released"`` (GINC's own, from
      ``released_path``: :func:`hmmprompt.ginc.convert_release`).
    pretrain: the transformers' recipe (``model.causal``, the vocabulary
      GINC's symbols).
    seed: root of the prompts (and of drawn concepts).
    released_path: runtime: where GINC's released HMMs are.
  """

  seeds: int
  lengths: tuple[int, ...] = (3, 5, 8, 10)
  examples: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)
  protocols: tuple[str, ...] = ginc_lib.PROTOCOLS
  prompts: int = 500
  smoothings: tuple[str, ...] = ("0", REFERENCE)
  context: int = 1024
  concepts: str = "drawn"
  ginc: ginc_lib.GincConfig = ginc_lib.GincConfig()
  pretrain: pretrain_lib.PretrainConfig
  seed: int = 0
  released_path: str = identity_lib.runtime(RELEASED)

  def __post_init__(self):
    validation.require_choices(self, concepts=CONCEPTS)
    validation.require_positive(self, "seeds", "prompts", "context")
    for p in self.protocols:
      validation.one_of("IclSetup.protocols", p, ginc_lib.PROTOCOLS)
    if not self.lengths or min(self.lengths) < 2:
      raise ValueError(f"IclSetup.lengths must be >= 2 (an example's x and "
                       f"its label), got {self.lengths}")
    if not self.examples or min(self.examples) < 0:
      raise ValueError(f"IclSetup.examples must be >= 0, got {self.examples}")
    for v in self.smoothings:
      smoothing(v)
    model = self.pretrain.model
    if not model.causal:
      raise ValueError("IclSetup.pretrain.model.causal must be set: GINC's "
                       "models read left to right")
    if model.vocab_size != self.ginc.num_symbols:
      raise ValueError(f"IclSetup.pretrain.model.vocab_size = "
                       f"{model.vocab_size} must be GINC's num_symbols = "
                       f"{self.ginc.num_symbols}")

  def identity(self) -> dict:
    """What DIR/icl.json records: every result-deciding field."""
    return json.loads(json.dumps({**identity_lib.identity(self),
                                  "layout": LAYOUT}))

  def fingerprint(self) -> str:
    """12 hex digits keying the lines: :meth:`identity` without what
    decides which lines there are."""
    return identity_lib.fingerprint({
        k: v for k, v in self.identity().items()
        if k not in ("seeds", "lengths", "examples", "protocols",
                     "smoothings", "context")})

  def fits(self, length: int, k: int, backbone: str) -> bool:
    """Whether a prompt of ``k`` examples of ``length`` is scored by
    ``backbone`` (the transformer reads a start symbol before it)."""
    size = prompt_len(length, k) + (backbone == "transformer")
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
      seeds=2, lengths=(3, 5), examples=(0, 1, 4), prompts=16,
      concepts="drawn", ginc=small, context=64,
      pretrain=pretrain_lib.configure(
          "tiny", small.num_symbols, context=32, model={"causal": True},
          targets="exact"))


def _cpu() -> IclSetup:
  """41 minutes on 2 cores: GINC's concepts (drawn; the committed run:
  ``concepts="released"``), 5 transformers of CPU width at context 256
  (GINC's 1024 cut: docs/icl.md)."""
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


def check_inputs(setup: IclSetup, error: type[Exception] = ValueError
                 ) -> None:
  """Raises ``error`` naming ``released_path`` if the setup needs it and it
  is missing (the binary: a usage error before any work or workdir)."""
  if setup.concepts == "released" and not os.path.exists(setup.released_path):
    raise error(f"GINC's released HMMs are not at {setup.released_path}: "
                f"convert GINC's own files with `python -m "
                f"experiments.ginc_release --source=DIR --out=FILE` and set "
                f"--config.released_path=FILE (docs/icl.md), or drop "
                f"--config.concepts=released")


def load_concepts(setup: IclSetup, kind: str = "id") -> hmm_lib.HMM:
  """The concepts ``[K]``: ``"id"``, those the pretraining text mixes, or
  ``"ood"``, the held-out ones GINC's ``OOD_sample`` labels come from
  (``FileNotFoundError`` naming a missing released file)."""
  if setup.concepts == "drawn":
    concepts, _ = ginc_lib.concepts(jax.random.PRNGKey(setup.seed), setup.ginc)
    half = max(setup.ginc.num_concepts // 2, 1)
    return jax.tree.map(lambda x: x[:half] if kind == "id" else x[half:],
                        concepts)
  check_inputs(setup, FileNotFoundError)
  return ginc_lib.load_released(setup.released_path)[kind]


def smoothing(variant: str) -> tuple[str, float]:
  """``(where, eps)`` of an exact variant; ``ValueError`` naming a bad one.
  ``"concept:EPS"`` adds ``eps`` to each concept's transitions, keeping
  the mixture block-diagonal: the Bayes predictor of GINC's documents (one
  concept each, every transition possible). ``"mixture:EPS"`` smooths the
  mixture: documents that may switch concept at any symbol."""
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
  # Mean KL(REFERENCE's || this) at the label position, nats; None where a
  # prompt gets 0 where the reference does not (exact zeros).
  kl: float | None
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
  bos = jnp.full_like(tokens_NxT[:, :1], hmm_lib.MASK)
  inputs = jnp.concatenate([bos, tokens_NxT], 1)
  logits = lambda p: cast(jax.Array, transformer.MLM(model_cfg).apply(
      p, inputs))
  return jax.vmap(lambda p: jax.nn.softmax(logits(p)[:, -1], -1))(params_K)


_BATCH = 100  # prompts a transformer reads at a time (attention memory)


def _renamed(s: dict) -> dict:
  return {"test_accuracy": s.pop("accuracy"), **s}


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
  for k in setup.examples:
    if not setup.fits(g.length, k, g.backbone):
      continue
    t0 = time.perf_counter()
    batch = cell_prompts(setup, stack["concepts"], g.protocol, g.length, k)
    labels = np.asarray(batch["label"])
    id_concepts = stack["concepts"]["id"]
    reference = ginc_lib.predict_all(exact_model(id_concepts, REFERENCE),
                                     batch["tokens"])
    if g.backbone == "exact":
      rows = [reference if v == REFERENCE else ginc_lib.predict_all(
          exact_model(id_concepts, v), batch["tokens"])
              for v in setup.smoothings]
      gaps = [0.0] * len(rows)
    else:
      tokens = batch["tokens"]
      rows = list(np.concatenate([np.asarray(next_symbol(
          stack["model_cfg"], stack["params"], tokens[i:i + _BATCH]))
                                  for i in range(0, len(labels), _BATCH)], 1))
      gaps = stack["ce_gaps"]
    seconds = time.perf_counter() - t0
    out += [IclLine(
        backbone=g.backbone, variant=v, protocol=g.protocol, length=g.length,
        examples=k, setup=setup.fingerprint(),
        hmm_fingerprint=stack["fingerprint"], **_renamed(ginc_lib.scores(
            row, labels)),
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
  """A backbone's stack: the concepts and mixture, and for the transformers
  their pretraining (resumed, bit for bit) and final params."""
  concepts = {kind: load_concepts(setup, kind) for kind in ("id", "ood")}
  mix = ginc_lib.mixture(concepts["id"])
  stack: dict[str, Any] = {"concepts": concepts, "mixture": mix,
                           "fingerprint": generative.model_fingerprint(mix)}
  if backbone.tag == "transformer":
    pdir = pretrain_dir(workdir, setup, stack["fingerprint"])
    pretrain_lib.run_trials(pdir, setup.pretrain, generative.stack(
        [mix] * setup.seeds), log=logging.info)
    _, params, infos = pretrain_lib.load_trials(pdir)
    stack.update(model_cfg=setup.pretrain.model, params=params,
                 ce_gaps=[i.metrics.get("ce_gap", np.nan) for i in infos])
  return stack


def run_icl(setup: IclSetup, workdir: str,
            schedule: scheduling.Schedule = scheduling.EVERYTHING
            ) -> list[IclLine]:
  """Runs the groups without lines in DIR/icl.jsonl; returns all lines.
  ``ValueError``: the workdir holds another setup's."""
  check_workdir(workdir, setup)
  done = {line.key() for line in read_icl_lines(workdir)}
  todo = protocol.missing(plan(setup), done, lambda g: g.keys(setup))
  protocol.run_stacks(
      todo, lambda b, groups: prepare(workdir, setup, b),
      lambda g, stack: [r for r in score_group(setup, g, stack)
                        if r.key() not in done],
      lines_path(workdir), schedule)
  return read_icl_lines(workdir)


def summarize(lines: list[IclLine], field: str = "test_accuracy") -> dict:
  """``{(protocol, length, curve): {k: [values], ...}}`` of a line
  ``field`` with the curves ``"exact <variant>"`` and ``"transformer"``
  (a value per seed; an infinite KL left out), and ``("impossible",
  protocol, length)``: the exact zeros' impossible share per ``k``."""
  out: dict[tuple, dict[int, list[float]]] = {}
  for r in sorted(lines, key=lambda r: (r.protocol, r.length, r.examples)):
    curve = f"exact {r.variant}" if r.backbone == "exact" else "transformer"
    cell = out.setdefault((r.protocol, r.length, curve), {})
    if (value := getattr(r, field)) is not None:
      cell.setdefault(r.examples, []).append(value)
    if r.backbone == "exact" and r.variant == "0":
      out.setdefault(("impossible", r.protocol, r.length), {})[r.examples] = [
          r.impossible]
  return {key: cells for key, cells in out.items() if cells}


def _order(item) -> tuple:
  """Rows by length, then the exact variants (zeros, each concept's
  smoothings, the mixture's), the transformers."""
  (a, b, c), _ = item
  if a == "impossible":
    return (c,)
  return (b, c == "transformer", () if c == "transformer"
          else smoothing(c.split()[1]))


def _table(summary: dict, proto: str, ks: list, scale: float, fmt: str
           ) -> list[list]:
  """Rows ``[length, curve, cells...]``: mean (± sd over seeds)."""
  cell = lambda v: (f"{scale * np.mean(v):{fmt}}" + (
      f" ± {scale * np.std(v):{fmt}}" if len(v) > 1 else ""))
  return [[length, curve] + [cell(cells[k]) if k in cells else ""
                             for k in ks]
          for (p, length, curve), cells in sorted(summary.items(), key=_order)
          if p == proto]


def markdown(summary: dict, kls: dict, gaps: list, smoke: str = "") -> str:
  """DIR/icl.md: per protocol, accuracy (%) and the KL to the reference
  against ``k``, a row per (length, curve), the transformers' mean ± sd
  over seeds; ``smoke`` (:func:`reporting.smoke`) first where given."""
  ks = sorted({k for cells in summary.values() for k in cells})
  prompts = "these prompts" if smoke else "GINC's prompts"
  out = ["# In-context learning on GINC", ""] + ([smoke, ""] if smoke else [])
  out += [f"Accuracy (%) on {prompts} against k, the examples before the "
         "test one. `exact <variant>`: the mixture of the concepts with the "
         "exact zeros (`0`; an impossible prompt counts wrong), each "
         "concept's transitions smoothed by EPS (`concept:EPS`), or the "
         "mixture's (`mixture:EPS`: documents that may switch concept at "
         "any symbol). `transformer`: the causal transformers' mean ± sd "
         "over seeds (held-out next-symbol CE gaps to the Bayes CE: "
         f"{', '.join(f'{g:.3f}' for g in gaps)} nats). Then the mean KL "
         f"(nats) from `exact {REFERENCE}`'s predictive at the label "
         "position to each curve's (exact zeros: infinite, no row). A "
         "blank: the prompt does not fit that backbone's context.", ""]
  header = lambda first: ["length", first, *(f"k = {k}" for k in ks)]
  for proto in sorted({key[0] for key in summary} - {"impossible"}):
    imp = [[length, "impossible (exact 0), %"] + [
        f"{100 * cells[k][0]:.0f}" if k in cells else "" for k in ks]
           for (tag, p, length), cells in sorted(summary.items(), key=_order)
           if tag == "impossible" and p == proto]
    out += [f"## {proto}", "", "Accuracy (%):", ""] + files_lib.markdown_table(
        header("curve"), _table(summary, proto, ks, 100, ".1f") + imp) + [
            "", f"KL from `exact {REFERENCE}` (nats):", ""
        ] + files_lib.markdown_table(header("curve"), [
            r for r in _table(kls, proto, ks, 1, ".3f")
            if r[1] != f"exact {REFERENCE}"]) + [""]
  return "\n".join(out)


def _style(curve: str) -> dict:
  """A curve's line: the reference solid, the exact zeros dotted, other
  smoothings faint, the transformers dashed."""
  variant = curve.split()[-1]
  if curve == "transformer":
    return dict(ls="--", marker="s", alpha=1.0)
  mixture = variant != "0" and smoothing(variant)[0] == "mixture"
  return {REFERENCE: dict(ls="-", marker="o", alpha=1.0),
          "0": dict(ls=":", marker="None", alpha=1.0)}.get(variant, dict(
              ls="-.", marker="^" if mixture else "None", alpha=0.45))


def write_plot(summary: dict, kls: dict, path: str, smoke: str = "") -> None:
  """Accuracy (top) and KL to the reference (bottom, log) against ``k``
  (symlog), a column per protocol, a colour per length, the transformers'
  seeds' spread; the legend in room made beside them; a ``smoke`` title."""
  plt = files_lib.pyplot()
  protos = sorted({key[0] for key in summary} - {"impossible"})
  lengths = sorted({key[1] for key in summary if key[0] != "impossible"})
  ks = sorted({k for cells in summary.values() for k in cells})
  fig, axes = plt.subplots(2, len(protos), figsize=(5 * len(protos) + 2, 7),
                           squeeze=False, sharex=True, layout="constrained")
  curves = set()
  for row, (data, scale) in enumerate(((summary, 100), (kls, 1))):
    for ax, proto in zip(axes[row], protos):
      for (p, length, curve), cells in data.items():
        if p != proto or (row and curve == f"exact {REFERENCE}"):
          continue
        curves.add(curve)
        at = sorted(cells)
        mean = np.asarray([scale * np.mean(cells[k]) for k in at])
        color = f"C{lengths.index(length)}"
        ax.plot(at, mean, color=color, markersize=3, **_style(curve))
        if curve == "transformer":
          sd = np.asarray([scale * np.std(cells[k]) for k in at])
          ax.fill_between(at, mean - sd, mean + sd, color=color, alpha=0.15)
      ax.set(xscale="symlog", xticks=ks, xticklabels=[str(k) for k in ks])
      ax.grid(alpha=0.3)
      if row:
        ax.set(yscale="log", xlabel="k (examples in the prompt)",
               ylabel=f"KL from exact {REFERENCE} (nats)")
      else:
        ax.set(ylabel="accuracy (%)", title=proto, ylim=(-2, 102))
  line = plt.Line2D
  handles = ([line([], [], color=f"C{i}", lw=3, label=f"length {n}")
              for i, n in enumerate(lengths)]
             + [line([], [], color="k", markersize=3, label=c, **_style(c))
                for c in sorted(curves, key=lambda c: (c == "transformer",
                                                       _order(((0, 0, c), 0))))])
  fig.legend(handles=handles, loc="outside right", fontsize=7, frameon=False)
  reporting.write_png(path, fig, 110, smoke)


def write_report(workdir: str) -> str:
  """Writes DIR/icl.md and .png from DIR/icl.jsonl; returns the former."""
  lines = read_icl_lines(workdir)
  summary, kls = summarize(lines), summarize(lines, "kl")
  seeds = sorted({r.variant for r in lines if r.backbone == "transformer"})
  gaps = [next(r.ce_gap for r in lines if r.backbone == "transformer"
               and r.variant == s) for s in seeds]
  tiny = get_setup("tiny")
  smoke = reporting.smoke(tiny.fingerprint() in {r.setup for r in lines},
                          f"the `tiny` preset's ({tiny.ginc.num_concepts} "
                          f"concepts of {tiny.ginc.num_symbols} symbols, not "
                          f"GINC's)", "`--preset=cpu` or docs/results/icl")
  text = markdown(summary, kls, gaps, smoke)
  files_lib.atomic_write_text(os.path.join(workdir, "icl.md"), text)
  if summary:
    write_plot(summary, kls, os.path.join(workdir, "icl.png"), smoke)
  return text
