r"""The hard set: pretrain the 15 hard HMM draws with a recipe and report
how fast each comes within 0.04 nats of the Bayes CE (issue 30, part 1).

  python -m experiments.hard_set --workdir=DIR [--recipe=cpu_adamw] \
      [--config.pretrain.model.num_layers=4 --config.pretrain.lr=3e-3 ...] \
      [--config.only=h28t2,m7t0] [--bench_steps=60]

The hard set (:data:`HARD_SET`): the main job's 5 draws that end above
0.04 nats at its cap (``hmmprompt/figure3/configs.py``'s ``cpu`` preset: ``|H|`` =
12 trial 0, ``|H|`` = 28 trials 0-2, memory ``|M|`` = 7 trial 0) and
trials 0-4 of ``|H|`` = 25 and ``|H|`` = 30 from the ``paper`` preset's
streams. Trial ``k`` of a size is the sweep's own draw
(``generative.random_model(fold_in(protocol.model_key(setup, mid), k))``) and is
pretrained with seed ``pretrain.seed + k``, as in the sweep's stack, so a
run of the main job's recipe here reproduces the main job's gaps.

The config tree is ``pretrain`` (the ``--recipe`` preset, ``cpu_capped``
or ``cpu_adamw``, the main job's before issue 30; every leaf a
``--config.pretrain.<path>`` flag, as the figure3 binary takes them) and
``only`` (draw tags such as ``h28t2``, ``m7t0``; empty: all 15). Each
recipe trains in its own directory ``DIR/<fingerprint>/`` (one
``run_trials`` stack per size; rerunning resumes). Training tokens are
``steps x batch_size x chunk_len``. The report prints, per draw, the
held-out CE gap at the first evaluation at or past 1, 2.5 and 5 M tokens
(a draw that stopped at the target earlier keeps its stopping gap), and the
tokens at the first evaluation within 0.04 nats, then the run's wall, user
and sys time (this process, compiles included). ``--bench_steps=N`` first
times N train steps of the recipe against N of ``cpu_adamw`` on one
``|H|`` = 28 draw, interleaved in this process, and prints the cost per
token as a ratio (what a shared machine can still compare).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time

from absl import app
from absl import flags
import jax

from experiments import cli
from hmmprompt.figure3 import configs
from hmmprompt import protocol
from hmmprompt import config_flags
from hmmprompt import corpus as corpus_lib
from hmmprompt import glibc
from hmmprompt import generative
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import files as files_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.pretrain import train as train_lib
from hmmprompt.pretrain import workdir as workdir_lib

TARGET = 0.04
MARKS = (1.0e6, 2.5e6, 5.0e6)
# The budget: cpu_adamw's cap, 2000 steps x 32 x 80 = 5.12 M tokens (the
# first evaluation at or past 5 M at eval_every 100).
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
    Draws("cpu", protocol.memory(7),
          (0,), "m7"),
)


# The cpu_paper protocol's draws above 0.04 at its cap that the hard set
# does not hold (it holds |H| = 25 t2, 30 t0 and 28 t2, the right panel's
# |H| = 28 trial 2 being the main job's): the same streams (cpu_paper and
# paper share the seed).
PROTOCOL_MISSES = (
    Draws("paper", protocol.vanilla(25), (13, 18), "h25"),
    Draws("paper", protocol.vanilla(30), (10, 11, 12, 16, 19), "h30"),
)
# The ten draws of the cpu_paper protocol that fell back to 4 layers
# (docs/figure3.md): with its recipe and fallback settings, the run of
# each reproduces the protocol's 2-layer steps, then its fallback.
PROTOCOL_FALLBACKS = (
    Draws("paper", protocol.vanilla(25), (2, 13, 18), "h25"),
    Draws("cpu", protocol.vanilla(28), (2,), "h28"),
    Draws("paper", protocol.vanilla(30), (0, 10, 11, 12, 16, 19), "h30"),
)
# The first 20 draws of three cpu_paper sizes whose draws mostly stop at
# the first cycle's end (all 20, 17 and 14 of them at step 250): what a
# shorter first cycle would stop.
PROTOCOL_EASY = tuple(Draws("paper", protocol.vanilla(h), tuple(range(20)),
                            f"h{h}") for h in (4, 10, 15))
SETS = {"hard": HARD_SET, "protocol_misses": PROTOCOL_MISSES,
        "protocol_fallbacks": PROTOCOL_FALLBACKS,
        "protocol_easy": PROTOCOL_EASY}


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
    bad = [t for t in self.only if t not in known]
    if bad:
      raise ValueError(f"--config.only: unknown draws {bad}; known: "
                       f"{','.join(known)}")


def default_config(recipe: str = "cpu_capped") -> HardSetConfig:
  # Evaluations every 100 steps (256 k tokens at batch 32 x 80): they show
  # the marks and the first step within the target; they change no result
  # (a run stops only at the end of a cycle, where it always evaluates).
  return HardSetConfig(pretrain=pretrain_lib.configure(
      recipe, protocol.VOCAB, eval_every=100))


def draw_models(draws: Draws) -> generative.Model:
  """The sweep's trials ``0..max(draws.trials)`` of ``draws``' size."""
  setup = configs.get_setup(draws.preset)
  mid = draws.model_id
  return generative.random_models(protocol.model_key(setup, mid),
                              max(draws.trials) + 1, mid.hmm, mid.num_states,
                              protocol.VOCAB, mid.memory_size)


def _runs(trials: list[int]) -> list[list[int]]:
  """Maximal runs of consecutive trials."""
  out = []
  for k in sorted(trials):
    if out and out[-1][-1] == k - 1:
      out[-1].append(k)
    else:
      out.append([k])
  return out


def recipe_fingerprint(cfg: pretrain_lib.PretrainConfig) -> str:
  return hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True).encode()
                        ).hexdigest()[:8]


def tokens_per_step(cfg: pretrain_lib.PretrainConfig) -> int:
  return cfg.batch_size * cfg.corpus.chunk_len


def pretrain_hard_set(workdir: str, cfg: HardSetConfig, log=print,
                      train: bool = True) -> dict:
  """Pretrains the selected draws; ``{tag: [metrics lines]}`` (``train``
  False: only reads what ``workdir`` holds, e.g. of a run still going)."""
  out = {}
  for draws in SETS[cfg.draws]:
    chosen = [k for k, t in zip(draws.trials, draws.tags())
              if not cfg.only or t in cfg.only]
    if not chosen:
      continue
    stack = draw_models(draws)
    for run in _runs(chosen):
      # Trial k of the sweep's stack trains with seed pretrain.seed + k:
      # a run of trials k0..k1 starts at seed + k0 (run_trials adds j).
      pcfg = cfg.pretrain.with_overrides(seed=cfg.pretrain.seed + run[0])
      if pcfg.state_loss > 0:  # the readout has the HMM's state count
        pcfg = pcfg.with_overrides(model=dataclasses.replace(
            pcfg.model, state_readout=int(generative.as_hmm(
                generative.trial(stack, 0)).transition.shape[-1])))
      sub = generative.stack([generative.trial(stack, k) for k in run])
      pdir = os.path.join(workdir, f"{draws.name}-t{run[0]}-{run[-1]}")
      if train:
        log(f"pretraining {draws.name} trials {run} in {pdir}")
        pretrain_lib.run_trials(pdir, pcfg, sub, log=log)
      elif not os.path.exists(workdir_lib.Paths.of(pdir).metrics):
        continue
      lines = workdir_lib.read_metrics(workdir_lib.Paths.of(pdir))
      for j, k in enumerate(run):
        out[f"{draws.name}t{k}"] = [m for m in lines
                                    if m.get("trial", 0) == j]
        deep = workdir_lib.Paths.of(workdir_lib.fallback_dir(pdir, j))
        if os.path.exists(deep.metrics):  # its steps count from the stop
          out[f"{draws.name}t{k}-{pcfg.fallback_layers}L"] = (
              workdir_lib.read_metrics(deep))
  return out


def read_hard_set(workdir: str) -> dict:
  """``{tag: [metrics lines]}`` of every draw trained in ``workdir``,
  whatever runs (``DIR/<name>-t<k0>-<k1>/``) its trials were grouped in;
  in :data:`SETS`' order."""
  found = {}
  for entry in sorted(os.listdir(workdir)):
    m = re.fullmatch(r"([a-z]+\d+)-t(\d+)-(\d+)", entry)
    path = workdir_lib.Paths.of(os.path.join(workdir, entry)).metrics
    if not m or not os.path.exists(path):
      continue
    lines = workdir_lib.read_metrics(workdir_lib.Paths.of(
        os.path.join(workdir, entry)))
    for j in range(int(m[3]) - int(m[2]) + 1):
      found[f"{m[1]}t{int(m[2]) + j}"] = [
          x for x in lines if x.get("trial", 0) == j]
  order = list(dict.fromkeys(t for draws in SETS.values() for d in draws
                             for t in d.tags()))
  return {t: found[t] for t in order if t in found}


def summarize(lines: list[dict], tok_step: int) -> dict:
  """Gaps at the marks and the tokens to the target, from one trial's
  evaluations (``step`` ascending)."""
  lines = sorted(lines, key=lambda m: m["step"])
  at = {}
  for mark in MARKS:
    past = [m for m in lines if m["step"] * tok_step >= mark]
    # A trial that stopped before the mark keeps its last gap.
    m = past[0] if past else (lines[-1] if lines else None)
    at[mark] = None if m is None else (m["ce_gap"], m["step"] * tok_step)
  hit = [m for m in lines if m["ce_gap"] <= TARGET]
  return {"at": at, "to_target": hit[0]["step"] * tok_step if hit else None,
          "final": (lines[-1]["ce_gap"], lines[-1]["step"] * tok_step)
          if lines else None}


def hard_set_table(per_draw: dict, tok_step: int) -> str:
  rows = ["| draw | gap @1M | gap @2.5M | gap @5M | M tokens to 0.04 |",
          "|---|---|---|---|---|"]
  n_in = 0
  for tag, lines in per_draw.items():
    s = summarize(lines, tok_step)
    cells = []
    for mark in MARKS:
      v = s["at"][mark]
      cells.append("" if v is None else f"{v[0]:.3f}")
    reached = s["to_target"] is not None and s["to_target"] <= BUDGET
    n_in += reached
    to = ("> {:.2f}".format(s["final"][1] / 1e6) if s["to_target"] is None
          else f"{s['to_target'] / 1e6:.2f}")
    rows.append(f"| {tag} | " + " | ".join(cells) + f" | {to} |")
  rows.append(f"\n{n_in} of {len(per_draw)} within {TARGET} by "
              f"{BUDGET / 1e6:.2f} M tokens "
              f"({tok_step} tokens per step).")
  return "\n".join(rows)


def bench_ratio(cfg: pretrain_lib.PretrainConfig, steps: int,
                rounds: int = 5) -> float:
  """Time per training token of ``cfg`` over ``cpu_adamw``'s (the main
  job's recipe before issue 30), stepping
  one ``|H|`` = 28 draw, the two interleaved in ``rounds`` blocks (so load
  from other work falls on both alike)."""
  base = default_config("cpu_adamw").pretrain
  hmm_model = generative.trial(draw_models(HARD_SET[2]), 0)
  mesh = sharding_lib.data_mesh()
  hmms = jax.tree.map(lambda x: x[None], generative.as_hmm(hmm_model))

  def setup(c):
    step = train_lib.make_train_step(c, mesh)
    states = train_lib.init_states(jax.random.split(jax.random.PRNGKey(0), 1),
                                   c)
    get = jax.jit(jax.vmap(lambda k, s: corpus_lib.batch_at(
        k, s, hmm_model, None, c.corpus, c.batch_size, c.model.vocab_size),
                           in_axes=(0, None)))
    key = jax.random.split(jax.random.PRNGKey(1), 1)
    batches = [get(key, s) for s in range(4)]
    for i in range(5):  # compile, warm up
      states, loss = step(states, *batches[i % 4], hmms)
    jax.block_until_ready(loss)
    return [step, states, batches]

  runs = {"base": setup(base), "cand": setup(cfg)}
  spent = {"base": 0.0, "cand": 0.0}
  per = max(steps // rounds, 1)
  for _ in range(rounds):
    for name, r in runs.items():
      t0 = time.perf_counter()
      for i in range(per):
        r[1], loss = r[0](r[1], *r[2][i % 4], hmms)
      jax.block_until_ready(loss)
      spent[name] += time.perf_counter() - t0
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
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _WORKDIR.value:
    raise app.UsageError("--workdir is required")
  glibc.retain_freed_memory()
  try:
    cfg = config_flags.apply(default_config(_RECIPE.value), _CONFIG.value())
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  pcfg = cfg.pretrain
  workdir = os.path.join(_WORKDIR.value, recipe_fingerprint(pcfg))
  os.makedirs(workdir, exist_ok=True)
  files_lib.atomic_write_text(os.path.join(workdir, "recipe.json"),
                                json.dumps({"overrides": _CONFIG.value(),
                                            "pretrain": pcfg.to_json()},
                                           indent=1))
  print(f"recipe {recipe_fingerprint(pcfg)}: overrides {_CONFIG.value()}",
        flush=True)
  if _REPORT_ONLY.value:  # every draw of DIR, however grouped
    print(hard_set_table(read_hard_set(workdir), tokens_per_step(pcfg)))
    return
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
