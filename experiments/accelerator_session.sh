#!/usr/bin/env bash
# Issue 31's device steps (docs/figure3_gpu.md), one per call, each writing
# $OUT/<step>.log. Run on the device machine:
#   bash experiments/accelerator_session.sh first_minute   # step 0
#   bash experiments/accelerator_session.sh mfu            # step 2
# first_minute: the cuDNN attention path's tests and the stacked step's
#   memory by the GPU's own buffer assignment (done 2026-11-26, H200).
# mfu: the stacked step of the gpu preset's shape (Appendix D's model,
#   batch 64 x 512, |H| = 30) at trials_per_vmap 1, 4 and 8 beside one
#   model measured in the same run, then a profile of the last's top ops.
# chunk CHUNK SECONDS: the gpu preset's chunk (in_chunks --chunk=CHUNK)
#   from the committed results, SIGTERM after SECONDS (the runner then
#   writes its archive at once), $OUT/figure3-chunk.tar.gz and the log
#   back; merge it here with in_chunks --merge.
set -uo pipefail
step=${1:?usage: accelerator_session.sh first_minute|mfu|chunk CHUNK SECONDS}
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
log="$OUT/$step.log"
export PYTHONPATH=. PYTHONUNBUFFERED=1
# The tests' precision, never the runs' (the chunk step).
[ "$step" = chunk ] || export JAX_DEFAULT_MATMUL_PRECISION=highest
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
{
  date -u; nvidia-smi --query-gpu=name,memory.total --format=csv
  python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
  case "$step" in
    first_minute)
      echo "== the attention paths and the forward pass against its reference"
      timeout 240 python -m pytest -p no:cacheprovider -q -x \
        tests/test_transformer.py -k "dot_product or textbook or bfloat16 or one_position"
      for t in 1 2 4; do
        echo "== step memory, left:30, trials_per_vmap=$t"
        timeout 120 python -m experiments.in_chunks --preset=gpu \
          --chunk=left:30 --step_memory --config.pretrain.trials_per_vmap=$t
      done ;;
    mfu)
      echo "== step memory, left:30, trials_per_vmap=8"
      timeout 120 python -m experiments.in_chunks --preset=gpu \
        --chunk=left:30 --step_memory --config.pretrain.trials_per_vmap=8
      echo "== stacked step, paper model, batch 64, 8 trials"
      timeout 400 python -m experiments.bench_trials --preset=paper \
        --batch_size=64 --num_states=30 --trials=8 --steps=20 \
        --trials_per_vmap=1,4,8 --profile_dir="$OUT/profile" ;;
    chunk)
      chunk=${2:?chunk CHUNK SECONDS}; seconds=${3:?chunk CHUNK SECONDS}
      echo "== in_chunks --preset=gpu --chunk=$chunk, SIGTERM after ${seconds} s"
      timeout -s TERM "$seconds" python -m experiments.in_chunks \
        --preset=gpu --chunk="$chunk" --out="$OUT" \
        --workdir="${WORKDIR:-/tmp/figure3-gpu}"
      echo "rc=$?"; ls -la "$OUT" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  date -u
} > "$log" 2>&1
rm -rf "$OUT/profile"  # the top ops are in the log; the trace is large
tail -c 6000 "$log"
