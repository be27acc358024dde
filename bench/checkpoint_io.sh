#!/usr/bin/env bash
# Checkpoint I/O benchmark (not a test). Two tables:
#
# 1. Async save: in one run with checkpoint.async_mode = "async", the time of the step that
#    starts each save (the copy of the state, then training while the file is written in the
#    background) against the median step without a save; the same for a synchronous run of
#    the same config. Model ASYNC_FLAVOR (default 33M: ~0.4 GB of parameters + AdamW state),
#    one rank, saves every 4 steps (7 saves in 30 steps).
# 2. Throughput: a full checkpoint (model + optimizer) of IO_FLAVOR (default 150M, ~1.9 GB)
#    saved and then loaded by 1 and 2 ranks; GB/s per rank beside the raw disk speed measured
#    in the same run with dd (write: conv=fsync; read: after dropping the files from the page
#    cache), run by as many processes at once as there are ranks. Loads read from the disk:
#    the checkpoint's files are dropped from the page cache first (posix_fadvise DONTNEED).
#
#   bench/checkpoint_io.sh       # prints Markdown tables (docs/performance.md: "Checkpoint I/O")
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim >&2
ctitan_ensure_default_corpus

OUT="$(mktemp -d "${CTITAN_BENCH_DIR:-/tmp}/ctitan_ckpt_io.XXXXXX")"
trap '[[ -n "${KEEP:-}" ]] || rm -rf "$OUT"' EXIT
ASYNC_FLAVOR="${ASYNC_FLAVOR:-33M}"
IO_FLAVOR="${IO_FLAVOR:-150M}"

train() {  # train <name> <nproc> <args...>
  local name=$1 n=$2
  shift 2
  NPROC=$n "$CTITAN_ROOT/scripts/run_train.sh" --metrics.log_freq 1 --debug.seed 1 --lr_scheduler.warmup_steps 1 \
    --checkpoint.enable --checkpoint.keep_latest_k 0 --job.dump_folder "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1 \
    || { echo "bench: run $name failed:" >&2; tail -20 "$OUT/$name.log" >&2; exit 1; }
}

# Drops a file, or the files under a folder, from this machine's page cache (fsync first, so
# the pages are clean and can go).
drop_cache() {
  /usr/bin/python3 -c '
import os, sys
p = sys.argv[1]
paths = [p] if os.path.isfile(p) else [os.path.join(r, f) for r, _, fs in os.walk(p) for f in fs]
for path in paths:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)' "$1"
}

PARTS="${PARTS:-async io}"

# ---- 1. async save ----------------------------------------------------------------------------
[[ " $PARTS " == *" async "* ]] && for mode in async disabled; do
  train "async_$mode" 1 --model.flavor "$ASYNC_FLAVOR" --training.seq_len 256 --training.local_batch_size 4 \
    --training.steps 30 --checkpoint.interval 4 --checkpoint.async_mode "$mode"
done

# This machine's load drifts (other jobs share its 2 cores), so each save s is judged against
# its own neighbourhood: the step during which it runs, s + 1, against the mean of steps s - 1
# and s (two steps after the previous save's write has finished).
step_stats() {  # step_stats <run>: "<mean step without save> <mean step during save> <ratio of means> <worst ratio> <mean write s> <mean blocked s>"
  /usr/bin/python3 -c '
import json, re, statistics, sys
run = sys.argv[1]
rows = [json.loads(l) for l in open(run + "/metrics.jsonl")]
el = {r["step"]: r["elapsed_s"] for r in rows}
dt = {s: el[s] - el[s - 1] for s in el if s - 1 in el}
saves = list(range(4, 29, 4))
base = [(dt[s - 1] + dt[s]) / 2 for s in saves]
during = [dt[s + 1] for s in saves]
log = open(run + "/logs/rank0.log").read()
found = re.findall(r"saved step ([0-9]+) to .*file written in ([0-9.]+) s; training blocked ([0-9.]+) s", log)
writes = [float(w) for s, w, _ in found if int(s) in saves]
blocked = [float(b) for s, _, b in found if int(s) in saves]
print(statistics.mean(base), statistics.mean(during), statistics.mean(during) / statistics.mean(base),
      max(d / b for d, b in zip(during, base)), statistics.mean(writes), statistics.mean(blocked))' "$OUT/$1"
}
ckpt_mib() { grep -o "saved step 4 to .*(\([0-9.]*\) MiB" "$OUT/$1/logs/rank0.log" | grep -o "[0-9.]* MiB" | head -1; }

[[ " $PARTS " == *" async "* ]] && {
echo
echo "Async save, $ASYNC_FLAVOR model, 1 rank, batch 4 × 256, $(ckpt_mib async_async) per save, $(nproc) cores"
echo
echo "| async_mode | step without a save (s) | step during a save (s) | ratio (7 saves) | worst save | file write (s) | training blocked per save (s) |"
echo "|---|---:|---:|---:|---:|---:|---:|"
for mode in async disabled; do
  read -r base after mean max write blocked < <(step_stats "async_$mode")
  awk -v m="$mode" -v b="$base" -v a="$after" -v r="$mean" -v x="$max" -v w="$write" -v k="$blocked" \
    'BEGIN { printf "| %s | %.3f | %.3f | %.2f | %.2f | %.2f | %.2f |\n", m, b, a, r, x, w, k }'
done
}

# ---- 2. save / load throughput vs dd ------------------------------------------------------------
dd_rate() {  # dd_rate <n> <write|read>: GB/s per process with n processes at once
  local n=$1 what=$2 i pids=()
  for ((i = 0; i < n; i++)); do
    if [[ $what == write ]]; then
      dd if=/dev/zero of="$OUT/dd$i" bs=4M count=256 conv=fsync 2>"$OUT/dd$i.txt" &
    else
      dd if="$OUT/dd$i" of=/dev/null bs=4M 2>"$OUT/dd$i.txt" &
    fi
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$OUT"/dd*.txt | /usr/bin/python3 -c '
import re, sys
r = [int(b) / float(s) / 1e9 for b, s in re.findall(r"^(\d+) bytes .* copied, ([0-9.]+) s", sys.stdin.read(), re.M)]
print(sum(r) / len(r))'
  rm -f "$OUT"/dd*.txt
}

io_stats() {  # io_stats <run> <n>: "<MiB per rank> <save GB/s per rank> <load GB/s per rank>" (means over ranks)
  /usr/bin/python3 -c '
import re, sys
run, n = sys.argv[1], int(sys.argv[2])
mib, save, load = [], [], []
for r in range(n):
    log = open(f"{run}/logs/rank{r}.log").read()
    m = re.search(r"saved step 1 to \S+ \(([0-9.]+) MiB on this rank, ([0-9.]+) s", log)
    l = re.search(r"loaded step 1 from \S+ in ([0-9.]+) s, ([0-9.]+) MiB read", log)
    mib.append(float(m.group(1)))
    save.append(float(m.group(1)) * 2**20 / 1e9 / float(m.group(2)))
    load.append(float(l.group(2)) * 2**20 / 1e9 / float(l.group(1)))
print(sum(mib) / n, sum(save) / n, sum(load) / n)' "$OUT/$1" "$2"
}

[[ " $PARTS " == *" io "* ]] || exit 0
declare -A row
dd_pair() {  # dd_pair <n>: "<write GB/s> <read GB/s>" per process, n processes at once
  local n=$1 i w r
  w=$(dd_rate "$n" write)
  for ((i = 0; i < n; i++)); do drop_cache "$OUT/dd$i"; done
  r=$(dd_rate "$n" read)
  rm -f "$OUT"/dd*
  echo "$w $r"
}
for n in 1 2; do
  # The disk is shared with other work: dd runs just before the save and just after the load.
  read -r dw1 dr1 < <(dd_pair "$n")
  # Step 1 saves the full state (not model-only); the second run resumes from it, cold.
  train "io$n" "$n" --model.flavor "$IO_FLAVOR" --training.seq_len 32 --training.local_batch_size 1 \
    --training.steps 1 --checkpoint.interval 1 --checkpoint.no_last_save_model_only
  drop_cache "$OUT/io$n/checkpoint"
  train "io$n" "$n" --model.flavor "$IO_FLAVOR" --training.seq_len 32 --training.local_batch_size 1 \
    --training.steps 2 --checkpoint.interval 100
  read -r dw2 dr2 < <(dd_pair "$n")
  read -r mib save load < <(io_stats "io$n" "$n")
  row[$n]=$(awk -v n="$n" -v m="$mib" -v s="$save" -v l="$load" -v w1="$dw1" -v w2="$dw2" -v r1="$dr1" -v r2="$dr2" \
    'BEGIN { w = (w1 + w2) / 2; r = (r1 + r2) / 2;
             printf "| %d | %.0f | %.3f | %.3f (%.3f, %.3f) | %.2f | %.3f | %.3f (%.3f, %.3f) | %.2f |", n, m, s, w, w1, w2, s / w, l, r, r1, r2, l / r }')
done
echo
echo "Save and load throughput, $IO_FLAVOR model + AdamW state (full checkpoint), per rank, $(nproc) cores"
echo
echo "| ranks | MiB per rank | save GB/s | dd write GB/s (before, after) | save / dd | load GB/s | dd read GB/s (before, after) | load / dd |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
for n in 1 2; do echo "${row[$n]}"; done
