"""Where the posterior lives, its sweep: probes scored into DIR/probes.jsonl."""

import dataclasses
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from hmmprompt import corpus
from hmmprompt import files as files_lib
from hmmprompt import generative
from hmmprompt import hmm as hmm_lib
from hmmprompt import icl
from hmmprompt import identity as identity_lib
from hmmprompt import mess3
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import probes
from hmmprompt import protocol
from hmmprompt import scheduling
from hmmprompt import smoothing
from hmmprompt.backbones import transformer
from hmmprompt.probing.setup import STUDIES, ProbeSetup, check_inputs

CONTROLS = ("trained", "random", "shuffled")
_STREAM = 9_000  # probe sequences: fold_in(root, this + study's index)


@dataclasses.dataclass(frozen=True)
class ProbeLine(files_lib.Line):
  """One transformer (``trial``) under one control on one target: a list entry
  per probed input, named by ``inputs`` (``embed``, ``block i``, ``output``)."""

  study: str
  model: str  # mess3 | a figure3 model tag | ginc
  trial: int
  target: str  # belief | latent | concept | state
  where: str  # positions: all | mask | documents | k=<examples>
  control: str  # CONTROLS
  setup: str
  hmm_fingerprint: str
  inputs: list
  r2: list
  tv: list
  kl: list
  peak: list  # the projected prediction's mean largest probability
  peak_exact: float  # the exact posterior's
  label_acc: list | None  # the probe's label accuracy (the tasks)
  layers: int  # the trial's own depth (a shallower one is zero-padded)
  ce_gap: float | None  # its pretraining's held-out CE gap
  rows: int  # held-out rows the scores average
  seconds: float
  label_r2: list | None = None  # the R² of its label scores mu @ p

  KEY_FIELDS = ("study", "model", "trial", "target", "where", "control",
                "setup")
  WHAT = "probe line"
  PROGRESS = "best_r2"  # run_stacks' progress line

  @property
  def best_r2(self) -> float:
    return max(self.r2[:-1])


def lines_path(workdir: str) -> str:
  return os.path.join(workdir, "probes.jsonl")


def read_probe_lines(workdir: str) -> list[ProbeLine]:
  return files_lib.read_lines(lines_path(workdir), ProbeLine)


@dataclasses.dataclass(frozen=True)
class Source:
  """A stack of :func:`protocol.run_stacks`: one study's model."""

  study: str
  tag: str
  size: int = 0
  mid: protocol.ModelId | None = None


@dataclasses.dataclass(frozen=True)
class Group:
  source: Source
  control: str

  def __str__(self) -> str:
    return self.control

  def keys(self, setup: ProbeSetup) -> dict[tuple, tuple]:
    s, fp = self.source, setup.fingerprint()
    trials = {"mess3": setup.mess3_seeds, "tasks": setup.tasks_trials,
              "ginc": setup.ginc_seeds}[s.study]
    return {(k, t, w): (s.study, s.tag, k, t, w, self.control, fp)
            for k in range(trials) for t, w in _cases(setup, s.study)}


def _cases(setup: ProbeSetup, study: str) -> list[tuple[str, str]]:
  if study == "mess3":
    return [("belief", "all")]
  if study == "tasks":
    return [("latent", "mask")]
  g = setup.ginc()
  wheres = ["documents"] + [f"k={k}" for k in setup.ginc_examples
                            if g.fits(setup.ginc_length, k, "transformer")]
  return [(t, w) for t in ("concept", "state") for w in wheres]


def plan(setup: ProbeSetup) -> dict[Source, list[Group]]:
  """The stacks by study, each with a group per control."""
  sources = [Source("mess3", "mess3")] if "mess3" in setup.studies else []
  if "tasks" in setup.studies:
    mids = ([protocol.vanilla(n) for n in setup.tasks_sizes]
            + [protocol.memory(m) for m in setup.tasks_memory_sizes])
    sources += [Source("tasks", m.tag, m.size, m) for m in mids]
  if "ginc" in setup.studies:
    sources.append(Source("ginc", "ginc", 1_000))
  return {s: [Group(s, c) for c in CONTROLS] for s in sources}


def check_workdir(workdir: str, setup: ProbeSetup) -> None:
  """Stamps DIR/probes.json (``ValueError`` if it holds another setup's)."""
  check_inputs(setup)
  files_lib.stamp(os.path.join(workdir, "probes.json"), setup.identity(),
                  "probe setup", defaults=identity_lib.added_defaults(setup))


def _stack(setup: ProbeSetup, study: str, hmm_model, n: int, length: int):
  """``(inputs [N, T], predicted [N, T, H])``: ``n`` causal inputs from
  ``hmm_model`` (``MASK`` then ``x_{<T}``) and ``P[H_t | x_{<t}]``."""
  key = jax.random.fold_in(jax.random.PRNGKey(setup.seed),
                           _STREAM + STUDIES.index(study))
  tokens = corpus.sample_sequences(key, hmm_model, n, length)
  return corpus.next_token_inputs(tokens), _predicted(hmm_model, tokens)


@jax.jit
def _predicted(hmm: hmm_lib.HMM, tokens_NxT):
  one = lambda t: smoothing.predicted(hmm, hmm_lib.token_evidence(hmm, t))
  pred = jax.vmap(one)(tokens_NxT)
  return pred / pred.sum(-1, keepdims=True)


Case = tuple  # (inputs [K, N, T], targets [K, N, P, H], positions, split, mu)
_K = lambda k, x: jnp.broadcast_to(x, (k,) + x.shape)  # one set for K models


def _mess3(workdir: str, setup: ProbeSetup) -> tuple:
  """Shai et al.'s belief ``P(S_t | x_<t)`` at every position."""
  model, k = mess3.as_hmm(mess3.edge_tensor()), setup.mess3_seeds
  fp = identity_lib.fingerprint(setup.mess3.identity(), digits=8)
  pdir = os.path.join(workdir, "pretrain", f"mess3-{fp}")
  pretrain_lib.run_trials(pdir, setup.mess3, generative.stack([model] * k),
                          log=logging.info)
  _, params, infos = pretrain_lib.load_trials(pdir)
  inputs, pred = _stack(setup, "mess3", model, setup.mess3_sequences,
                        setup.mess3.model.max_len)
  beliefs = pred.reshape(pred.shape[:2] + (3, 3)).sum(-1)  # pair i * 3 + s
  return params, infos, [generative.model_fingerprint(model)] * k, {
      ("belief", "all"): (_K(k, inputs), _K(k, beliefs), None, (0.6, 0.2),
                          None)}


def _tasks(workdir: str, setup: ProbeSetup, mid: protocol.ModelId) -> tuple:
  """The label's posterior at the ``MASK`` of each draw's task examples,
  the probe fitted on its train split, its ridge chosen on val."""
  fsetup = setup.tasks()
  stack = protocol.draw_stack(fsetup, mid, setup.tasks_trials)
  _, params, infos = protocol.pretrained(workdir, fsetup, mid, stack.models_K)
  tasks = [t[0] for t in stack.tasks]
  cat = lambda f: jnp.stack([jnp.concatenate([getattr(getattr(t, s), f) for s
                                              in ("train", "val", "test")])
                             for t in tasks])
  n, cfg = cat("labels").shape[1], fsetup.task
  return params, infos, stack.fingerprints, {("latent", "mask"): (
      cat("tokens"), cat("latent")[:, :, None], (0,),
      (cfg.num_train / n, cfg.num_val / n), jnp.stack([t.mu for t in tasks]))}


def _ginc(workdir: str, setup: ProbeSetup) -> tuple:
  """The concept and state posteriors on documents of the mixture, every
  ``ginc_every`` positions, and at the end of each ``k``'s prompts (the
  reference's: GINC's prompts are impossible under the exact zeros)."""
  g = setup.ginc()
  stack = icl.prepare(workdir, g, icl.Backbone("transformer"))
  ref = icl.exact_model(stack["concepts"]["id"], icl.REFERENCE)
  per = len(ref.initial) // len(stack["concepts"]["id"].initial)
  pick = lambda target, p: p if target == "state" else p.reshape(
      p.shape[:-1] + (-1, per)).sum(-1)  # the concept's: its block's states
  length, k = g.pretrain.model.max_len, g.seeds
  inputs, pred = _stack(setup, "ginc", stack["mixture"],
                        setup.ginc_documents, length)
  at = np.arange(0, length, setup.ginc_every)
  cases: dict[tuple[str, str], Case] = {}
  for target, where in _cases(setup, "ginc"):
    if where == "documents":
      cases[target, where] = (_K(k, inputs), _K(k, pick(target, pred[:, at])),
                              at, (0.6, 0.2), None)
      continue
    tokens = icl.cell_prompts(g, stack["concepts"], "ID_sample",
                              setup.ginc_length, int(where[2:]))["tokens"]
    # Read after a start-of-text MASK and probed at the end; a padded last
    # token leaves P[H_T | x_<T] as it is (its evidence is not read).
    last = _predicted(ref, jnp.pad(tokens, ((0, 0), (0, 1))))[:, -1:]
    cases[target, where] = (
        _K(k, jnp.pad(tokens, ((0, 0), (1, 0)), constant_values=hmm_lib.MASK)),
        _K(k, pick(target, last)), (tokens.shape[1],), (0.6, 0.2), None)
  return stack["params"], stack["infos"], [stack["fingerprint"]] * k, cases


def prepare(workdir: str, setup: ProbeSetup, source: Source) -> dict:
  """A stack: its transformers (pretrained or resumed, bit for bit), the
  deepest one's config, its cases ``{(target, where): Case}``."""
  if source.study == "tasks":
    assert source.mid is not None
    params, infos, fps, cases = _tasks(workdir, setup, source.mid)
  else:
    params, infos, fps, cases = (_mess3 if source.study == "mess3"
                                 else _ginc)(workdir, setup)
  cfgs = [i.config.model for i in infos]
  return {"params": params, "cfg": max(cfgs, key=lambda m: m.num_layers),
          "layers": [m.num_layers for m in cfgs], "cases": cases,
          "fingerprints": fps,
          "ce_gaps": [i.metrics.get("ce_gap") for i in infos]}


def score_group(workdir: str, setup: ProbeSetup, g: Group, stack: dict
                ) -> list[ProbeLine]:
  """``g``'s lines: each case's probes of every input, per trial."""
  params, cfg, num = stack["params"], stack["cfg"], len(stack["layers"])
  if g.control == "random":
    keys = jax.random.split(jax.random.PRNGKey(setup.seed + 1), num)
    params = jax.vmap(lambda key: transformer.init_params(key, cfg))(keys)
  names = (["embed"] + [f"block {i + 1}" for i in range(cfg.num_layers)]
           + ["output"])
  out = []
  for (target, where), (inputs, y, at, split, mu) in stack["cases"].items():
    t0 = time.perf_counter()
    s = probes.layer_scores(
        cfg, params, inputs, y, at, split, mu, shuffle=g.control == "shuffled",
        keep=g.source.study == "mess3" and g.control == "trained")
    if "kept" in s:
      from hmmprompt.probing import report  # pylint: disable=g-import-not-at-top
      report.write_simplex(workdir, s["kept"], s["r2"])
    seconds = time.perf_counter() - t0
    rows = (inputs.shape[1] - int(inputs.shape[1] * sum(split))) * y.shape[2]
    lst = lambda v, k: [float(x) for x in v[:, k]]
    out += [ProbeLine(
        study=g.source.study, model=g.source.tag, trial=k, target=target,
        where=where, control=g.control, setup=setup.fingerprint(),
        hmm_fingerprint=stack["fingerprints"][k], inputs=names,
        r2=lst(s["r2"], k), tv=lst(s["tv"], k), kl=lst(s["kl"], k),
        peak=lst(s["peak"], k), peak_exact=float(s["peak_exact"][0, k]),
        **{f: lst(s[f], k) if f in s else None
           for f in ("label_acc", "label_r2")},
        layers=stack["layers"][k], ce_gap=stack["ce_gaps"][k], rows=rows,
        seconds=seconds) for k in range(num)]
  return out


def run_probes(setup: ProbeSetup, workdir: str,
               schedule: scheduling.Schedule = scheduling.EVERYTHING
               ) -> list[ProbeLine]:
  """Runs the groups without lines in DIR/probes.jsonl; returns all lines
  (``ValueError``: the workdir holds another setup's)."""
  check_workdir(workdir, setup)
  return protocol.run_lines(
      plan(setup), lambda: read_probe_lines(workdir), lambda g: g.keys(setup),
      lambda s, _: prepare(workdir, setup, s),
      lambda g, stack: score_group(workdir, setup, g, stack),
      lines_path(workdir), schedule)
