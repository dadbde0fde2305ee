r"""The hard set: pretrain hard HMM draws with a recipe, in
``DIR/<fingerprint>/``; how fast each comes within 0.04 nats of the Bayes CE
(docs/pretraining.md, "The hard set").

  python -m experiments.hard_set --workdir=DIR [--recipe=cpu_adamw] \
      [--config.pretrain.model.num_layers=4 --config.pretrain.lr=3e-3 ...] \
      [--config.draws=hard --config.only=h28t2,m7t0] [--bench_steps=60]
"""

import dataclasses
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
from hmmprompt import identity as identity_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.pretrain import workdir as workdir_lib

TARGET, BUDGET = 0.04, 2000 * 32 * 80  # nats above the Bayes CE, by tokens
MARKS = (1.0e6, 2.5e6, 5.0e6)  # tokens at which the report takes the gaps


@dataclasses.dataclass(frozen=True)
class Draws:
  """Trials of one size from ``preset``'s streams, tagged ``<name>t<k>``."""
  preset: str
  model_id: protocol.ModelId
  trials: tuple[int, ...]
  name: str  # h28, m7

  def tags(self) -> list[str]:
    return [f"{self.name}t{k}" for k in self.trials]


def _vanilla(h: int, trials, preset: str = "paper") -> Draws:
  return Draws(preset, protocol.vanilla(h), tuple(trials), f"h{h}")


HARD_SET = (_vanilla(12, [0], "cpu"), _vanilla(25, range(5)),
            _vanilla(28, range(3), "cpu"), _vanilla(30, range(5)),
            Draws("cpu", protocol.memory(7), (0,), "m7"))
# --config.draws (docs/figure3.md): the cpu_paper protocol's misses beyond
# the hard set's, its ten 4-layer fallbacks, and three easy sizes' first 20.
SETS = {"hard": HARD_SET, "protocol_misses": (
            _vanilla(25, [13, 18]), _vanilla(30, [10, 11, 12, 16, 19])),
        "protocol_fallbacks": (_vanilla(25, [2, 13, 18]), _vanilla(
            28, [2], "cpu"), _vanilla(30, [0, 10, 11, 12, 16, 19])),
        "protocol_easy": tuple(_vanilla(h, range(20)) for h in (4, 10, 15))}


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
  return HardSetConfig(pretrain=pretrain_lib.configure(
      recipe, protocol.VOCAB, eval_every=100))  # the marks; no result moves


def draw_models(draws: Draws) -> generative.Model:
  """The sweep's trials ``0..max(draws.trials)`` of ``draws``' size."""
  mid = draws.model_id
  return generative.random_models(
      protocol.model_key(configs.get_setup(draws.preset), mid),
      max(draws.trials) + 1, mid.hmm, mid.num_states, protocol.VOCAB,
      mid.memory_size)


def pretrain_hard_set(workdir: str, cfg: HardSetConfig, log=print) -> dict:
  """Pretrains the selected draws; ``{tag: [metrics lines]}``."""
  out = {}
  for draws in SETS[cfg.draws]:
    chosen = [k for k, t in zip(draws.trials, draws.tags())
              if not cfg.only or t in cfg.only]
    if not chosen:
      continue
    stack = draw_models(draws)
    for _, group in itertools.groupby(enumerate(sorted(chosen)),
                                      lambda ik: ik[1] - ik[0]):
      run = [k for _, k in group]  # a maximal run of consecutive trials
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
  """``{tag: [metrics lines]}`` of every draw in ``workdir``, as in SETS."""
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
  """Per draw, the gap at the first evaluation past each of MARKS (stopped
  before: its last) and the tokens to TARGET."""
  rows, n_in = [], 0
  for tag, lines in per_draw.items():
    lines = sorted(lines, key=lambda m: m["step"])
    gaps = [next((m["ce_gap"] for m in lines if m["step"] * tok_step >= mark),
                 lines[-1]["ce_gap"] if lines else None) for mark in MARKS]
    hit = next((m["step"] * tok_step for m in lines
                if m["ce_gap"] <= TARGET), None)
    n_in += hit is not None and hit <= BUDGET
    rows.append([tag, *("" if g is None else f"{g:.3f}" for g in gaps),
                 f"> {lines[-1]['step'] * tok_step / 1e6:.2f}" if hit is None
                 else f"{hit / 1e6:.2f}"])
  return "\n".join(files_lib.markdown_table(
      ("draw", "gap @1M", "gap @2.5M", "gap @5M", "M tokens to 0.04"), rows)
      + [f"\n{n_in} of {len(per_draw)} within {TARGET} by "
         f"{BUDGET / 1e6:.2f} M tokens ({tok_step} tokens per step)."])


def bench_ratio(cfg: pretrain_lib.PretrainConfig, steps: int) -> float:
  """``cfg``'s time per token over ``cpu_adamw``'s, |H| = 28, interleaved."""
  base = default_config("cpu_adamw").pretrain
  hmm_model = generative.trial(draw_models(HARD_SET[2]), 0)
  hmms = jax.tree.map(lambda x: x[None], generative.as_hmm(hmm_model))
  per = max(steps // 5, 1)
  key0, key1 = (jax.random.split(jax.random.PRNGKey(i), 1) for i in (0, 1))
  def steps_of(c):  # ``per`` train steps of ``c``, its state carried
    get = jax.jit(jax.vmap(lambda k, s: corpus_lib.batch_at(k, s, hmm_model,
        None, c.corpus, c.batch_size, c.model.vocab_size), in_axes=(0, None)))
    batches = [get(key1, s) for s in range(4)]
    return harness.train_steps(
        pretrain_lib.make_train_step(c, sharding_lib.data_mesh()),
        lambda i: batches[i % 4], pretrain_lib.init_states(key0, c), hmms, per)
  spent = harness.interleaved(
      {"base": steps_of(base), "cand": steps_of(cfg)}, 5)
  tokens = lambda c: c.batch_size * c.corpus.chunk_len  # per step
  return (spent["cand"] / tokens(cfg)) / (spent["base"] / tokens(base))


_WORKDIR = flags.DEFINE_string("workdir", None, "output directory")
_RECIPE = flags.DEFINE_enum("recipe", "cpu_capped", ["cpu_capped", "cpu_adamw"],
                            "pretraining preset under --config.pretrain")
_BENCH = flags.DEFINE_integer("bench_steps", 0, "first time this many steps "
                              "against cpu_adamw's: the per-token ratio")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "print the table of "
                                 "what DIR holds for the recipe; train none")
_BENCH_ONLY = flags.DEFINE_bool("bench_only", False, "stop after the ratio")
_CONFIG = cli.define_config(default_config())
flags.adopt_module_key_flags(cli)


def main(argv):
  cli.start(argv, workdir=_WORKDIR.value)
  with cli.usage_errors():
    cfg = config_flags.apply(default_config(_RECIPE.value), _CONFIG.value())
    cli.make_dir(_WORKDIR.value)
  pcfg = cfg.pretrain
  tok_step = pcfg.batch_size * pcfg.corpus.chunk_len
  fingerprint = identity_lib.fingerprint(pcfg.identity(), digits=8)
  workdir = os.path.join(_WORKDIR.value, fingerprint)
  os.makedirs(workdir, exist_ok=True)
  put = lambda name, text: files_lib.atomic_write_text(
      os.path.join(workdir, name), text)
  put("recipe.json", json.dumps({"overrides": _CONFIG.value(),
                                 "pretrain": pcfg.to_json()}, indent=1))
  print(f"recipe {fingerprint}: overrides {_CONFIG.value()}", flush=True)
  if _REPORT_ONLY.value:  # every draw of DIR, however grouped
    return print(hard_set_table(read_hard_set(workdir), tok_step))
  ratio = bench_ratio(pcfg, _BENCH.value) if _BENCH.value else None
  if ratio is not None:
    print(f"time per training token: {ratio:.2f}x cpu_adamw's "
          f"(interleaved, {_BENCH.value} steps each)", flush=True)
    if _BENCH_ONLY.value:
      return
  t0, c0 = time.perf_counter(), os.times()
  per_draw = pretrain_hard_set(workdir, cfg, log=lambda s: print(s, flush=True))
  c1 = os.times()
  spent = {"wall_s": time.perf_counter() - t0, "user_s": c1.user - c0.user,
           "sys_s": c1.system - c0.system}
  text = hard_set_table(per_draw, tok_step) + (
      "\n\nwall {wall_s:.0f} s, user {user_s:.0f} s, sys {sys_s:.0f} s (this "
      "process, this invocation: a resumed run counts only what it ran)"
  ).format(**spent)
  if ratio is not None:
    text += f"; time per token {ratio:.2f}x cpu_adamw's (interleaved)"
  put("hard_set.md", text + "\n")
  put("hard_set.json", json.dumps(
      {"overrides": _CONFIG.value(), **spent, "token_ratio": ratio,
       "tokens_per_step": tok_step, "draws": per_draw}, indent=1))
  print(text + "\n", flush=True)


if __name__ == "__main__":
  app.run(main)
