#!/usr/bin/env bash
# Issue 31's first device minute (docs/figure3_gpu.md): the cuDNN attention
# path's tests and the stacked step's memory by the GPU's own buffer
# assignment. Writes $OUT/first_minute.log. Run on the device machine:
#   bash experiments/accelerator_first_minute.sh
set -uo pipefail
OUT=${OUT:-/tmp/first_minute}
mkdir -p "$OUT"
log="$OUT/first_minute.log"
export PYTHONPATH=. JAX_DEFAULT_MATMUL_PRECISION=highest
{
  date -u; nvidia-smi --query-gpu=name,memory.total --format=csv
  python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"
  echo "== the attention paths and the forward pass against its reference"
  timeout 240 python -m pytest -p no:cacheprovider -q -x \
    tests/test_transformer.py -k "dot_product or textbook or bfloat16 or one_position"
  for t in 1 2 4; do
    echo "== step memory, left:30, trials_per_vmap=$t"
    timeout 120 python -m experiments.in_chunks --preset=gpu --chunk=left:30 \
      --step_memory --config.pretrain.trials_per_vmap=$t
  done
  date -u
} > "$log" 2>&1
tail -c 6000 "$log"
