"""Figure 3 in chunks of size stacks (``experiments/in_chunks.py``), for a
machine lent for minutes that keeps nothing: a chunk computes what its
results directory lacks into one archive :func:`merge` adds back, a stack
past a deadline in parts (:class:`~hmmprompt.figure3.sweep.Parts`)."""

import dataclasses
import glob
import json
import os
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable

from absl import logging
import jax

from hmmprompt import protocol
from hmmprompt import scheduling
from hmmprompt.figure3 import configs
from hmmprompt.figure3 import schema
from hmmprompt.figure3 import reporting
from hmmprompt.figure3 import signals
from hmmprompt.figure3 import sweep
from hmmprompt import generative
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import files as files_lib
from hmmprompt import identity as identity_lib
from hmmprompt import sharding as sharding_lib
from hmmprompt.pretrain import report as pretrain_report

ARCHIVE = "figure3-chunk.tar.gz"
# Result-line fields that may differ between two runs of one cell.
TIMING_FIELDS = ("seconds", "pretrain_wall_s")
_REPORT_FILES = ("figure3.md", "figure3.png", pretrain_report.PLOT)
_PRETRAIN_FILES = ("metrics.jsonl", "config.json")
# What an archive may hold; anything else is refused (no path escapes).
_MEMBER = re.compile(r"(results\.jsonl|sweep\.json|run\.json|"
                     + "|".join(re.escape(f) for f in _REPORT_FILES)
                     + r"|pretrain/\w[\w.-]*/(fallback-\d+/)?"
                     r"(metrics\.jsonl|config\.json))")


def results_dir(preset: str) -> str:
  """``docs/results/figure3-<preset>``, ``_`` as ``-``."""
  return os.path.join("docs", "results", "figure3-" + preset.replace("_", "-"))


def chunk_sizes(setup: configs.Setup,
                chunk: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(left_sizes, memory_sizes)`` that ``chunk`` (``all``, ``left[:SIZES]``
  or ``right[:SIZES]``, else ``ValueError``) selects, shared stacks in both."""
  if chunk == "all":
    return setup.left_sizes, setup.memory_sizes
  panel, sep, text = chunk.partition(":")
  if panel not in ("left", "right"):
    raise ValueError(f"--chunk={chunk!r}: expected left:SIZES, right:SIZES, "
                     f"left, right or all (e.g. left:4,8)")
  known = chosen = setup.left_sizes if panel == "left" else setup.memory_sizes
  if sep:
    try:
      chosen = tuple(int(s) for s in text.split(","))
    except ValueError:
      raise ValueError(f"--chunk={chunk!r}: sizes must be comma-separated "
                       f"integers, e.g. {panel}:{known[0] if known else 4}"
                       ) from None
    if bad := [s for s in chosen if s not in known]:
      raise ValueError(
          f"--chunk={chunk!r}: {bad} not among the {panel} panel's sizes "
          f"{known} ({'|H|' if panel == 'left' else '|M|'}) of this preset")
  left = set(chosen) if panel == "left" else set()
  memory = set(chosen) if panel == "right" else set()
  # A vanilla twin of |M| that is a left size too: both panels or neither.
  syntax = protocol.MEMORY_SYNTAX_STATES
  memory |= {m for m in setup.memory_sizes if syntax * m in left}
  left |= {h for h in setup.left_sizes if h in {syntax * m for m in memory}}
  return (tuple(h for h in setup.left_sizes if h in left),
          tuple(m for m in setup.memory_sizes if m in memory))


def chunk_setup(setup: configs.Setup, chunk: str) -> configs.Setup:
  """``setup`` at :func:`chunk_sizes` (its lines key as the whole sweep's)."""
  left, memory = chunk_sizes(setup, chunk)
  if chunk != "all":
    logging.info("chunk %s: left sizes %s, memory sizes %s", chunk, left,
                 memory)
  return dataclasses.replace(setup, left_sizes=left, memory_sizes=memory)


def start_workdir(results_dir: str, workdir: str, setup: configs.Setup) -> int:
  """Checks that ``results_dir`` and ``workdir`` (kept: it resumes) hold
  only ``setup``'s results (else ``ValueError``), stamps ``workdir``, adds
  the lines it lacks and returns its line count."""
  sweep.check_workdir(results_dir, setup, write=False)
  os.makedirs(workdir, exist_ok=True)
  sweep.check_workdir(workdir, setup)
  files_lib.merge_lines(schema.results_path(workdir),
                        schema.read_results(results_dir))
  return len(schema.read_results(workdir))


def write_chunk_archive(workdir: str, path: str, run_info: dict) -> list[str]:
  """Writes ``path``: the results, ``sweep.json``, the pretraining metrics
  and configs, ``run_info`` as ``run.json`` (no report); returns the names."""
  runs = sorted(os.path.relpath(p, workdir) for pat in ("*", "*/fallback-*")
                for p in glob.glob(os.path.join(workdir, "pretrain", pat)))
  members = [n for n in ["results.jsonl", sweep.STAMP]
             + [os.path.join(r, f) for r in runs for f in _PRETRAIN_FILES]
             if os.path.exists(os.path.join(workdir, n))]
  files_lib.write_archive(path, workdir, members, {"run.json": json.dumps(
      run_info, indent=1, sort_keys=True).encode()})
  return members + ["run.json"]


def resolve_checkpoints(checkpoints: str | None, workdir: str | None,
                        deadline_s: float | None) -> str:
  """:func:`run_chunk`'s ``checkpoints`` (default: ``always`` in a kept
  ``workdir``, else ``never``); ``ValueError`` for one it cannot take."""
  checkpoints = pretrain_lib.check_checkpoints(
      checkpoints or ("never" if workdir is None else "always"))
  if workdir is None and checkpoints != "never":
    raise ValueError(f"--checkpoints={checkpoints} needs --workdir: a "
                     f"temporary workdir is never resumed")
  if checkpoints == "deadline" and deadline_s is None:
    raise ValueError("--checkpoints=deadline writes a checkpoint only where "
                     "--deadline_s stops a stack: set --deadline_s")
  return checkpoints


def run_chunk(setup: configs.Setup, chunk: str, backbone: str,
              results_dir: str, out_dir: str, budget_s: float | None = None,
              workdir: str | None = None, preset: str = "",
              compute: Callable | None = None, info: dict | None = None,
              deadline_s: float | None = None,
              checkpoints: str | None = None) -> dict:
  """Computes ``chunk``'s missing cells from ``results_dir`` into the archive
  ``out_dir/figure3-chunk.tar.gz`` (written also after the budget, an error or
  a signal); returns its ``run.json``; ``ValueError`` for a bad chunk, or a
  directory of another setup. ``workdir``: kept and resumed (``None``: a
  temporary one). ``compute(chunk_setup, workdir, deadline)`` returns the
  stacks the deadline skipped (default :func:`sweep.run_sweep`); ``info``:
  more ``run.json`` fields; ``deadline_s``: ``Schedule.stop_at``, from t0."""
  t0 = time.monotonic()
  deadline = None if budget_s is None else t0 + budget_s
  stop_at = None if deadline_s is None else t0 + deadline_s
  chunk_cfg = chunk_setup(setup, chunk)
  configs.check_run(setup, [backbone])
  keep = workdir is not None
  checkpoints = resolve_checkpoints(checkpoints, workdir, deadline_s)
  workdir = workdir or tempfile.mkdtemp(prefix="figure3-chunk-")
  path = os.path.join(out_dir, ARCHIVE)
  def archive(**more) -> None:  # once run_info and at_start are set
    run_info.update(more)
    run_info["cells_computed"] = len(schema.read_results(workdir)) - at_start
    run_info["wall_s"] = round(time.monotonic() - t0, 1)
    write_chunk_archive(workdir, path, run_info)
  try:
    at_start = start_workdir(results_dir, workdir, setup)
    run_info: dict = {
        "preset": preset, "chunk": chunk, "backbone": backbone,
        "budget_s": budget_s, "deadline_s": deadline_s,
        "setup": setup.fingerprint(backbone),
        "left_sizes": list(chunk_cfg.left_sizes),
        "memory_sizes": list(chunk_cfg.memory_sizes),
        "device": [str(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(info or {})}
    with signals.archive_on_signal(
        lambda name: archive(error=f"stopped by {name}"),
        workdir=None if keep else workdir,
        resume=(f"{path} holds every finished cell; rerun the same "
                f"command to resume" + (f" from {workdir}" if keep else "")
                + f" (merge the archive with --merge={path} first when "
                f"{workdir if keep else 'this machine'} is gone)")):
      try:
        if compute is None:
          compute = lambda cfg, wd, dl: sweep.run_sweep(
              cfg, wd, "both", backbone, scheduling.Schedule(
                  deadline=dl, stop_at=stop_at,
                  seconds_per_weight=seconds_per_trial(results_dir),
                  tune_seconds_per_trial=seconds_per_trial(
                      results_dir, tuning_only=True)),
              checkpoints=checkpoints)
        run_info["skipped_stacks"] = compute(chunk_cfg, workdir, deadline)
      except protocol.DeadlineReached as e:
        run_info["stopped"] = str(e)
        logging.warning("%s; the archive holds every finished cell", e)
      except Exception as e:
        run_info["error"] = f"{type(e).__name__}: {e}"
        raise
      finally:
        signals.locked(archive)
        logging.info("%d cells computed in %.0f s; archive %s",
                     run_info["cells_computed"], run_info["wall_s"], path)
  finally:
    if not keep:
      shutil.rmtree(workdir, ignore_errors=True)
  return run_info


def seconds_per_trial(results_dir: str, margin: float = 1.2,
                      tuning_only: bool = False) -> float | None:
  """Seconds per trial of ``results_dir``'s transformer stacks (or parts):
  pretraining wall time plus each tuning group's program time
  (``tuning_only``: the latter alone) times ``margin``; ``None`` if none."""
  stacks: dict[tuple, dict] = {}
  for r in schema.read_results(results_dir):
    if r.backbone != "transformer" or r.pretrain_wall_s is None:
      continue
    st = stacks.setdefault((r.hmm, r.num_states, r.memory_size, tuple(
        r.pretrain_part or ())), {"wall": 0.0, "groups": {}, "trials": set()})
    st["wall"] = max(st["wall"], r.pretrain_wall_s)
    st["groups"][(r.panel, r.method, r.features)] = r.seconds
    st["trials"].add(r.trial)
  if not (trials := sum(len(st["trials"]) for st in stacks.values())):
    return None
  return margin * sum((0.0 if tuning_only else st["wall"]) + sum(
      st["groups"].values()) for st in stacks.values()) / trials


def chunk_step_bytes(setup: configs.Setup, chunk: str) -> list[dict]:
  """Per stack of ``chunk``: its trials, :func:`hmmprompt.pretrain.step_bytes`
  and the device's memory (``device_bytes``; ``None`` if unreported)."""
  part, cfg = chunk_setup(setup, chunk), setup.pretrain
  mesh, sizes = sharding_lib.data_mesh(), configs.stack_sizes(setup)
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  hmms = lambda mid: jax.eval_shape(  # shapes only: no model is drawn
      lambda: jax.vmap(generative.as_hmm)(
          protocol.make_models(setup, mid, sizes[mid])))
  return [{"stack": mid.tag, "trials": sizes[mid],
           "trials_per_vmap": cfg.trials_per_vmap,
           **pretrain_lib.step_bytes(cfg, hmms(mid), mesh),
           "device_bytes": limit} for mid in configs.plan(part)]


def describe_step_bytes(m: dict) -> str:
  """One line of :func:`chunk_step_bytes` in GiB, and whether the step fits."""
  need, gib = m["argument_bytes"] + m["temp_bytes"], 2.0**30
  fits = ("" if m["device_bytes"] is None else
          f" of {m['device_bytes'] / gib:.1f} GiB: "
          f"{'fits' if need <= m['device_bytes'] else 'does NOT fit'}")
  return (f"{m['stack']}: {m['trials']} trials, trials_per_vmap "
          f"{m['trials_per_vmap']}: state {m['state_bytes'] / gib:.1f} GiB, "
          f"temporaries {m['temp_bytes'] / gib:.1f} GiB, step "
          f"{need / gib:.1f} GiB{fits}")


def check_chunk(setup: configs.Setup, chunk: str, backbone: str,
                results_dir: str, workdir: str | None) -> None:
  """Before any work: ``ValueError`` for a bad ``chunk``, inputs beyond the
  context, or a ``results_dir`` or ``workdir`` of another setup."""
  chunk_sizes(setup, chunk)
  configs.check_run(setup, [backbone])
  for where in (results_dir, workdir):
    if where:
      sweep.check_workdir(where, setup, write=False)


def merge_all(archives: list[str], results_dir: str,
              setup: configs.Setup | None = None, preset: str = ""
              ) -> list[str]:
  """:func:`merge` of each archive in turn, a line of counts each;
  ``ValueError`` naming a missing archive, or :func:`merge`'s."""
  if missing := [a for a in archives if not os.path.isfile(a)]:
    raise ValueError(f"--merge: no such archive {missing}")
  return [f"{a}: {c['added']} lines added, {c['kept']} already in "
          f"{results_dir} ({c['conflicts']} with other values, kept)"
          for a in archives for c in [merge(a, results_dir, setup, preset)]]


def check_archive(archive: str, unpacked: str, run: dict,
                  setup: configs.Setup, preset: str = "") -> None:
  """``ValueError`` if ``archive`` (unpacked in ``unpacked``; ``run``: its
  ``run.json``) holds another setup's, naming its preset, else what differs."""
  stamp = os.path.join(unpacked, sweep.STAMP)
  diff = [] if not os.path.exists(stamp) else identity_lib.differences(
      json.loads(pathlib.Path(stamp).read_text()), setup.identity(),
      defaults=identity_lib.added_defaults(setup))
  mine = {setup.fingerprint(b) for b in sweep.BACKBONES}
  theirs = sorted({r.setup for r in schema.read_results(unpacked)} - mine)
  if not diff and not theirs:
    return
  ran, this = run.get("preset"), f"--preset={preset}" if preset else "setup"
  if ran and preset and ran != preset:
    raise ValueError(f"{archive} holds results of --preset={ran}, not of "
                     f"this {this}: merge it with --preset={ran} (and the "
                     f"--config flags it ran with)")
  raise ValueError(
      f"{archive} holds results of another setup than this {this} and its "
      f"--config flags ({'; '.join(diff) or f'setups {theirs}'}): merge it "
      f"with the flags it ran with")


def merge(archive: str, results_dir: str,
          setup: configs.Setup | None = None, preset: str = "") -> dict:
  """Adds ``archive``'s result lines, pretraining metrics and ``run.json``
  (once, to ``runs.jsonl``) to ``results_dir``, renders the report, returns
  :func:`files.merge_lines`' counts; ``ValueError`` for unexpected members
  or another setup's results (:func:`check_archive`)."""
  with tempfile.TemporaryDirectory() as tmp:
    names = files_lib.read_archive(archive, tmp, _MEMBER)
    try:
      new = schema.read_results(tmp)
    except ValueError as e:
      raise ValueError(f"{archive}: {e}") from None
    run = (json.loads(pathlib.Path(tmp, "run.json").read_text())
           if "run.json" in names else None)
    if setup is not None:
      check_archive(archive, tmp, run or {}, setup, preset)
    if sweep.STAMP in names:
      sweep.stamp(results_dir, json.loads(
          pathlib.Path(tmp, sweep.STAMP).read_text()), defaults=(
              None if setup is None else identity_lib.added_defaults(setup)))
    schema.check_one_setup(schema.read_results(results_dir) + new,
                            f"merging {archive} into {results_dir}")
    added, kept, conflicts = files_lib.merge_lines(
        schema.results_path(results_dir), new, ignore=TIMING_FIELDS)
    if conflicts:
      logging.warning("%s: %d lines differ from the lines already in %s "
                      "under the same key (kept those), e.g. %s", archive,
                      len(conflicts), results_dir, conflicts[0])
    for name in names:
      if name.startswith("pretrain/"):
        _copy_new(os.path.join(tmp, name), os.path.join(results_dir, name))
    runs_path = os.path.join(results_dir, "runs.jsonl")
    # A run is its run.json, not the archive's name (every chunk's).
    if run is not None and not any(
        {k: v for k, v in r.items() if k != "archive"} == run
        for r in files_lib.read_jsonl(runs_path)):
      files_lib.append_jsonl(runs_path, [
          {**run, "archive": os.path.basename(archive)}])
  reporting.write_figure3_report(results_dir)
  return {"added": len(added), "kept": kept, "conflicts": len(conflicts)}


def _copy_new(src: str, dest: str) -> None:
  """Copies ``src`` to ``dest`` unless it exists (a difference is logged)
  or is a ``metrics.jsonl`` of fewer evaluations (a run a deadline cut)."""
  blob = pathlib.Path(src).read_bytes()
  if not os.path.exists(dest):
    files_lib.atomic_write_bytes(dest, blob)
    return
  had = pathlib.Path(dest).read_bytes()
  if had == blob:
    return
  n, m = len(blob.splitlines()), len(had.splitlines())
  if os.path.basename(dest) == "metrics.jsonl" and n > m:
    files_lib.atomic_write_bytes(dest, blob)
    logging.info("%s: the archive's run went further (%d evaluations, "
                 "%d here): replaced", dest, n, m)
  else:
    logging.warning("%s differs from the archive's copy; kept %s", dest, dest)
