"""The tuning noise floor: how much of a result line is the optimiser.
:func:`run` tunes a sweep's left-panel draws again into
``DIR/replicates.jsonl``, never altering the sweep's lines;
:func:`summarize` and :func:`arm_floor` give the floor."""

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from hmmprompt import files as files_lib
from hmmprompt import protocol
from hmmprompt import tuning
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import sweep

REPLICATES = "replicates.jsonl"
FLOOR = "noise_floor.json"  # what a results directory's report reads
PERTURBED = -1  # the replicate index of the perturbed backbone's line
ARMS = ("head", "prompt")  # Figure 3's, keyed by method; others by name
_STREAM = 7_000  # replicate r > 0: fold_in(tune key, _STREAM + r), unused


@dataclasses.dataclass(frozen=True)
class ReplicateLine(files_lib.Line):
  """One tuning of one cell: ``replicate`` r >= 0 its r-th tuning seed (0:
  the sweep's line), :data:`PERTURBED` the seed-0 tuning on :func:`perturb`."""

  backbone: str
  size: int
  trial: int
  task: int
  method: str  # head | prompt, or an arm's ResultLine.method (linear head)
  replicate: int
  setup: str
  test_accuracy: float
  final_loss: float
  rel: float = 0.0

  KEY_FIELDS = ("backbone", "size", "trial", "task", "method", "replicate",
                "setup")
  WHAT = "replicate line"


def replicate_key(setup: configs.Setup, trial: int, task: int, r: int):
  """Replicate ``r``'s key: :func:`protocol.tune_key`, folded if r > 0."""
  key = protocol.tune_key(setup, trial, task)
  return key if r <= 0 else jax.random.fold_in(key, _STREAM + r)


def perturb(key, params, rel: float):
  """``params`` times ``1 + rel * N(0, 1)`` elementwise, an HMM's rows
  renormalised (zeros stay zero); ``rel`` = 0: ``params`` themselves."""
  if rel == 0:
    return params
  leaves, treedef = jax.tree.flatten(params)
  params = jax.tree.unflatten(treedef, [
      x * (1 + rel * jax.random.normal(k, x.shape, x.dtype))
      for k, x in zip(jax.random.split(key, len(leaves)), leaves)])
  if hasattr(params, "transition"):  # hmm.HMM: rows sum to one again
    params = jax.tree.map(lambda x: x / x.sum(-1, keepdims=True), params)
  return params


def path(workdir: str) -> str:  # the replicates' file
  return os.path.join(workdir, REPLICATES)


def run(setup: configs.Setup, workdir: str, backbone_name: str,
        sizes: Sequence[int], trials: int, replicates: int, rel: float = 1e-6,
        log: Callable[[str], object] = print, arms: Sequence[str] = ARMS
        ) -> None:
  """Appends to ``DIR/replicates.jsonl`` the first ``trials`` draws of each
  left-panel size in ``sizes``: each arm (:func:`configs.parse_arm`; those
  without a meaning on the backbone left out), ``replicates`` seeds each,
  and unless ``rel`` = 0 the perturbed backbone, on the sweep's
  transformers; a rerun resumes."""
  if min(trials, replicates) < 2 or trials > setup.trials:
    raise ValueError(f"a noise floor needs --trials and --replicates >= 2, "
                     f"--trials <= the setup's {setup.trials}; got --trials="
                     f"{trials} --replicates={replicates}")
  fp = setup.fingerprint(backbone_name)
  done = {(r.backbone, r.size, r.method) for r in files_lib.read_lines(
      path(workdir), ReplicateLine) if r.setup == fp}
  features = setup.features[0]
  for size in sizes:
    mid = protocol.vanilla(size)
    groups = {}
    for spec in arms:
      method, settings = configs.parse_arm(spec, setup.tune)
      g = protocol.Group(mid, method, "linear", features, settings=settings)
      if backbone_name == "transformer" or not tuning.METHODS[
          method].needs_finetunable:
        groups[spec if spec in ARMS else g.method_name] = g
    todo = [m for m in groups if (backbone_name, size, m) not in done]
    if not todo:
      continue
    stack = protocol.draw_stack(setup, mid, configs.stack_sizes(setup)[mid],
                                setup.tasks_per_hmm)
    held = sweep.Trials(stack, *sweep.backbones(
        workdir, setup, mid, stack.models_K, backbone_name))
    for method in todo:
      cfg = groups[method].tune_config(setup.tune)
      lines = []
      for backbone, params, ids in held.by_depth(list(range(trials))):
        lines += _tune(setup, cfg, backbone, params, ids, stack, replicates,
                       rel, backbone_name, size, fp, method)
      files_lib.append_lines(path(workdir), lines)
      log(f"{backbone_name} |H| = {size} {method}: {len(lines)} replicate "
          f"lines")


def _tune(setup, cfg, backbone, params_K, ids, stack, replicates, rel,
          backbone_name, size, fp, name) -> list[ReplicateLine]:
  """Trials ``ids`` (rows of ``params_K``): every task x replicate a lane
  of one program, then (``rel`` > 0) the perturbed backbone's seed-0 lanes."""
  tasks = range(setup.tasks_per_hmm)
  data = [[tuning.data_from_task(stack.tasks[k][s], cfg) for s in tasks]
          for k in ids]
  cells = [(s, r) for s in tasks for r in range(replicates)]
  res, _ = tuning.tune_trials(
      [[replicate_key(setup, k, s, r) for s, r in cells] for k in ids],
      backbone, params_K, [[d[s] for s, _ in cells] for d in data], cfg,
      lane_group=setup.lane_group())
  line = lambda k, s, r, acc, loss, rel=0.0: ReplicateLine(
      backbone_name, size, k, s, name, r, fp, float(acc), float(loss), rel)
  out = [line(k, s, r, res.test_accuracy[i, j], res.final_loss[i, j])
         for i, k in enumerate(ids) for j, (s, r) in enumerate(cells)]
  if rel == 0:
    return out
  shaken = perturb(jax.random.fold_in(jax.random.PRNGKey(setup.seed),
                                      _STREAM + size), params_K, rel)
  res_p, _ = tuning.tune_trials(
      [[replicate_key(setup, k, s, 0) for s in tasks] for k in ids],
      backbone, shaken, data, cfg, lane_group=setup.lane_group())
  return out + [line(k, s, PERTURBED, res_p.test_accuracy[i, s],
                     res_p.final_loss[i, s], rel)
                for i, k in enumerate(ids) for s in tasks]


def summarize(lines: Sequence[ReplicateLine]) -> dict:
  """Per ``(backbone, size, method)``, in accuracy points: ``seed_sd`` (the
  pooled within-draw standard deviation over tuning seeds), ``draw_sd``
  (between draws, of their seed-0 lines), ``seed_range`` (the largest
  spread of one draw's seeds), ``perturbed`` (the largest change of a
  seed-0 line under the perturbed backbone), ``draws``, ``seeds``."""
  by: dict = {}
  for r in lines:
    by.setdefault((r.backbone, r.size, r.method), {}).setdefault(
        (r.trial, r.task), {})[r.replicate] = 100.0 * r.test_accuracy
  out = {}
  for key, cells in sorted(by.items()):
    seeds = [np.array([v for r, v in sorted(c.items()) if r >= 0])
             for c in cells.values()]
    out[key] = {
        "draws": len(cells), "seeds": int(min(len(s) for s in seeds)),
        "seed_sd": float(np.sqrt(np.mean([s.var(ddof=1) for s in seeds]))),
        "draw_sd": float(np.std([c[0] for c in cells.values()], ddof=1)),
        "seed_range": float(max(np.ptp(s) for s in seeds)),
        "perturbed": float(max((abs(c[PERTURBED] - c[0])
                                for c in cells.values() if PERTURBED in c),
                               default=float("nan")))}
  return out


def arm_floor(summary: dict) -> dict:
  """Per ``(backbone, method)``: ``seed_sd`` pooled over sizes, the largest
  ``seed_range`` and ``perturbed`` of any size (points), the ``sizes``."""
  by: dict = {}
  for (backbone, size, method), s in summary.items():
    by.setdefault((backbone, method), {})[size] = s
  pool = lambda v, k, f=max: f([s[k] for s in v.values()])
  return {key: {"seed_sd": float(np.sqrt(pool(v, "seed_sd", lambda x: np.mean(
      np.square(x))))), "seed_range": pool(v, "seed_range"),
                "perturbed": pool(v, "perturbed"), "sizes": sorted(v)}
          for key, v in by.items()}


def difference_floor(floor: dict, backbone: str, a: str = "prompt",
                     b: str = "head") -> float | None:
  """The smallest one-draw difference between arms ``a`` and ``b`` called
  a difference: ``2 sqrt(sd_a^2 + sd_b^2)`` points, twice the sd of two
  independent tunings' difference; ``None`` unless both are measured."""
  fa, fb = floor.get((backbone, a)), floor.get((backbone, b))
  return (None if fa is None or fb is None
          else 2.0 * float(np.hypot(fa["seed_sd"], fb["seed_sd"])))


def write_floor(path_: str, floor: dict) -> None:
  """Writes :func:`arm_floor`'s ``floor`` as the JSON reports read."""
  files_lib.atomic_write_text(path_, json.dumps(
      [{"backbone": b, "method": m, **v} for (b, m), v in sorted(floor.items())],
      indent=1) + "\n")


def read_floor(path_: str) -> dict:
  """:func:`write_floor`'s file as ``{(backbone, method): stats}`` or {}."""
  if not os.path.exists(path_):
    return {}
  with open(path_) as f:
    return {(d.pop("backbone"), d.pop("method")): d for d in json.load(f)}


def adam_vs_optimum(lines) -> list[tuple]:
  """Rows per (backbone, panel, size) of result ``lines`` with both
  ``head_linear`` and ``head_linear_lbfgs``: lines, Adam below its L-BFGS
  optimum by > 1 point (count), the mean and largest shortfall (points),
  and the mean prompt - head difference with each head (else blank)."""
  by: dict = {}
  for r in lines:
    by.setdefault((r.backbone, r.panel, r.size), {}).setdefault(
        (r.trial, r.task, r.features), {})[r.method] = 100 * r.test_accuracy
  rows = []
  for (backbone, panel, size), cells in sorted(by.items()):
    pairs = [c for c in cells.values()
             if "head_linear" in c and "head_linear_lbfgs" in c]
    if not pairs:
      continue
    short = np.array([c["head_linear_lbfgs"] - c["head_linear"] for c in pairs])
    with_p = [c for c in pairs if "prompt_linear" in c]
    gap = lambda head, cs=with_p: "" if not cs else (
        f"{np.mean([c['prompt_linear'] - c[head] for c in cs]):+.1f}")
    rows.append((backbone, panel, size, len(pairs), int((short > 1).sum()),
                 f"{short.mean():.1f}", f"{short.max():.1f}",
                 gap("head_linear"), gap("head_linear_lbfgs")))
  return rows


def reproduction(lines, committed) -> list[tuple]:
  """Rows per (backbone, method, size): the lines of ``lines`` whose key
  ``committed`` holds, how many differ, and the largest difference in
  test accuracy (points) and pretraining gap (nats)."""
  theirs = {r.key(): r for r in committed}
  by: dict = {}
  for r in lines:
    if (c := theirs.get(r.key())) is not None:
      by.setdefault((r.backbone, r.method, r.size), []).append((r, c))
  return [(b, m, size, len(pairs),
           sum(r.test_accuracy != c.test_accuracy for r, c in pairs),
           f"{100 * max(abs(r.test_accuracy - c.test_accuracy) for r, c in pairs):.1f}",
           "" if pairs[0][0].pretrain_ce_gap is None else
           f"{max(abs(r.pretrain_ce_gap - c.pretrain_ce_gap) for r, c in pairs):.4f}")
          for (b, m, size), pairs in sorted(by.items())]
