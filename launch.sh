#!/usr/bin/env bash
# One entry point on a fresh machine with Python 3.11:
#   ./launch.sh           set up .venv if needed, run the main job: Figure 3
#                         (both panels, 3 HMM draws per size) with the exact
#                         backbone and pretrained transformers, cpu preset
#                         (~12 min on 2 cores, a process per core), into
#                         runs/figure3 (resumes if rerun)
#   ./launch.sh test      set up .venv if needed, run the whole test suite
#                         (./launch.sh test -m "not slow": the fast tier)
#   ./launch.sh isa [ISA ...] [-- PYTEST_ARGS]   the fast tier once per CPU
#                         instruction set (XLA's --xla_cpu_max_isa; default
#                         SSE4_2 AVX2 and this CPU's own): a numerical test
#                         must pass on every CPU CI may run on
#                         (docs/performance.md)
#   ./launch.sh demo      a one-minute tour of the HMM core (installs the
#                         library alone)
#   ./launch.sh mutants [module ...]   mutation testing (mutmut; installs
#                         the `mutants` extra): e.g. `mutants tuning heads`,
#                         then a score table per module (docs/mutation.md)
#   ./launch.sh docs      build the documentation strictly into site/
#                         (mkdocs.yml; the `docs` extra, pulled in by `test`)
#   ./launch.sh bench     the HMM and MLM benchmarks (installs the `bench`
#                         extra: hmmlearn, dynamax, torch, transformers); for
#                         their flags, and the others under experiments/bench/:
#                         python -m experiments.bench.<name> --help
# Extra arguments pass through to the job (e.g. ./launch.sh --config.trials=5,
# ./launch.sh --preset=paper, or on many hosts
# ./launch.sh --num_tasks=$SLURM_ARRAY_TASK_COUNT \
#             --task_index=$SLURM_ARRAY_TASK_ID --workdir=/shared/figure3).
# HMMPROMPT_EXTRAS=cuda (or tpu) installs jax's accelerator build too;
# HMMPROMPT_LOCK=1 installs the runtime dependencies at requirements.lock's
# versions.
set -euo pipefail
cd "$(dirname "$0")"

VENV="${HMMPROMPT_VENV:-.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

mode="main"
case "${1:-}" in
  test|isa|bench|demo|mutants|docs) mode="$1"; shift ;;
esac

extras="test"
[ "$mode" = demo ] && extras=""  # the library alone: a first run in seconds
[ "$mode" = bench ] && extras="test,bench"
[ "$mode" = mutants ] && extras="test,mutants"
[ -n "${HMMPROMPT_EXTRAS:-}" ] && extras="${extras:+$extras,}$HMMPROMPT_EXTRAS"
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# HMMPROMPT_LOCK=1: the runtime dependencies at requirements.lock's
# versions (those the committed results were produced with), as
# constraints: the extras' tools stay unpinned.
lock=()
[ "${HMMPROMPT_LOCK:-0}" = 1 ] && lock=(-c requirements.lock)

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $($PY --version)" >&2
  # Without pip: ensurepip's 5 s buy nothing when uv installs (below).
  "$PY" -m venv --without-pip "$VENV"
fi
stamp="$VENV/.hmmprompt-installed-${extras:-library}${lock[0]:+-locked}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # Byte-compiled at install: with PYTHONDONTWRITEBYTECODE set, as on CI,
  # Python would recompile every module on every import (importing jax,
  # flax, orbax and the library: 2.9 s -> 6.9 s in every process, measured
  # 2026-11-24). uv installs the same versions, byte-compiled, in 11 s
  # (16 s with an empty uv cache) where pip takes 33 s on 2 cores
  # (2026-11-24). The host's pip puts uv into the venv (pip >= 22.3
  # --python), else the venv's own. pip stays the fallback, and installs the
  # bench extra: the CPU build of torch comes from pip's configured wheel
  # folder, which uv does not read.
  if [ "$mode" = bench ] || ! { { "$PY" -m pip --python "$VENV/bin/python" \
          install -q "uv>=0.9" 2>/dev/null ||
        { "$VENV/bin/python" -m ensurepip >/dev/null &&
          "$VENV/bin/python" -m pip install -q "uv>=0.9"; }; } &&
      "$VENV/bin/uv" pip install -q --compile-bytecode \
        --python "$VENV/bin/python" ${lock[@]+"${lock[@]}"} -e "$spec"; }; then
    "$VENV/bin/python" -m ensurepip >/dev/null
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q ${lock[@]+"${lock[@]}"} -e "$spec"
  fi
  touch "$stamp"
fi

case "$mode" in
  # One xdist worker per core (pass -n 0 to run in one process). worksteal
  # hands each worker a contiguous half of the tests, so a file's tests
  # mostly share one process and its compiled programs, and rebalances the
  # tail (docs/performance.md: cold, 355 -> 316 s of pytest, CPU -11%).
  test)  exec "$VENV/bin/python" -m pytest tests -n auto --dist worksteal \
           "$@" ;;
  # Each ISA compiles its own programs (XLA_FLAGS is in jax's cache key).
  # XLA only logs an unknown ISA (below jax's default log level) and then
  # runs natively, so a misspelt name would pass as a check: refuse it.
  # pytest's own arguments follow a `--`: ./launch.sh isa AVX2 -- -k head.
  isa)   isas=()
         while [ $# -gt 0 ] && [ "$1" != -- ]; do isas+=("$1"); shift; done
         [ $# -gt 0 ] && shift
         [ ${#isas[@]} -gt 0 ] || isas=(SSE4_2 AVX2 native)
         for isa in "${isas[@]}"; do
           case "$isa" in
             SSE4_2|AVX|AVX2|AVX512|AVX512_VNNI|AVX512_BF16|AMX|AMX_FP16|native) ;;
             *) echo "launch.sh isa: unknown ISA '$isa' (XLA's names: SSE4_2" \
                  "AVX AVX2 AVX512 AVX512_VNNI AVX512_BF16 AMX AMX_FP16, or" \
                  "native; pytest's arguments go after --)" >&2; exit 2 ;;
           esac
         done
         status=0
         for isa in "${isas[@]}"; do
           flags="${XLA_FLAGS:-}"
           [ "$isa" = native ] || flags="$flags --xla_cpu_max_isa=$isa"
           echo "== the fast tier, ISA $isa" >&2
           XLA_FLAGS="$flags" "$VENV/bin/python" -m pytest tests -n auto \
             --dist worksteal -m "not slow" "$@" ||
             { status=1; echo "== FAILED under $isa" >&2; }
         done
         exit $status ;;
  bench) "$VENV/bin/python" -m experiments.bench.hmm
         exec "$VENV/bin/python" -m experiments.bench.mlm ;;
  demo)  exec "$VENV/bin/python" -m experiments.demo "$@" ;;
  docs)  exec "$VENV/bin/python" -m mkdocs build --strict "$@" ;;
  # Mutation testing, the in-process tests as the oracle (docs/mutation.md):
  # ./launch.sh mutants tuning heads tasks (default: all of hmmprompt/).
  mutants)
    globs=(); mods=""
    for m in "$@"; do globs+=("hmmprompt.$m.*"); mods="$mods${mods:+,}$m"; done
    "$VENV/bin/mutmut" run "${globs[@]}" || true
    exec "$VENV/bin/python" tests/tools/mutation_scores.py \
      ${mods:+--modules=$mods} ;;
  main)  exec "$VENV/bin/python" -m experiments.figure3 \
           --backbone=exact,transformer --preset=cpu --workdir=runs/figure3 \
           --workers=0 "$@" ;;
esac
