#!/usr/bin/env bash
# Memory-estimate calibration (not a test: ~10 minutes on 2 cores). For each flavor, rank
# count and AC mode, trains a few steps and compares each rank's start-up estimate with its
# measured peak RSS (VmHWM, reset just before the model is built, read after the last step):
# the line "peak RSS: X GiB on this rank ... (start-up estimate Y GiB ...)" of every rank's
# log. Prints a Markdown table (docs/configs.md: "Start-up", the memory estimate).
#
#   bench/memory_estimate.sh                  # every cell
#   CELLS="debugmodel:1:none debugmodel:2:full" bench/memory_estimate.sh
#
# Sizes: debugmodel at 8 × 256 tokens (the config's batch), 33M at 4 × 256, 150M at 2 × 256;
# 3 steps (the optimizer state exists from step 1, the caching allocator's reuse from step 2).
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
STEPS="${STEPS:-3}"
DEFAULT_CELLS=""
for f in debugmodel 33M 150M; do
  for n in 1 2; do
    for ac in none selective full; do DEFAULT_CELLS+="$f:$n:$ac "; done
  done
done
CELLS="${CELLS:-$DEFAULT_CELLS}"

batch_of() { case "$1" in debugmodel) echo 8 ;; 33M) echo 4 ;; *) echo 2 ;; esac; }

echo "| flavor | ranks | AC | batch × seq | estimate (GiB) | peak RSS (GiB) | error |"
echo "|---|---:|---|---|---:|---:|---:|"
worst=0
for cell in $CELLS; do
  IFS=: read -r flavor nproc ac <<<"$cell"
  b=$(batch_of "$flavor")
  dump="$OUT/$flavor-$nproc-$ac"
  NPROC=$nproc "$CTITAN_ROOT/scripts/run_train.sh" --model.flavor "$flavor" \
    --training.local_batch_size "$b" --training.seq_len 256 --training.steps "$STEPS" --metrics.log_freq 1 \
    --activation_checkpoint.mode "$ac" --job.dump_folder "$dump" --debug.seed 1 >"$dump.log" 2>&1 \
    || { echo "bench: $cell failed:" >&2; tail -20 "$dump.log" >&2; exit 1; }
  # Per rank: the estimate and the peak RSS after the last step ("peak RSS" line of the log).
  row=$(/usr/bin/python3 - "$dump" "$nproc" <<'PY'
import re, sys
dump, n = sys.argv[1], int(sys.argv[2])
worst = None
for r in range(n):
    text = open(f"{dump}/logs/rank{r}.log").read()
    m = re.findall(r"peak RSS: ([0-9.]+) GiB on this rank .*start-up estimate ([0-9.]+) GiB", text)[-1]
    peak, est = float(m[0]), float(m[1])
    err = (est - peak) / peak * 100
    if worst is None or abs(err) > abs(worst[2]): worst = (est, peak, err)
print("%.3f %.3f %+.1f" % worst)
PY
)
  read -r est peak err <<<"$row"
  echo "| $flavor | $nproc | $ac | $b × 256 | $est | $peak | $err% |"
  worst=$(/usr/bin/python3 -c "print(max($worst, abs($err)))")
done
echo
echo "worst |error|: $worst% ($(nproc) cores; error = (estimate - peak) / peak, the rank with the larger |error|)"
