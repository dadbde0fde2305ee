#!/usr/bin/env bash
# Sampled vs exact-conditional pretraining targets on all 13 Figure 3 draws
# (the cpu preset's task, the full cpu pretraining recipe: batch 64, lr
# 3e-3, cycles up to 31 000 steps, stop within 0.04 nats), one process per
# HMM, all in parallel; then head / prompt tuning on each pretrained model.
#
#   experiments/scripts/compare_targets.sh OUT "VARIANT ..." [SECONDS]
#
# VARIANT is TARGETS-CORRUPTION[-pretrain] (e.g. exact-bert, sampled-bert,
# exact-mask-pretrain); everything but checkpoints (results, metrics,
# configs, logs) ends up in OUT/compare_targets.tgz, one file. On a GPU this computes
# in fp32 with full-precision matmuls, which reproduces the CPU's numbers.
set -uo pipefail
out="$1"; variants="$2"; limit="${3:-540}"
scratch="${SCRATCH:-/tmp/compare_targets}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
for v in $variants; do
  IFS=- read -r targets corruption only <<< "$v"
  extra=(); [ "${only:-}" = pretrain ] && extra=(--pretrain_only)
  mkdir -p "$scratch/$v"
  for i in $(seq 0 12); do
    timeout "$limit" python -m experiments.figure3 --backbone=transformer \
      --preset=cpu --workdir="$scratch/$v" --num_tasks=13 --task_index="$i" \
      --config.left_sizes=4,8,10,12,15,20,25,28,30 \
      --config.memory_sizes=2,3,5,7 --config.pretrain.batch_size=64 \
      --config.pretrain.lr=3e-3 \
      --config.pretrain.cycles=1000:2000:4000:8000:16000 \
      --config.pretrain.model.dtype=float32 \
      --config.pretrain.targets="$targets" \
      --config.pretrain.corpus.corruption="$corruption" "${extra[@]}" \
      > "$scratch/$v/log-$i.txt" 2>&1 &
  done
done
wait
mkdir -p "$out"
(cd "$scratch" && find . -path '*/checkpoints' -prune -o -type f -print \
   | tar -czf "$out/compare_targets.tgz" -T -)
