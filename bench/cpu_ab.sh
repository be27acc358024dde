#!/usr/bin/env bash
# Issue 36's measurement in one command, for a CPU whose numbers are not in docs/performance.md
# yet (an AMD EPYC, say): this build against the LibTorch 1.13 build, and the two GEMM libraries
# against each other, each side alternating with the other in the same run.
#
#   bench/cpu_ab.sh [OUT_DIR]      (default: ./cpu_ab-<host>-<date>; a report.md lands there)
#   STEPS=6 RUNS=2 bench/cpu_ab.sh # timed steps per train run, runs of the ab script
#
# What it runs, in order (about 25 minutes on 2 cores, the baseline's build included):
#   1. the CPU: model name, AVX-512 / bf16 / AMX flags, and the library kernels/gemm.h's rule
#      picks here (train's start-up line);
#   2. bench/build_baseline_113.sh: ctitan e41dd51 on Debian's LibTorch 1.13, in its own prefix;
#   3. `PARTS=ab BASELINE=... bench/perf.sh`, RUNS times; the report adds the better ratio of
#      the runs for each cell — issue 36's "every cell ≥ 1.00, best of two runs";
#   4. build/kernel_bench with CTITAN_GEMM=mkl and =onednn, alternating, twice each: ctitan's
#      kernels on each GEMM library (attention's tiles are the library-bound rows), and its
#      second table as it is: float32 attention's direct kernels against the tiles, with the
#      path kernels/attention_direct.h's rule takes on this CPU's vectors and L2 (on a CPU with
#      AVX-512, also run `build/kernel_bench 5 direct 8`: the 8-lane kernels have not been timed there);
#   5. bench/gemm_bench.py: the 33M projection shapes on ATen, MKL and oneDNN.
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
OUT="$(realpath -m "${1:-cpu_ab-$(hostname)-$(date +%Y%m%d-%H%M)}")"
RUNS="${RUNS:-2}"
export STEPS="${STEPS:-6}"
mkdir -p "$OUT"
REPORT="$OUT/report.md"
log() { echo "[cpu_ab] $*" >&2; }
ctitan_ensure_deps >&2
ctitan_build train kernel_bench >&2
ctitan_ensure_default_corpus

{
  echo "# CPU speed report: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD)"
  echo
  echo "- CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
  echo "- flags: $(grep -o -w -E 'avx512f|avx512_bf16|amx_bf16|amx_tile|avx2' /proc/cpuinfo | sort -u | paste -sd' ')"
} >"$REPORT"
"$CTITAN_BUILD_DIR/train" --job.config_file train_configs/debug_model.toml --training.steps 1 \
  --job.dump_folder "$OUT/rule_run" >"$OUT/rule_run.log" 2>&1 || { log "train failed: $OUT/rule_run.log"; exit 1; }
echo "- GEMM rule: $(grep -o 'matmuls: [^;]*' "$OUT/rule_run.log" | head -1)" >>"$REPORT"

log "baseline (bench/build_baseline_113.sh)"
bench/build_baseline_113.sh >"$OUT/baseline_build.log" 2>&1 || { log "baseline build failed: $OUT/baseline_build.log"; exit 1; }
BASELINE="$(sed -n 's/^Baseline .* built: \(.*\)\/train$/\1/p' "$OUT/baseline_build.log")"
[[ -x "$BASELINE/train" ]] || { log "no baseline train in $OUT/baseline_build.log"; exit 1; }

for r in $(seq "$RUNS"); do
  log "ab run $r of $RUNS"
  PARTS=ab BASELINE="$BASELINE" bench/perf.sh >"$OUT/ab_$r.md" 2>"$OUT/ab_$r.log" ||
    { log "perf.sh ab failed: $OUT/ab_$r.log"; exit 1; }
done
{
  echo
  echo "## This build against the LibTorch 1.13 build (e41dd51), $RUNS runs of \`PARTS=ab bench/perf.sh\`, $STEPS timed steps"
  echo
  echo "| model | precision | this / 1.13, each run | best |"
  echo "|---|---|---|---:|"
  cat "$OUT"/ab_*.md | awk -F'|' '$2 ~ /debug|33M/ {
      key = $2 "|" $3; gsub(/ /, "", $6); r[key] = r[key] (r[key] == "" ? "" : ", ") $6
      if (!(key in best) || $6 + 0 > best[key] + 0) best[key] = $6; if (!(key in seen)) { seen[key] = 1; order[++n] = key }
    } END { for (i = 1; i <= n; i++) { k = order[i]; printf "|%s| %s | %s |\n", k, r[k], best[k] } }'
} >>"$REPORT"

log "kernel_bench on each GEMM library"
for r in 1 2; do
  for lib in mkl onednn; do
    CTITAN_GEMM=$lib OMP_NUM_THREADS="$(nproc)" "$CTITAN_BUILD_DIR/kernel_bench" >"$OUT/kernels_${lib}_$r.md" 2>&1 ||
      { log "kernel_bench ($lib) failed: $OUT/kernels_${lib}_$r.md"; exit 1; }
  done
done
{
  echo
  echo "## ctitan's kernels on each GEMM library (build/kernel_bench, ctitan ms, alternating; runs 1, 2)"
  echo
  echo "| kernel | shape | dtype | MKL | oneDNN |"
  echo "|---|---|---|---|---|"
  for lib in mkl onednn; do
    for f in "$OUT"/kernels_${lib}_*.md; do  # the first table only (the second one follows its title)
      awk -F'|' -v lib="$lib" '/^float32 attention/ { exit } NF > 6 && $5 ~ /[0-9]/ { print lib "|" $2 "|" $3 "|" $4 "|" $5 }' "$f"
    done
  done |
    awk -F'|' '{ k = $2 "|" $3 "|" $4; v[k, $1] = v[k, $1] (v[k, $1] == "" ? "" : ", ") $5; if (!(k in seen)) { seen[k] = 1; order[++n] = k } }
      END { for (i = 1; i <= n; i++) { k = order[i]; printf "|%s| %s | %s |\n", k, v[k, "mkl"], v[k, "onednn"] } }'
  for lib in mkl onednn; do
    for r in 1 2; do
      echo
      echo "## float32 attention, direct kernels against tiles (build/kernel_bench, CTITAN_GEMM=$lib, run $r)"
      echo
      sed -n '/^| heads × head dim/,$p' "$OUT/kernels_${lib}_$r.md"
    done
  done
} >>"$REPORT"

log "gemm_bench.py"
{
  echo
  echo "## GEMM per shape (bench/gemm_bench.py)"
  echo
  "$CTITAN_PYTHON" bench/gemm_bench.py --threads "$(nproc)"
} >>"$REPORT" 2>"$OUT/gemm_bench.log" || { log "gemm_bench.py failed: $OUT/gemm_bench.log"; exit 1; }
log "report: $REPORT"
cat "$REPORT"
