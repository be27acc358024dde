#!/usr/bin/env bash
# FSDP benchmark (not a test): per-rank memory for N = 1, 2, 4 ranks on the 150M model,
# where parameters, gradients and AdamW state dominate, and the step time with the
# all-gather prefetch on and off. N = 1 (no FSDP) is the reference measured in the same run.
#
#   bench/fsdp_memory.sh            # prints a Markdown table (docs/performance.md: "FSDP memory")
#
# Same global batch (4 × 128 tokens) at every N; fp32 parameters so that bytes compare
# directly; 4 steps each (memory is reached at step 1; time is the mean of steps 2-4).
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
STEPS=4

run() {  # run <name> <nproc> <prefetch>
  local name=$1 n=$2 prefetch=$3
  NPROC=$n "$CTITAN_ROOT/scripts/run_train.sh" --model.flavor 150M --training.seq_len 128 \
    --training.local_batch_size $((4 / n)) --training.steps $STEPS --metrics.log_freq 1 \
    --training.mixed_precision_param float32 --parallelism.fsdp_prefetch "$prefetch" \
    --lr_scheduler.warmup_steps 1 --job.dump_folder "$OUT/$name" --debug.seed 1 >"$OUT/$name.log" 2>&1 \
    || { echo "bench: run $name failed:" >&2; tail -20 "$OUT/$name.log" >&2; exit 1; }
}

# field <name> <key>: scripts/common.sh's ctitan_metrics_field on that run's metrics.
field() { ctitan_metrics_field "$OUT/$1/metrics.jsonl" "$2"; }

for n in 1 2 4; do run "n$n" "$n" true; done
run "n2_noprefetch" 2 false

ref_state=$(field n1 state_gib); ref_rss=$(field n1 memory_gib)
echo
echo "FSDP memory, 150M model (fp32 params, AdamW), global batch 4 × 128, $(nproc) cores"
echo
echo "| ranks | params + grads + optimizer per rank (GiB) | vs 1 rank | peak RSS per rank (GiB) | vs 1 rank | step time (s) |"
echo "|---:|---:|---:|---:|---:|---:|"
for n in 1 2 4; do
  s=$(field "n$n" state_gib); r=$(field "n$n" memory_gib); t=$(field "n$n" step_time)
  awk -v n="$n" -v s="$s" -v r="$r" -v t="$t" -v s1="$ref_state" -v r1="$ref_rss" \
    'BEGIN { printf "| %d | %.3f | %.3f | %.3f | %.3f | %.2f |\n", n, s, s/s1, r, r/r1, t }'
done
echo
echo "Prefetch (2 ranks): the next unit's all-gather issued while the current unit computes"
echo
echo "| prefetch | step time (s) | communication wait per step, max over ranks (s) |"
echo "|---|---:|---:|"
for v in n2:on n2_noprefetch:off; do
  name=${v%%:*}; label=${v##*:}
  awk -v l="$label" -v t="$(field "$name" step_time)" -v c="$(field "$name" comm_per_step)" \
    'BEGIN { printf "| %s | %.2f | %.3f |\n", l, t, c }'
done
