#!/usr/bin/env bash
# Fault injection: a 2-rank job (debug model, checkpoint every 4 steps) through
# scripts/run_train.sh meets, in turn, each fault below; after each, the same command runs
# again and must resume from the right checkpoint with the losses of an uninterrupted run.
#
#   ./scripts/fault_injection.sh          # prints the table (docs/faults.md)
#
#   SIGTERM            the launcher is signalled mid-run (preemption)
#   SIGKILL rank 1     one rank dies mid-step
#   disk full          the checkpoint file system (a tmpfs) fills up between two saves
#   ENOSPC during save the file system fills while a save is being written (kernel ENOSPC;
#                      CTITAN_CHECKPOINT_FAULT=fill makes rank 1 fill it at that moment)
#   corrupt newest     a byte of the newest checkpoint flipped before the re-run
#
# Columns: detected after = seconds from the fault until the job had exited (the damaged
# checkpoint: from the start of the re-run's checkpoint load until the damage was reported); steps lost = steps
# completed before the fault that the re-run trains again; resumed from = the checkpoint the
# re-run loaded; losses match = every loss the re-run logs equals (as printed, 17 digits) the
# loss of the same step in an uninterrupted run. The disk rows need a tmpfs (root); without
# one they are reported as skipped. Exit status: 0 when every row matched.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
ctitan_build train ctitan_spm_shim >&2

STEPS=16
INTERVAL=4
WORK="$(mktemp -d /tmp/ctitan_faults.XXXXXX)"
MNT="$WORK/tmpfs"
cleanup() {
  mountpoint -q "$MNT" 2>/dev/null && umount "$MNT"
  [[ -n "${CTITAN_KEEP_FAULT_DIR:-}" ]] || rm -rf "$WORK"
}
trap cleanup EXIT

# A small corpus with structure to learn (fixed grammar, fixed seed) and its tokenizer.
awk 'BEGIN {
  split("the whale|the captain|a sailor|the harpooneer|the mate|the ship", s, "|");
  split("watched|followed|feared|sought|sailed past|remembered", v, "|");
  split("the white sea|a distant spout|the old chart|the long voyage|the quiet harbour", o, "|");
  srand(1234);
  for (p = 0; p < 600; p++) {
    n = 2 + int(rand() * 4); line = "";
    for (k = 0; k < n; k++) line = line (k ? " " : "") s[1 + int(rand() * 6)] " " v[1 + int(rand() * 6)] " " o[1 + int(rand() * 5)] ".";
    print line; print "";
  }
}' > "$WORK/corpus.txt"
"$CTITAN_ROOT/scripts/train_tokenizer.sh" "$WORK/corpus.txt" "$WORK/tok.model" 400 >&2

ARGS=(--model.tokenizer_path "$WORK/tok.model" --training.dataset_path "$WORK/corpus.txt"
      --training.steps "$STEPS" --training.seq_len 64 --training.local_batch_size 4 --metrics.log_freq 1
      --lr_scheduler.warmup_steps 2 --optimizer.lr 3e-3 --debug.seed 7
      --checkpoint.enable --checkpoint.interval "$INTERVAL" --checkpoint.keep_latest_k 2
      --checkpoint.no_last_save_model_only --comm.train_timeout_seconds 15)
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# Starts the job writing to $1 in the background (extra environment in the other arguments);
# sets JOB (the launcher's pid).
start_job() {
  local dump="$1"; shift
  env "$@" NPROC=2 CTITAN_BUILD_DIR="$CTITAN_BUILD_DIR" CONFIG_FILE=train_configs/debug_model.toml \
    "$CTITAN_ROOT/scripts/run_train.sh" "${ARGS[@]}" --job.dump_folder "$dump" >>"$dump.log" 2>&1 &
  JOB=$!
}
# Waits for the job; sets CODE and T_EXIT.
wait_job() {
  CODE=0
  wait "$JOB" || CODE=$?
  T_EXIT=$(now)
}
logged_steps() { [[ -f "$1/metrics.jsonl" ]] && wc -l < "$1/metrics.jsonl" || echo 0; }
wait_for_step() {  # until rank 0 has logged step $2
  for _ in $(seq 1200); do (( $(logged_steps "$1") >= $2 )) && return 0; sleep 0.05; done
  echo "timed out waiting for step $2 in $1" >&2; return 1
}
last_step() { tail -n 1 "$1/metrics.jsonl" | grep -o '"step": [0-9]*' | grep -o '[0-9]*$'; }
# The newest complete checkpoint of $1 (0 when none): where a re-run must resume.
newest_complete() {
  local s=0 m
  for m in "$1"/checkpoint/step-*/COMPLETE; do
    [[ -f "$m" ]] || continue
    m=${m%/COMPLETE}; m=${m##*step-}
    ((m > s)) && s=$m
  done
  echo "$s"
}
# "step loss" for every metrics line after line $2 of $1/metrics.jsonl.
losses_after() {
  tail -n +"$(($2 + 1))" "$1/metrics.jsonl" | sed -E 's/.*"step": ([0-9]+).*"loss": ([^,}]+).*/\1 \2/'
}
# Timestamp (s) of the first line of rank 0's log matching $2.
log_time() {
  local line; line=$(grep -m1 -- "$2" "$1/logs/rank0.log" "$1"/logs/rank*.log 2>/dev/null | head -1 | sed -E 's/^[^[]*\[([0-9-]+ [0-9:.]+)\].*/\1/')
  [[ -n "$line" ]] && date -d "$line" +%s.%N || echo ""
}

# The reference: the same job, never interrupted.
REF="$WORK/reference"
start_job "$REF"; wait_job
[[ $CODE == 0 ]] || { echo "the reference run failed (exit $CODE), see $REF.log" >&2; exit 1; }
losses_after "$REF" 0 > "$WORK/reference.losses"

ROWS=()
ALL_MATCH=1
# Re-runs the same command on $1 and checks it. $2: fault name, $3: detected after,
# $4: last step completed before the fault, $5: the step it must resume from.
rerun_and_check() {
  local dump="$1" fault="$2" detected="$3" done_before="$4" expect="$5"
  local before; before=$(logged_steps "$dump")
  start_job "$dump"; wait_job
  local resumed; resumed=$(grep -o 'checkpoint: loaded step [0-9]*' "$dump.log" | tail -1 | grep -o '[0-9]*$' || echo 0)
  if [[ "$detected" == rerun ]]; then  # damage found while loading: from the load's start
    local tl tw
    tl=$(awk '/lr schedule:/ { t = $0 } /cannot be loaded/ { print t; exit }' "$dump/logs/rank0.log" |
         sed -E 's/^\[([0-9-]+ [0-9:.]+)\].*/\1/')
    tw=$(log_time "$dump" "cannot be loaded")
    detected=$([[ -n "$tl" && -n "$tw" ]] && secs "$(date -d "$tl" +%s.%N)" "$tw" || echo "?")
  fi
  local match=yes
  losses_after "$dump" "$before" > "$dump.rerun.losses"
  if [[ $CODE != 0 || "$resumed" != "$expect" ]] ||
     (( $(wc -l < "$dump.rerun.losses") != STEPS - resumed )) ||
     ! diff -q <(cut -d' ' -f2 "$dump.rerun.losses") \
               <(awk -v r="$resumed" '$1 > r { print $2 }' "$WORK/reference.losses") >/dev/null; then
    match=no
    ALL_MATCH=0
    echo "[faults] $fault: re-run exit $CODE, resumed from $resumed (expected $expect); see $dump.log" >&2
  fi
  ROWS+=("| $fault | $detected | $((done_before - resumed)) | step $resumed | $match |")
}

# 1. SIGTERM to the launcher mid-run: both ranks stop after the same step and save it.
D="$WORK/sigterm"
start_job "$D"; wait_for_step "$D" 6
T_FAULT=$(now); kill -TERM "$JOB"; wait_job
S=$(last_step "$D")
[[ $CODE == 0 ]] || echo "[faults] SIGTERM: the job exited $CODE, expected 0" >&2
rerun_and_check "$D" "SIGTERM (launcher)" "$(secs "$T_FAULT" "$T_EXIT")" "$S" "$S"

# 2. SIGKILL of rank 1 mid-run: rank 0 fails its next collective, the launcher stops the job.
D="$WORK/sigkill"
start_job "$D"; wait_for_step "$D" 6
RANK1=""
for p in $(pgrep -P "$JOB"); do
  if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'RANK=1' && [[ "$(readlink "/proc/$p/exe")" == */train ]]; then
    RANK1=$p
  fi
done
T_FAULT=$(now); kill -KILL "$RANK1"; wait_job
K=$(last_step "$D")
[[ $CODE != 0 ]] || echo "[faults] SIGKILL: the job exited 0" >&2
rerun_and_check "$D" "SIGKILL rank 1" "$(secs "$T_FAULT" "$T_EXIT")" "$K" "$(newest_complete "$D")"

# 3 and 4: the checkpoints on a small tmpfs (a full save of both ranks is ~61 MiB; the
# newest two are kept, so 256 MiB holds a run).
if mkdir -p "$MNT" && mount -t tmpfs -o size=256m ctitan_faults "$MNT" 2>/dev/null; then
  # 3. The disk fills up (another writer) after step-8 is saved: the save of step 12 is
  # refused by the free-space check on both ranks before anything is written.
  D="$MNT/diskfull"
  start_job "$D"
  until [[ -f "$D/checkpoint/step-8/COMPLETE" ]]; do sleep 0.05; done
  free_kib=$(df --output=avail -k "$MNT" | tail -1)
  dd if=/dev/zero of="$MNT/filler" bs=1M count=$(( free_kib / 1024 - 8 )) status=none 2>/dev/null || true
  T_FAULT=$(now); wait_job
  K=$(last_step "$D")
  grep -q "refused: not enough free space" "$D.log" || echo "[faults] disk full: no free-space refusal in $D.log" >&2
  rm -f "$MNT/filler"
  rerun_and_check "$D" "disk full (free-space check)" "$(secs "$T_FAULT" "$T_EXIT")" "$K" "$(newest_complete "$D")"
  rm -rf "$D"

  # 4. The disk fills while step 12 is being written: the kernel's ENOSPC fails the save on
  # both ranks; the staging folder (and the filler in it) is removed; step-8 stays.
  D="$MNT/enospc"
  start_job "$D" CTITAN_CHECKPOINT_FAULT=fill:1:12; wait_job
  K=$(last_step "$D")
  TF=$(log_time "$D" "CTITAN_CHECKPOINT_FAULT=fill")
  grep -q "No space left on device" "$D.log" || echo "[faults] ENOSPC: no ENOSPC error in $D.log" >&2
  rerun_and_check "$D" "ENOSPC during a save" "$([[ -n "$TF" ]] && secs "$TF" "$T_EXIT" || echo "?")" "$K" \
    "$(newest_complete "$D")"
  cp "$MNT"/*.log "$WORK/" 2>/dev/null || true
  rm -rf "$D"
else
  ROWS+=("| disk full (free-space check) | skipped: no tmpfs (needs root) | | | |")
  ROWS+=("| ENOSPC during a save | skipped: no tmpfs (needs root) | | | |")
fi

# 5. The newest checkpoint damaged (one flipped byte in rank 1's file) after a stop at step
# 10: the re-run finds it while loading and falls back to step 8 on both ranks.
D="$WORK/corrupt"
start_job "$D" CTITAN_FAULT=term:0:10; wait_job
S=$(last_step "$D")
NEWEST=$(newest_complete "$D")
F="$D/checkpoint/step-$NEWEST/rank1.bin"
printf '%b' "\\x$(printf '%02x' $(( ( $(od -An -tu1 -j 4096 -N1 "$F") ^ 1 ) )))" |
  dd of="$F" bs=1 seek=4096 conv=notrunc status=none
mv "$D/checkpoint/step-$NEWEST" "$WORK/newest.damaged"  # the one before it: where to resume
EXPECT=$(newest_complete "$D")
mv "$WORK/newest.damaged" "$D/checkpoint/step-$NEWEST"
rerun_and_check "$D" "corrupt newest checkpoint" rerun "$S" "$EXPECT"

echo
echo "2 ranks, debug model, $STEPS steps, checkpoint every $INTERVAL steps ($(nproc) cores):"
echo
echo "| fault | detected after (s) | steps lost | resumed from | losses match |"
echo "|---|---:|---:|---|---|"
printf '%s\n' "${ROWS[@]}"
((ALL_MATCH))
