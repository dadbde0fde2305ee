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
# hmm [SECTIONS]: issue 51's numbers: bench.hmm's posterior, long-sequence and
#   exact-targets sections (the kernels, and 16 or 64 steps' targets in one
#   call as PretrainConfig.exact_window draws them; dynamax's smoothers beside them
#   when DYNAMAX=DIR holds dynamax 1.0.3 and its pure-Python dependencies
#   unpacked, carried from here: the device has no package index; a
#   fastcore stand-in with progress_bar = identity is enough for its import).
# protocol SECONDS [CHUNK ...]: issue 49's protocol command, at most
#   SECONDS long: the cuDNN bias check (experiments/check_cudnn_bias.py;
#   on failure the chunks run the manual attention, a runtime field), then
#   each CHUNK (default: all, the cheapest stacks first) through
#   in_chunks with its own --deadline_s and a SIGTERM backstop, each
#   starting from the committed results plus the chunks before it, each
#   writing $OUT/<i>/figure3-chunk.tar.gz. A chunk that fails (rc 1)
#   runs once more with the exact targets inside each step
#   (exact_window=1). Merge here: in_chunks --preset=gpu --merge=A,B.
#   A later protocol command on the same machine (kept warm: call it at
#   once, merge afterwards) goes on from STATE (default
#   /tmp/accelerator-state): the last chunk's results (unless RESULTS is
#   set), the bias check's verdict (not run again), the exact_window=1
#   fallback if it was taken, and the workdir every chunk computes in
#   (WORKDIR, default $STATE/workdir), which checkpoints a stack only
#   where the deadline stops it (CHECKPOINTS, default deadline; in_chunks
#   --checkpoints): the later command resumes it there. The bias check
#   is skipped on a jax, cuDNN and GPU that passed it before (a line of
#   experiments/cudnn_bias_verified); one that passes now writes its line
#   to $OUT/cudnn_bias_verified, to be committed there.
set -uo pipefail
step=${1:?usage: accelerator_session.sh first_minute|mfu|hmm [SECTIONS]|protocol SECONDS [CHUNK ...]}
OUT=${OUT:-/tmp/accelerator}
mkdir -p "$OUT"
log="$OUT/$step.log"
export PYTHONPATH=.${DYNAMAX:+:$DYNAMAX} PYTHONUNBUFFERED=1
# The tests' precision (first_minute), never a run's or a timing's.
[ "$step" = first_minute ] && export JAX_DEFAULT_MATMUL_PRECISION=highest
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
{
  date -u; nvidia-smi --query-gpu=name,memory.total --format=csv
  # One jax start gives the versions and the bias check's key (below).
  header=$(python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())
try:
  from jax._src.lib import cuda_versions as c
  print('key: jax', jax.__version__, 'cudnn', c.cudnn_get_version(), jax.devices()[0].device_kind)
except Exception:
  pass" 2>&1)
  echo "$header"; key=$(sed -n 's/^key: //p' <<< "$header" | tail -1)
  case "$step" in
    first_minute)
      echo "== the attention paths and the forward pass against its reference"
      timeout 240 python -m pytest -p no:cacheprovider -q -x \
        tests/test_transformer.py -k "dot_product or textbook or bfloat16 or one_position"
      for t in 1 2 4; do
        echo "== step memory, left:30, trials_per_vmap=$t"
        timeout 120 python -m experiments.in_chunks --preset=gpu \
          --chunk=left:30 --step_bytes --config.pretrain.trials_per_vmap=$t
      done ;;
    mfu)
      echo "== step memory, left:30, trials_per_vmap=8"
      timeout 120 python -m experiments.in_chunks --preset=gpu \
        --chunk=left:30 --step_bytes --config.pretrain.trials_per_vmap=8
      echo "== stacked step, paper model, batch 64, 8 trials"
      timeout 400 python -m experiments.bench.trials --preset=paper \
        --batch_size=64 --num_states=30 --trials=8 --steps=20 \
        --trials_per_vmap=1,4,8 --profile_dir="$OUT/profile" ;;
    hmm)
      # hmm targets: the exact targets alone (a minute or two), for the
      # minutes a protocol command leaves.
      echo "== posteriors, long sequences and exact targets, the kernels"
      timeout 500 python -m experiments.bench.hmm \
        --sections="${2:-posterior,long,targets}" --long_repeats=5 \
        --targets_windows=16,64 ;;
    protocol)
      seconds=${2:?protocol SECONDS [CHUNK ...]}; shift 2
      end=$(( $(date +%s) + seconds )); chunks=("${@:-all}"); attn=""
      # What an earlier protocol command on this machine left.
      state=${STATE:-/tmp/accelerator-state}; mkdir -p "$state"
      # PRESET=tiny CHECK=0 (the flags of a tiny preset in EXTRA) try the
      # loop on a CPU.
      preset=${PRESET:-gpu}
      if [ -f "$state/attention" ]; then
        attn=$(cat "$state/attention")
        echo "== the bias check ran on this machine before: ${attn:-cuDNN}"
      elif [ "${CHECK:-1}" != 0 ]; then
        # Its verdict is a property of jax, cuDNN and the GPU: a key that
        # passed before (a line of $VERIFIED, committed from a log's
        # "verified:" line) is not checked again. No key: it runs.
        verified=${VERIFIED:-experiments/cudnn_bias_verified}
        if [ -n "$key" ] && grep -qxF -- "$key" "$verified" 2>/dev/null; then
          echo "== the relative bias through cuDNN passed before on $key: not run"
        else
          echo "== the relative bias through cuDNN (check_cudnn_bias) on ${key:-an unknown key}"
          # Without --also_xla: XLA's timing was taken on 2026-11-27 (H100).
          # One layer: every layer's attention calls have the same shapes.
          if timeout 100 python -m experiments.check_cudnn_bias --num_layers=1; then
            [ -n "$key" ] && echo "$key" > "$OUT/cudnn_bias_verified" \
              && echo "== verified: $key (add it to $verified)"
          else
            attn="--config.pretrain.model.attention=manual"
          fi
        fi
        echo "$attn" > "$state/attention"
      fi
      results=${RESULTS:-docs/results/figure3-gpu}; i=0; inside=""
      if [ -z "${RESULTS:-}" ] && [ -f "$state/results/results.jsonl" ]; then
        results=$state/results
        echo "== from this machine's last protocol command's results ($results)"
      fi
      [ -f "$state/inside" ] && inside=$(cat "$state/inside")
      for chunk in "${chunks[@]}"; do
        for try in 1 2; do
          left=$(( end - $(date +%s) ))
          [ "$left" -lt 90 ] && { echo "== ${left} s left: $chunk not run"; break 2; }
          i=$((i + 1)); mkdir -p "$OUT/$i"
          echo "== chunk $chunk: deadline $((left - 25)) s, SIGTERM at $((left - 5)) s ${attn} ${inside}"
          timeout -s TERM $((left - 5)) python -m experiments.in_chunks \
            --preset="$preset" --chunk="$chunk" --deadline_s=$((left - 25)) \
            --out="$OUT/$i" --results="$results" \
            --workdir="${WORKDIR:-$state/workdir}" \
            --checkpoints="${CHECKPOINTS:-deadline}" $attn ${EXTRA:-} $inside
          rc=$?; echo "rc=$rc"
          archive="$OUT/$i/figure3-chunk.tar.gz"
          if [ -f "$archive" ]; then
            # The next chunk (or command) starts from this one's lines (and
            # estimates).
            rm -rf "$state/results.new"; mkdir -p "$state/results.new"
            tar xzf "$archive" -C "$state/results.new"
            rm -rf "$state/results"; mv "$state/results.new" "$state/results"
            results=$state/results
          fi
          # A chunk that failed (rc 1, an error; the deadline's stop is 0
          # and timeout's backstop 124) runs once more with the exact
          # targets computed inside each step, the path the H100 ran on
          # 2026-11-27, in case the window of 16 steps' targets
          # (exact_window, new since) is what failed; unless EXTRA chose a
          # window itself.
          [ "$rc" = 1 ] && [ -z "$inside" ] && [[ "${EXTRA:-}" != *exact_window* ]] || break
          inside="--config.pretrain.exact_window=1"; echo "$inside" > "$state/inside"
          echo "== chunk $chunk failed: again with $inside (the rest of the session too)"
        done
      done
      ls -laR "$OUT" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  date -u
} > "$log" 2>&1
rm -rf "$OUT/profile"  # the top ops are in the log; the trace is large
tail -c 6000 "$log"
