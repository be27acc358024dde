#!/usr/bin/env bash
# Activation-checkpointing benchmark (not a test): memory held for backward and step time
# of the dense debug model at seq_len 1024 with AC none / selective 2 / selective op / full,
# one process, fp32. "none" is the reference measured in the same run.
#
#   bench/ac_memory.sh         # prints a Markdown table (docs/performance.md: "Activation checkpointing memory")
#
# activation_gib: heap growth from the start of the forward to its end (what autograd keeps
# for backward, plus the logits), max over the measured steps; step time: mean of steps 2-4.
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
STEPS=4
run() {  # run <name> <mode> <option>
  "$CTITAN_BUILD_DIR/train" --job.config_file train_configs/debug_model.toml \
    --training.seq_len 1024 --training.local_batch_size 2 --training.steps $STEPS --metrics.log_freq 1 \
    --activation_checkpoint.mode "$2" --activation_checkpoint.selective_ac_option "$3" \
    --job.dump_folder "$OUT/$1" --debug.seed 1 >"$OUT/$1.log" 2>&1 \
    || { echo "bench: run $1 failed:" >&2; tail -20 "$OUT/$1.log" >&2; exit 1; }
}
field() { /usr/bin/python3 -c '
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
k=sys.argv[2]
if k=="step_time": print((rows[-1]["elapsed_s"]-rows[0]["elapsed_s"])/(len(rows)-1))
elif k=="activation_gib": print(max(r["activation_gib"] for r in rows))
else: print(rows[-1][k])' "$OUT/$1/metrics.jsonl" "$2"; }

run none none 2
run sel2 selective 2
run selop selective op
run full full 2

ref_a=$(field none activation_gib); ref_t=$(field none step_time)
echo
echo "Activation checkpointing, debug model (dim 256, 6 layers), batch 2 × 1024 tokens, fp32, 1 process, $(nproc) cores"
echo
echo "| mode | activation memory (GiB) | vs none | peak RSS (GiB) | step time (s) | vs none |"
echo "|---|---:|---:|---:|---:|---:|"
for v in none:none sel2:"selective 2" selop:"selective op" full:full; do
  n=${v%%:*}; label=${v#*:}
  awk -v l="$label" -v a="$(field "$n" activation_gib)" -v r="$(field "$n" memory_gib)" \
      -v t="$(field "$n" step_time)" -v a0="$ref_a" -v t0="$ref_t" \
      'BEGIN { printf "| %s | %.3f | %.2fx | %.3f | %.2f | %.2fx |\n", l, a, a/a0, r, t, t/t0 }'
done
