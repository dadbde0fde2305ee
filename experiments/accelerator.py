r"""Figure 3 on a lent accelerator, in chunks of whole size stacks.

  python -m experiments.accelerator --preset=gpu --chunk=left:4,8 \
      --budget_s=540 --out=$OUT [--results=docs/results/figure3-gpu] \
      [--backbone=transformer] [--config.<path>=...]
  python -m experiments.accelerator --merge=A.tar.gz[,B.tar.gz] \
      [--results=docs/results/figure3-gpu]
  python -m experiments.accelerator --preset=gpu --chunk=left:30 \
      --step_memory [--config.pretrain.trials_per_vmap=4]

A lent machine runs a command for minutes and keeps nothing, so the sweep
goes in chunks, each ending in one archive that is merged into the
committed results directory here:

* ``--chunk`` picks whole size stacks: ``left:4,8`` (|H| of the left
  panel), ``right:2,3`` (|M| of the right panel), ``left`` / ``right`` (a
  whole panel) or ``all``. A vanilla HMM both panels read (|H| = 8 is a
  left size and the twin of |M| = 2) is one stack of the most trials any
  panel reads; a chunk naming either panel's size runs both, so that no
  stack is drawn at another size or pretrained twice (logged).
* The work directory starts from ``--results``' ``results.jsonl`` and
  ``sweep.json``, so only missing cells are computed; other trial counts,
  or result lines of another setup fingerprint (changed task, tuning or
  pretraining numbers, or float32 vs bf16), are refused: they would mix
  two setups in one report.
* ``--budget_s`` starts no stack after that many seconds (a stack started
  is finished), leaving time to write the archive. The work directory and
  its checkpoints are deleted at the end unless ``--workdir`` names one: a
  rerun with the same ``--workdir`` (on a machine kept warm) resumes a
  stack that a command's time limit cut short.
* ``OUT/figure3-gpu.tar.gz`` (written atomically, also after the budget or
  an error): ``results.jsonl``, ``sweep.json``, each pretraining run's
  ``pretrain/<run>/{metrics.jsonl,config.json}`` (no checkpoints), the
  report (``figure3.md``, ``figure3.png``, ``pretraining.png``) and
  ``run.json`` (preset, chunk, budget, device, wall time, cells computed).

``--step_memory`` computes nothing either: for each of the chunk's stacks
it compiles the pretraining step on shapes only and prints its state and
temporaries (:func:`hmmprompt.pretrain.step_memory`) against the device's
memory, to pick ``--config.pretrain.trials_per_vmap`` before a run rather
than from an out-of-memory error (seconds per stack; on the CPU an upper
bound).

``--merge`` computes nothing: it adds each archive's result lines to
``--results`` by key (a key already there keeps its line; different values
under one key are counted and logged), checks ``sweep.json`` and the
setup fingerprints agree, copies the pretraining metrics, appends
``run.json`` to ``runs.jsonl`` and renders the report again.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import jax

from experiments.figure3 import configs
from experiments.figure3 import records
from experiments.figure3 import reporting
from experiments.figure3 import sweep
from hmmprompt import config_flags
from hmmprompt import host_memory
from hmmprompt import models
from hmmprompt import pretrain as pretrain_lib
from hmmprompt import results as results_lib
from hmmprompt import sharding as sharding_lib

ARCHIVE = "figure3-gpu.tar.gz"
RESULTS_DIR = os.path.join("docs", "results", "figure3-gpu")
# Result-line fields that time the run and may differ between two runs of
# one cell.
TIMING_FIELDS = ("seconds", "pretrain_wall_s")
_REPORT_FILES = ("figure3.md", "figure3.png", reporting.PRETRAINING_PLOT)
_PRETRAIN_FILES = ("metrics.jsonl", "config.json")
# What an archive may hold; anything else is refused (no path escapes).
_MEMBER = re.compile(r"(results\.jsonl|sweep\.json|run\.json|"
                     + "|".join(re.escape(f) for f in _REPORT_FILES)
                     + r"|pretrain/\w[\w.-]*/(metrics\.jsonl|config\.json))")

_PRESET = flags.DEFINE_enum("preset", "gpu", list(configs.PRESETS),
                            "config preset; --config.<path> overrides it")
_CONFIG = config_flags.define(configs.PRESETS["gpu"]())
_BACKBONE = flags.DEFINE_enum("backbone", "transformer", sweep.BACKBONES,
                              "the pretrained transformer, or exact "
                              "(perfect pretraining; tests)")
_CHUNK = flags.DEFINE_string(
    "chunk", "all", "which size stacks: left:SIZES (|H|), right:SIZES "
    "(|M|), left, right or all; SIZES comma-separated")
_BUDGET = flags.DEFINE_float(
    "budget_s", None, "start no stack after this many seconds (a stack "
    "started is finished); default: no limit")
_OUT = flags.DEFINE_string("out", None, f"where {ARCHIVE} is written")
_RESULTS = flags.DEFINE_string(
    "results", RESULTS_DIR, "the committed results directory: a run starts "
    "from its lines, --merge adds to them")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "a directory to compute in, kept (its checkpoints "
    "too: delete it when done); a rerun with it resumes a stack cut short "
    "by a time limit; default: a temporary one, deleted after the archive "
    "is written")
_STEP_MEMORY = flags.DEFINE_bool(
    "step_memory", False, "print each stack's pretraining-step memory (XLA's "
    "buffer assignment, compiled on shapes only) and stop")
_MERGE = flags.DEFINE_list(
    "merge", None, "archives to merge into --results (computes nothing)")


def chunk_sizes(setup: configs.Setup,
                chunk: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(left_sizes, memory_sizes)`` of ``setup`` that ``chunk`` selects,
  closed over the vanilla stacks both panels share.

  Raises:
    ValueError: ``chunk`` is not ``all``, ``left[:SIZES]`` or
      ``right[:SIZES]``, or names a size ``setup`` lacks (all named).
  """
  if chunk == "all":
    return setup.left_sizes, setup.memory_sizes
  panel, sep, text = chunk.partition(":")
  if panel not in ("left", "right"):
    raise ValueError(f"--chunk={chunk!r}: expected left:SIZES, right:SIZES, "
                     f"left, right or all (e.g. left:4,8)")
  known = setup.left_sizes if panel == "left" else setup.memory_sizes
  chosen = known
  if sep:
    try:
      chosen = tuple(int(s) for s in text.split(","))
    except ValueError:
      raise ValueError(f"--chunk={chunk!r}: sizes must be comma-separated "
                       f"integers, e.g. {panel}:{known[0] if known else 4}"
                       ) from None
    bad = [s for s in chosen if s not in known]
    if bad:
      raise ValueError(
          f"--chunk={chunk!r}: {bad} not among the {panel} panel's sizes "
          f"{known} ({'|H|' if panel == 'left' else '|M|'}) of this preset")
  left = set(chosen) if panel == "left" else set()
  memory = set(chosen) if panel == "right" else set()
  # A vanilla stack of syntax * |M| states is the right panel's twin of
  # |M| and, if a left size too, the left panel's: both or neither.
  syntax = configs.MEMORY_SYNTAX_STATES
  memory |= {m for m in setup.memory_sizes if syntax * m in left}
  left |= {h for h in setup.left_sizes if h in {syntax * m for m in memory}}
  return (tuple(h for h in setup.left_sizes if h in left),
          tuple(m for m in setup.memory_sizes if m in memory))


def chunk_setup(setup: configs.Setup, chunk: str) -> configs.Setup:
  """``setup`` restricted to ``chunk``'s stacks (the sizes are no part of
  :meth:`configs.Setup.fingerprint`, so its lines key as the whole
  sweep's); ``ValueError`` as :func:`chunk_sizes`."""
  left, memory = chunk_sizes(setup, chunk)
  if chunk != "all":
    logging.info("chunk %s: left sizes %s, memory sizes %s", chunk, left,
                 memory)
  return dataclasses.replace(setup, left_sizes=left, memory_sizes=memory)


def check_one_setup(lines, where: str) -> None:
  """``ValueError`` if ``lines`` of one backbone carry several setup
  fingerprints (their report would mix two setups), named with
  ``where``."""
  by_backbone = {}
  for r in lines:
    by_backbone.setdefault(r.backbone, set()).add(r.setup)
  for backbone, fps in sorted(by_backbone.items()):
    if len(fps) > 1:
      raise ValueError(
          f"{where}: {backbone} lines of setups {sorted(fps)}; one results "
          f"directory holds one setup per backbone (a changed config moves "
          f"the fingerprint): use another --results for the new setup")


def check_results(results_dir: str, setup: configs.Setup,
                  backbone: str) -> None:
  """``ValueError`` if ``results_dir`` was made with other trial counts
  (``sweep.json``) or holds ``backbone`` lines of another setup
  fingerprint: a run there would recompute every cell beside them."""
  path = os.path.join(results_dir, "sweep.json")
  if os.path.exists(path):
    with open(path) as f:
      had = json.load(f)
    if had != setup.trial_counts():
      raise ValueError(f"{results_dir} was made with trial counts {had}, "
                       f"this run asks for {setup.trial_counts()}")
  fp = setup.fingerprint(backbone)
  others = sorted({r.setup for r in records.read_results(results_dir)
                   if r.backbone == backbone} - {fp})
  if others:
    raise ValueError(
        f"{results_dir} holds {backbone} lines of setup {others}, this run's "
        f"is {fp} (a changed task, tuning or pretraining number, or float32 "
        f"vs bfloat16): use another --results for the new setup")


def start_workdir(results_dir: str, workdir: str) -> int:
  """Adds ``results_dir``'s ``sweep.json`` and the result lines ``workdir``
  lacks (by key) to ``workdir``; returns the lines it then holds.

  ``workdir`` is new, or a kept one of an earlier run of this setup (one
  stopped by a machine's time limit mid-stack): its lines and pretraining
  checkpoints are reused, so that stack resumes.

  Raises:
    ValueError: ``workdir``'s trial counts differ from ``results_dir``'s.
  """
  os.makedirs(workdir, exist_ok=True)
  src, dst = (os.path.join(d, "sweep.json") for d in (results_dir, workdir))
  if os.path.exists(src):
    with open(src) as f:
      theirs = json.load(f)
    if not os.path.exists(dst):
      results_lib.atomic_write_text(dst, json.dumps(theirs))
    else:
      with open(dst) as f:
        mine = json.load(f)
      if mine != theirs:
        raise ValueError(f"--workdir={workdir} was made with trial counts "
                         f"{mine}, {results_dir} with {theirs}")
  have = {r.key() for r in records.read_results(workdir)}
  add = [r for r in records.read_results(results_dir) if r.key() not in have]
  if add:
    records.append(records.results_path(workdir), add)
  return len(have) + len(add)


def write_archive(workdir: str, path: str, run_info: dict) -> list[str]:
  """Renders the report in ``workdir`` and writes ``path`` (atomically):
  the results, ``sweep.json``, the pretraining metrics and configs, the
  report and ``run_info`` as ``run.json``. Returns the member names."""
  reporting.report(workdir)
  members = [n for n in ("results.jsonl", "sweep.json", *_REPORT_FILES)
             if os.path.exists(os.path.join(workdir, n))]
  for run_dir in sorted(glob.glob(os.path.join(workdir, "pretrain", "*"))):
    members += [os.path.relpath(os.path.join(run_dir, n), workdir)
                for n in _PRETRAIN_FILES
                if os.path.exists(os.path.join(run_dir, n))]
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    for name in members:
      tar.add(os.path.join(workdir, name), arcname=name, recursive=False)
    blob = json.dumps(run_info, indent=1, sort_keys=True).encode()
    info = tarfile.TarInfo("run.json")
    info.size, info.mtime = len(blob), int(time.time())
    tar.addfile(info, io.BytesIO(blob))
  results_lib.atomic_write_bytes(path, buf.getvalue())
  return members + ["run.json"]


def run_chunk(setup: configs.Setup, chunk: str, backbone: str,
              results_dir: str, out_dir: str, budget_s: float | None = None,
              workdir: str | None = None, preset: str = "") -> dict:
  """Computes ``chunk``'s missing cells from ``results_dir`` and writes
  ``out_dir/figure3-gpu.tar.gz`` (also after the budget or an error);
  returns the archive's ``run.json``.

  ``workdir`` (kept): compute there, resuming what an earlier run there
  left (:func:`start_workdir`); ``None``: a temporary directory, deleted.

  Raises:
    ValueError: a bad chunk, or ``results_dir`` or ``workdir`` holding
      other trial counts or another setup (named).
  """
  t0 = time.monotonic()
  deadline = None if budget_s is None else t0 + budget_s
  chunk_cfg = chunk_setup(setup, chunk)
  if backbone == "transformer":
    setup.check_context()
  check_results(results_dir, setup, backbone)
  keep = workdir is not None
  if keep:
    check_results(workdir, setup, backbone)
  workdir = workdir or tempfile.mkdtemp(prefix="figure3-gpu-")
  try:
    at_start = start_workdir(results_dir, workdir)
    run_info = {"preset": preset, "chunk": chunk, "backbone": backbone,
                "budget_s": budget_s, "setup": setup.fingerprint(backbone),
                "left_sizes": list(chunk_cfg.left_sizes),
                "memory_sizes": list(chunk_cfg.memory_sizes),
                "device": [str(d) for d in jax.devices()],
                "device_kind": jax.devices()[0].device_kind,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
      run_info["skipped_stacks"] = sweep.run(chunk_cfg, workdir, "both",
                                             backbone, deadline=deadline)
    except Exception as e:
      run_info["error"] = f"{type(e).__name__}: {e}"
      raise
    finally:
      run_info["cells_computed"] = (len(records.read_results(workdir))
                                    - at_start)
      run_info["wall_s"] = round(time.monotonic() - t0, 1)
      path = os.path.join(out_dir, ARCHIVE)
      write_archive(workdir, path, run_info)
      logging.info("%d cells computed in %.0f s; archive %s",
                   run_info["cells_computed"], run_info["wall_s"], path)
  finally:
    if not keep:
      shutil.rmtree(workdir, ignore_errors=True)
  return run_info


def step_memory(setup: configs.Setup, chunk: str) -> list[dict]:
  """Per stack of ``chunk``: its trial count and pretraining-step memory
  (:func:`hmmprompt.pretrain.step_memory`, in bytes), and the device's
  memory where it reports one (``device_bytes``, else ``None``)."""
  part = chunk_setup(setup, chunk)
  cfg = setup.pretrain
  mesh = sharding_lib.data_mesh()
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  out = []
  for mid in sweep.plan(part):
    hmms = jax.eval_shape(  # shapes only: no model is drawn
        lambda mid=mid: jax.vmap(models.as_hmm)(sweep.make_models(setup,
                                                                  mid)))
    out.append({"stack": mid.tag, "trials": sweep.stack_size(setup, mid),
                "trials_per_vmap": cfg.trials_per_vmap,
                **pretrain_lib.step_memory(cfg, hmms, mesh),
                "device_bytes": limit})
  return out


def _read_archive(archive: str, into: str) -> list[str]:
  """Unpacks ``archive``'s regular files into ``into``; ``ValueError``
  naming a member that is no part of an archive (so no path escapes)."""
  names = []
  with tarfile.open(archive, "r:gz") as tar:
    for member in tar.getmembers():
      if not (member.isfile() and _MEMBER.fullmatch(member.name)):
        raise ValueError(f"{archive}: unexpected member {member.name!r}")
      dest = os.path.join(into, member.name)
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      with tar.extractfile(member) as src, open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
      names.append(member.name)
  return names


def _values(line: records.ResultLine) -> dict:
  d = line.to_json()
  for name in TIMING_FIELDS:
    d.pop(name)
  return d


def merge(archive: str, results_dir: str) -> dict:
  """Adds ``archive``'s result lines and pretraining metrics to
  ``results_dir`` and renders its report again; returns counts (``added``,
  ``kept``: keys already there, ``conflicts``: of those, the ones whose
  values differ).

  Raises:
    ValueError: ``archive`` holds unexpected members, other trial counts
      than ``results_dir``, or lines of another setup (named).
  """
  with tempfile.TemporaryDirectory() as tmp:
    names = _read_archive(archive, tmp)
    os.makedirs(results_dir, exist_ok=True)
    theirs_path = os.path.join(tmp, "sweep.json")
    mine_path = os.path.join(results_dir, "sweep.json")
    if os.path.exists(theirs_path):
      with open(theirs_path) as f:
        theirs = json.load(f)
      if os.path.exists(mine_path):
        with open(mine_path) as f:
          mine = json.load(f)
        if mine != theirs:
          raise ValueError(f"{archive} was made with trial counts {theirs}, "
                           f"{results_dir} with {mine}")
      else:
        results_lib.atomic_write_text(mine_path, json.dumps(theirs))
    try:
      new = records.read_results(tmp)
    except ValueError as e:
      raise ValueError(f"{archive}: {e}") from None
    had = records.read_results(results_dir)
    by_key = {r.key(): r for r in had}
    added, kept, conflicts = [], 0, []
    for r in new:
      if r.key() in by_key:
        kept += 1
        if _values(by_key[r.key()]) != _values(r):
          conflicts.append(r.key())
        continue
      by_key[r.key()] = r
      added.append(r)
    check_one_setup(by_key.values(), f"merging {archive} into {results_dir}")
    if conflicts:
      logging.warning("%s: %d lines differ from the lines already in %s "
                      "under the same key (kept those), e.g. %s", archive,
                      len(conflicts), results_dir, conflicts[0])
    records.append(records.results_path(results_dir), added)
    for name in names:
      if not name.startswith("pretrain/"):
        continue
      dest = os.path.join(results_dir, name)
      with open(os.path.join(tmp, name), "rb") as f:
        blob = f.read()
      if not os.path.exists(dest):
        results_lib.atomic_write_bytes(dest, blob)
        continue
      with open(dest, "rb") as f:
        same = f.read() == blob
      if not same:
        logging.warning("%s differs from %s's copy; kept %s", dest, archive,
                        dest)
    if "run.json" in names:
      with open(os.path.join(tmp, "run.json")) as f:
        results_lib.append_jsonl(os.path.join(results_dir, "runs.jsonl"),
                                 [{**json.load(f), "archive":
                                   os.path.basename(archive)}])
  reporting.report(results_dir)
  return {"added": len(added), "kept": kept, "conflicts": len(conflicts)}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  host_memory.retain_freed_memory()  # XLA:CPU step temporaries
  try:
    if _MERGE.value:
      if _OUT.value:
        raise ValueError("--merge computes nothing: drop --out")
      missing = [a for a in _MERGE.value if not os.path.isfile(a)]
      if missing:
        raise ValueError(f"--merge: no such archive {missing}")
      for archive in _MERGE.value:
        counts = merge(archive, _RESULTS.value)
        print(f"{archive}: {counts['added']} lines added, {counts['kept']} "
              f"already in {_RESULTS.value} ({counts['conflicts']} with "
              f"other values, kept)")
      return
    if not _OUT.value and not _STEP_MEMORY.value:
      raise ValueError("--out is required (or --merge, --step_memory)")
    if _BUDGET.value is not None and _BUDGET.value < 0:
      raise ValueError(f"--budget_s must be >= 0, got {_BUDGET.value}")
    setup = configs.get_setup(_PRESET.value, _CONFIG.value())
    # Before any work: a bad chunk, inputs beyond the context, results of
    # another setup.
    chunk_sizes(setup, _CHUNK.value)
    if _BACKBONE.value == "transformer":
      setup.check_context()
    for where in (_RESULTS.value, _WORKDIR.value):
      if where:
        check_results(where, setup, _BACKBONE.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  # Usage errors end above (run_chunk's own checks raise ValueError with
  # the same messages); whatever fails below keeps its traceback.
  if _STEP_MEMORY.value:
    for m in step_memory(setup, _CHUNK.value):
      need = m["argument_bytes"] + m["temp_bytes"]
      fits = ("" if m["device_bytes"] is None else
              f" of {m['device_bytes'] / 2**30:.1f} GiB: "
              f"{'fits' if need <= m['device_bytes'] else 'does NOT fit'}")
      print(f"{m['stack']}: {m['trials']} trials, trials_per_vmap "
            f"{m['trials_per_vmap']}: state {m['state_bytes'] / 2**30:.1f} "
            f"GiB, temporaries {m['temp_bytes'] / 2**30:.1f} GiB, step "
            f"{need / 2**30:.1f} GiB{fits}")
    return
  info = run_chunk(setup, _CHUNK.value, _BACKBONE.value, _RESULTS.value,
                   _OUT.value, _BUDGET.value, _WORKDIR.value, _PRESET.value)
  print(f"{info['cells_computed']} cells in {info['wall_s']:.0f}s; skipped "
        f"stacks {info['skipped_stacks']}\narchive: "
        f"{os.path.join(_OUT.value, ARCHIVE)}")


if __name__ == "__main__":
  app.run(main)
