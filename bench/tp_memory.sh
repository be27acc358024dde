#!/usr/bin/env bash
# Tensor-parallel benchmark (not a test): per-rank memory on the 150M model at tp 1, 2 and 4
# (one dp rank: the same global batch of 4 × 256 tokens on every run), where parameters,
# gradients and AdamW state dominate the state and the activations are large enough to see the
# sequence-parallel share. tp 1 (one process) is the reference, measured in the same run.
#
#   bench/tp_memory.sh            # prints a Markdown table (docs/performance.md: "TP memory")
#
# fp32 parameters so that bytes compare directly; 3 steps each (memory is reached at step 1;
# time is the mean of steps 2-3). Columns: the training state the run logs (params + grads +
# AdamW, rank 0), the activations (the heap growth of the forward, max over ranks), the peak
# RSS (max over ranks) and the step time.
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
STEPS=3

run() {  # run <tp>
  local tp=$1
  NPROC=$tp "$CTITAN_ROOT/scripts/run_train.sh" --model.flavor 150M --training.seq_len 256 \
    --training.local_batch_size 4 --training.steps $STEPS --metrics.log_freq 1 \
    --training.mixed_precision_param float32 --parallelism.tensor_parallel_degree "$tp" \
    --lr_scheduler.warmup_steps 1 --job.dump_folder "$OUT/tp$tp" --debug.seed 1 >"$OUT/tp$tp.log" 2>&1 \
    || { echo "bench: run tp $tp failed:" >&2; tail -20 "$OUT/tp$tp.log" >&2; exit 1; }
}

# field <name> <key>: scripts/common.sh's ctitan_metrics_field on that run's metrics.
field() { ctitan_metrics_field "$OUT/$1/metrics.jsonl" "$2"; }

for tp in 1 2 4; do run "$tp"; done

s1=$(field tp1 state_gib); a1=$(field tp1 activation_gib); r1=$(field tp1 memory_gib)
echo
echo "TP memory, 150M model (fp32 params, AdamW), global batch 4 × 256 on one dp rank, $(nproc) cores, $(date -u +%F)"
echo
echo "| tp | params + grads + optimizer per rank (GiB) | vs tp 1 | activations per rank (GiB) | vs tp 1 | peak RSS per rank (GiB) | vs tp 1 | step time (s) |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
for tp in 1 2 4; do
  s=$(field "tp$tp" state_gib); a=$(field "tp$tp" activation_gib); r=$(field "tp$tp" memory_gib)
  t=$(field "tp$tp" step_time)
  awk -v n="$tp" -v s="$s" -v a="$a" -v r="$r" -v t="$t" -v s1="$s1" -v a1="$a1" -v r1="$r1" \
    'BEGIN { printf "| %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f |\n", n, s, s/s1, a, a/a1, r, r/r1, t }'
done
