r"""The hard set: pretrain the hard HMM draws with a recipe and report how
fast each comes within 0.04 nats of the Bayes CE (docs/pretraining.md, "The
hard set": the draws, the report's columns, the recipes tried).

  python -m experiments.hard_set --workdir=DIR [--recipe=cpu_adamw] \
      [--config.pretrain.model.num_layers=4 --config.pretrain.lr=3e-3 ...] \
      [--config.only=h28t2,m7t0] [--bench_steps=60]

The config: ``pretrain`` (the ``--recipe`` preset), ``draws`` (a set of
:data:`SETS`) and ``only`` (tags such as ``h28t2``; empty: all). Each
recipe trains and reports in ``DIR/<fingerprint>/`` (rerunning resumes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import time

from absl import app
from absl import flags
import jax

from experiments import cli
from experiments.bench import harness
from hmmprompt.figure3 import configs
from hmmprompt import protocol
from hmmprompt import config_flags
from hmmprompt import corpus as corpus_lib
from hmmprompt import generative
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import files as files_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.pretrain import train as train_lib
from hmmprompt.pretrain import workdir as workdir_lib

TARGET = 0.04
MARKS = (1.0e6, 2.5e6, 5.0e6)
BUDGET = 2000 * 32 * 80


@dataclasses.dataclass(frozen=True)
class Draws:
  """Trials ``trials`` of one size, drawn from ``preset``'s streams."""

  preset: str  # the figure3 Setup whose seed roots the stream
  model_id: protocol.ModelId
  trials: tuple[int, ...]
  name: str  # tag prefix: h28, m7

  def tags(self) -> list[str]:
    return [f"{self.name}t{k}" for k in self.trials]


HARD_SET = (
    Draws("cpu", protocol.vanilla(12), (0,), "h12"),
    Draws("paper", protocol.vanilla(25), (0, 1, 2, 3, 4), "h25"),
    Draws("cpu", protocol.vanilla(28), (0, 1, 2), "h28"),
    Draws("paper", protocol.vanilla(30), (0, 1, 2, 3, 4), "h30"),
    Draws("cpu", protocol.memory(7), (0,), "m7"))


# --config.draws (docs/figure3.md): the cpu_paper protocol's misses beyond
# the hard set's, its ten 4-layer fallbacks, and three easy sizes' first 20.
SETS = {"hard": HARD_SET, "protocol_misses": (
    Draws("paper", protocol.vanilla(25), (13, 18), "h25"),
    Draws("paper", protocol.vanilla(30), (10, 11, 12, 16, 19), "h30"),
), "protocol_fallbacks": (
    Draws("paper", protocol.vanilla(25), (2, 13, 18), "h25"),
    Draws("cpu", protocol.vanilla(28), (2,), "h28"),
    Draws("paper", protocol.vanilla(30), (0, 10, 11, 12, 16, 19), "h30"),
), "protocol_easy": tuple(Draws("paper", protocol.vanilla(h), tuple(
    range(20)), f"h{h}") for h in (4, 10, 15))}


@dataclasses.dataclass(frozen=True)
class HardSetConfig:
  pretrain: pretrain_lib.PretrainConfig
  only: tuple[str, ...] = ()
  draws: str = "hard"  # SETS

  def __post_init__(self):
    if self.draws not in SETS:
      raise ValueError(f"--config.draws must be one of {sorted(SETS)}, got "
                       f"{self.draws!r}")
    known = [t for d in SETS[self.draws] for t in d.tags()]
    if bad := [t for t in self.only if t not in known]:
      raise ValueError(f"--config.only: unknown draws {bad}; known: "
                       f"{','.join(known)}")


def default_config(recipe: str = "cpu_capped") -> HardSetConfig:
  # Evaluations every 100 steps show the marks; they change no result.
  return HardSetConfig(pretrain=pretrain_lib.configure(
      recipe, protocol.VOCAB, eval_every=100))


def draw_models(draws: Draws) -> generative.Model:
  """The sweep's trials ``0..max(draws.trials)`` of ``draws``' size."""
  mid = draws.model_id
  return generative.random_models(
      protocol.model_key(configs.get_setup(draws.preset), mid),
      max(draws.trials) + 1, mid.hmm, mid.num_states, protocol.VOCAB,
      mid.memory_size)


def _runs(trials: list[int]) -> list[list[int]]:
  """Maximal runs of consecutive trials."""
  return [[k for _, k in run] for _, run in itertools.groupby(
      enumerate(sorted(trials)), lambda ik: ik[1] - ik[0])]


def recipe_fingerprint(cfg: pretrain_lib.PretrainConfig) -> str:
  return hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True).encode()
                        ).hexdigest()[:8]


def tokens_per_step(cfg: pretrain_lib.PretrainConfig) -> int:
  return cfg.batch_size * cfg.corpus.chunk_len


def pretrain_hard_set(workdir: str, cfg: HardSetConfig, log=print) -> dict:
  """Pretrains the selected draws; ``{tag: [metrics lines]}``."""
  out = {}
  for draws in SETS[cfg.draws]:
    chosen = [k for k, t in zip(draws.trials, draws.tags())
              if not cfg.only or t in cfg.only]
    if not chosen:
      continue
    stack = draw_models(draws)
    for run in _runs(chosen):
      # Trial k trains with seed + k, as in the sweep (run_trials adds j).
      pcfg = cfg.pretrain.with_overrides(seed=cfg.pretrain.seed + run[0])
      if pcfg.state_loss > 0:  # the readout has the HMM's state count
        pcfg = pcfg.with_overrides(model=dataclasses.replace(
            pcfg.model, state_readout=int(generative.as_hmm(
                generative.trial(stack, 0)).transition.shape[-1])))
      sub = generative.stack([generative.trial(stack, k) for k in run])
      pdir = os.path.join(workdir, f"{draws.name}-t{run[0]}-{run[-1]}")
      log(f"pretraining {draws.name} trials {run} in {pdir}")
      pretrain_lib.run_trials(pdir, pcfg, sub, log=log)
      lines = workdir_lib.read_metrics(workdir_lib.Paths.of(pdir))
      for j, k in enumerate(run):
        out[f"{draws.name}t{k}"] = [m for m in lines if m.get("trial", 0) == j]
        deep = workdir_lib.Paths.of(workdir_lib.fallback_dir(pdir, j))
        if os.path.exists(deep.metrics):  # its steps count from the stop
          out[f"{draws.name}t{k}-{pcfg.fallback_layers}L"] = (
              workdir_lib.read_metrics(deep))
  return out


def read_hard_set(workdir: str) -> dict:
  """``{tag: [metrics lines]}`` of every draw in ``workdir``'s run
  directories (``<name>-t<k0>-<k1>/``), in :data:`SETS`' order."""
  found = {}
  for entry in sorted(os.listdir(workdir)):
    m = re.fullmatch(r"([a-z]+\d+)-t(\d+)-(\d+)", entry)
    paths = workdir_lib.Paths.of(os.path.join(workdir, entry))
    if not m or not os.path.exists(paths.metrics):
      continue
    lines = workdir_lib.read_metrics(paths)
    for j in range(int(m[3]) - int(m[2]) + 1):
      found[f"{m[1]}t{int(m[2]) + j}"] = [x for x in lines
                                          if x.get("trial", 0) == j]
  order = list(dict.fromkeys(t for draws in SETS.values() for d in draws
                             for t in d.tags()))
  return {t: found[t] for t in order if t in found}


def hard_set_table(per_draw: dict, tok_step: int) -> str:
  """Per draw, the gap at the first evaluation past each of :data:`MARKS`
  (stopped before: its last) and the tokens to :data:`TARGET`."""
  rows = ["| draw | gap @1M | gap @2.5M | gap @5M | M tokens to 0.04 |",
          "|---|---|---|---|---|"]
  n_in = 0
  for tag, lines in per_draw.items():
    lines = sorted(lines, key=lambda m: m["step"])
    gaps = [next((m["ce_gap"] for m in lines if m["step"] * tok_step >= mark),
                 lines[-1]["ce_gap"] if lines else None) for mark in MARKS]
    hit = next((m["step"] * tok_step for m in lines
                if m["ce_gap"] <= TARGET), None)
    n_in += hit is not None and hit <= BUDGET
    to = (f"> {lines[-1]['step'] * tok_step / 1e6:.2f}" if hit is None
          else f"{hit / 1e6:.2f}")
    rows.append(f"| {tag} | " + " | ".join(
        "" if g is None else f"{g:.3f}" for g in gaps) + f" | {to} |")
  rows.append(f"\n{n_in} of {len(per_draw)} within {TARGET} by "
              f"{BUDGET / 1e6:.2f} M tokens ({tok_step} tokens per step).")
  return "\n".join(rows)


def bench_ratio(cfg: pretrain_lib.PretrainConfig, steps: int,
                rounds: int = 5) -> float:
  """Time per training token of ``cfg`` over ``cpu_adamw``'s, stepping one
  ``|H|`` = 28 draw, the two interleaved in ``rounds`` blocks."""
  base = default_config("cpu_adamw").pretrain
  hmm_model = generative.trial(draw_models(HARD_SET[2]), 0)
  mesh = sharding_lib.data_mesh()
  hmms = jax.tree.map(lambda x: x[None], generative.as_hmm(hmm_model))
  per = max(steps // rounds, 1)

  def steps_of(c):  # ``per`` train steps of ``c``, its state carried
    get = jax.jit(jax.vmap(lambda k, s: corpus_lib.batch_at(
        k, s, hmm_model, None, c.corpus, c.batch_size, c.model.vocab_size),
                           in_axes=(0, None)))
    key = jax.random.split(jax.random.PRNGKey(1), 1)
    batches = [get(key, s) for s in range(4)]
    return harness.train_steps(
        train_lib.make_train_step(c, mesh), lambda i: batches[i % 4],
        train_lib.init_states(jax.random.split(jax.random.PRNGKey(0), 1), c),
        hmms, per)

  spent = harness.interleaved(
      {"base": steps_of(base), "cand": steps_of(cfg)}, rounds)
  return ((spent["cand"] / tokens_per_step(cfg))
          / (spent["base"] / tokens_per_step(base)))


_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_RECIPE = flags.DEFINE_enum(
    "recipe", "cpu_capped", ["cpu_capped", "cpu_adamw"], "the pretraining "
    "preset the --config.pretrain overrides apply to (cpu_adamw: the main "
    "job's before issue 30)")
_BENCH = flags.DEFINE_integer(
    "bench_steps", 0, "first time this many train steps of the recipe "
    "against cpu_adamw's, interleaved, and print the per-token ratio")
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "print the table of what DIR holds for this "
    "recipe (a run still going: its evaluations so far); train nothing")
_BENCH_ONLY = flags.DEFINE_bool("bench_only", False,
                                 "with --bench_steps: stop after the ratio")
_CONFIG = cli.define_config(default_config())
flags.adopt_module_key_flags(cli)


def main(argv):
  cli.start(argv, workdir=_WORKDIR.value)
  with cli.usage_errors():
    cfg = config_flags.apply(default_config(_RECIPE.value), _CONFIG.value())
    cli.make_dir(_WORKDIR.value)
  pcfg = cfg.pretrain
  workdir = os.path.join(_WORKDIR.value, recipe_fingerprint(pcfg))
  os.makedirs(workdir, exist_ok=True)
  files_lib.atomic_write_text(os.path.join(workdir, "recipe.json"), json.dumps(
      {"overrides": _CONFIG.value(), "pretrain": pcfg.to_json()}, indent=1))
  print(f"recipe {recipe_fingerprint(pcfg)}: overrides {_CONFIG.value()}",
        flush=True)
  if _REPORT_ONLY.value:  # every draw of DIR, however grouped
    return print(hard_set_table(read_hard_set(workdir), tokens_per_step(pcfg)))
  ratio = None
  if _BENCH.value:
    ratio = bench_ratio(pcfg, _BENCH.value)
    print(f"time per training token: {ratio:.2f}x cpu_adamw's "
          f"(interleaved, {_BENCH.value} steps each)", flush=True)
    if _BENCH_ONLY.value:
      return
  t0, c0 = time.perf_counter(), os.times()
  per_draw = pretrain_hard_set(workdir, cfg,
                               log=lambda s: print(s, flush=True))
  wall, c1 = time.perf_counter() - t0, os.times()
  table = hard_set_table(per_draw, tokens_per_step(pcfg))
  times = (f"wall {wall:.0f} s, user {c1.user - c0.user:.0f} s, sys "
           f"{c1.system - c0.system:.0f} s (this process, this "
           f"invocation: a resumed run counts only what it ran)")
  if ratio is not None:
    times += f"; time per token {ratio:.2f}x cpu_adamw's (interleaved)"
  text = f"{table}\n\n{times}\n"
  files_lib.atomic_write_text(os.path.join(workdir, "hard_set.md"), text)
  files_lib.atomic_write_text(
      os.path.join(workdir, "hard_set.json"),
      json.dumps({"overrides": _CONFIG.value(), "wall_s": wall,
                  "user_s": c1.user - c0.user,
                  "sys_s": c1.system - c0.system, "token_ratio": ratio,
                  "tokens_per_step": tokens_per_step(pcfg),
                  "draws": per_draw}, indent=1))
  print(text, flush=True)


if __name__ == "__main__":
  app.run(main)
