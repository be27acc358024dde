#!/usr/bin/env bash
# Trains with ctitan, torchrun-style. With no arguments: installs what is missing, builds,
# fetches the Moby-Dick corpus, trains its tokenizer once, and trains the Llama debug model.
#
#   ./scripts/run_train.sh                                   # debug model, one process
#   CONFIG_FILE=train_configs/debug_model.toml ./scripts/run_train.sh --training.steps 50
#   NPROC=4 ./scripts/run_train.sh                           # 4 ranks on this node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC=8 ./scripts/run_train.sh
#
# Environment: NPROC (or NGPU, as torchtitan's script) ranks per node, NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (a free port when unset), CONFIG_FILE, CTITAN_DATA_DIR,
# CTITAN_BUILD_DIR, CTITAN_NO_BUILD=1 (run that folder's `train` as it is: another build's, to
# compare two builds). Extra arguments are passed to every rank as config overrides.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$CTITAN_ROOT"

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"
NPROC="${NPROC:-${NGPU:-1}}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"

ctitan_ensure_deps
[[ "${CTITAN_NO_BUILD:-0}" == 1 ]] || ctitan_build train ctitan_spm_shim >&2
TRAIN_BIN="$CTITAN_BUILD_DIR/train"

# Default corpus and tokenizer (no-ops when present).
ctitan_ensure_default_corpus

if [[ -z "${MASTER_PORT:-}" ]]; then
  MASTER_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])' 2>/dev/null \
    || echo $((20000 + RANDOM % 20000)))
fi
WORLD_SIZE=$((NPROC * NNODES))
export MASTER_ADDR MASTER_PORT WORLD_SIZE
export LOCAL_WORLD_SIZE="$NPROC"

if ((WORLD_SIZE == 1)); then
  export RANK=0 LOCAL_RANK=0
  exec "$TRAIN_BIN" --job.config_file "$CONFIG_FILE" "$@"
fi

# Several ranks: start them, prefix their output, and when one exits non-zero stop the
# others within seconds and exit with its code, naming it.
declare -A RANK_OF
pids=()
cleanup() {  # TERM, then up to 2 s for the ranks to go, then KILL
  local p alive
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 20); do
    alive=0
    for p in "${pids[@]}"; do  # running: not gone and not a zombie (exited, not yet waited for)
      [[ -e "/proc/$p" && "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]] && alive=1
    done
    ((alive)) || return 0
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
}
# Preemption: SIGTERM / SIGINT / SIGUSR1 are passed on to every rank, which stop together at
# the next step boundary, save a checkpoint and exit 0 (a second signal: at once); the
# launcher keeps waiting and exits with their code. The output prefixers ignore them so
# that a rank's last lines still get through (Ctrl-C signals the whole process group).
signalled=0
forward() {
  signalled=1
  echo "[launcher] received SIG$1: passing it on to the ranks" >&2
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null || true; done
}
for s in TERM INT USR1; do trap "forward $s" "$s"; done
for ((local_rank = 0; local_rank < NPROC; local_rank++)); do
  rank=$((NODE_RANK * NPROC + local_rank))
  (
    export RANK=$rank LOCAL_RANK=$local_rank
    exec "$TRAIN_BIN" --job.config_file "$CONFIG_FILE" "$@"
  ) > >(trap '' TERM INT USR1; exec sed -u "s/^/[rank$rank] /") \
    2> >(trap '' TERM INT USR1; exec sed -u "s/^/[rank$rank] /" >&2) &
  pids+=($!)
  RANK_OF[$!]=$rank
done
# Exit codes of train: 0 ok, 2 bad config, 3 a collective failed (a peer died or timed
# out: a consequence), anything else a failure of that rank itself (signals: 128 + n).
declare -A CODE
live=("${pids[@]}")
failed=()
while ((${#live[@]})); do
  finished=""
  signalled=0
  if wait -n -p finished "${live[@]}"; then code=0; else code=$?; fi
  if [[ -z "${finished:-}" ]]; then
    ((signalled)) && continue  # a trapped signal interrupted the wait
    break
  fi
  CODE[$finished]=$code
  rest=()
  for p in "${live[@]}"; do [[ "$p" != "$finished" ]] && rest+=("$p"); done
  live=("${rest[@]}")
  if ((code != 0)); then
    failed+=("$finished")
    # The rank reported first is not always the one that failed first (its peers see
    # the broken connection at once): give the others up to 3 s to exit, then decide.
    for _ in $(seq 30); do
      rest=()
      for p in "${live[@]}"; do
        if [[ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" == "Z" || ! -e "/proc/$p" ]]; then
          if wait "$p"; then CODE[$p]=0; else CODE[$p]=$?; failed+=("$p"); fi
        else
          rest+=("$p")
        fi
      done
      live=("${rest[@]}")
      ((${#live[@]})) || break
      sleep 0.1
    done
    break
  fi
done
if ((${#failed[@]} == 0)); then
  wait 2>/dev/null || true
  exit 0
fi
trap - TERM INT USR1
cause="${failed[0]}"
for p in "${failed[@]}"; do
  if [[ "${CODE[$p]}" != 3 ]]; then cause="$p"; break; fi
done
echo "[launcher] rank ${RANK_OF[$cause]} exited with code ${CODE[$cause]}; stopping the other ranks" >&2
for p in "${failed[@]}"; do
  [[ "$p" == "$cause" ]] && continue
  echo "[launcher] rank ${RANK_OF[$p]} also exited with code ${CODE[$p]}" >&2
done
cleanup
wait 2>/dev/null || true
exit "${CODE[$cause]}"
