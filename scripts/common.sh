# Sourced by the scripts in this folder: locate the repo, install what is missing, build.
# shellcheck shell=bash
CTITAN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CTITAN_BUILD_DIR="${CTITAN_BUILD_DIR:-$CTITAN_ROOT/build}"
export CTITAN_DATA_DIR="${CTITAN_DATA_DIR:-$CTITAN_ROOT/data}"
# The virtual environment with PyTorch 2.13: its LibTorch is what ctitan builds on (unless
# CTITAN_TORCH_DIR names another LibTorch's share/cmake/Torch), its python the reference.
export CTITAN_VENV="${CTITAN_VENV:-$CTITAN_ROOT/.venv}"
CTITAN_PYTHON="$CTITAN_VENV/bin/python"

ctitan_log() { echo "[ctitan] $*" >&2; }

# Installs the Debian packages when any is missing (no-op otherwise).
ctitan_ensure_deps() {
  if ! "$CTITAN_ROOT/scripts/install_deps.sh" --check >/dev/null 2>&1; then
    ctitan_log "installing missing dependencies (scripts/install_deps.sh)"
    "$CTITAN_ROOT/scripts/install_deps.sh"
  fi
}

# Configures (once) and builds the given targets (default: all) with ccache.
ctitan_build() {
  local jobs
  jobs="$(nproc)"
  if [[ ! -f "$CTITAN_BUILD_DIR/CMakeCache.txt" ]]; then
    local torch_dir="${CTITAN_TORCH_DIR:-}"
    if [[ -z "$torch_dir" ]]; then
      torch_dir="$("$CTITAN_PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch"
    fi
    # Its "-- ctitan: LibTorch <version> (CUDA: OFF, C++17)" line goes to the log (CI's shows 2.13).
    cmake -S "$CTITAN_ROOT" -B "$CTITAN_BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DTorch_DIR="$torch_dir" | grep -E "^-- ctitan" >&2
  fi
  if (($#)); then
    local t args=()
    for t in "$@"; do args+=(--target "$t"); done
    cmake --build "$CTITAN_BUILD_DIR" -j"$jobs" "${args[@]}"
  else
    cmake --build "$CTITAN_BUILD_DIR" -j"$jobs"
  fi
}

# The default corpus (Moby-Dick) and its tokenizer, fetched / trained once.
CTITAN_DEFAULT_TOKENIZER="$CTITAN_DATA_DIR/tokenizers/moby_dick_2048.model"
ctitan_ensure_default_corpus() {
  if [[ ! -s "$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" ]]; then
    "$CTITAN_ROOT/scripts/fetch_data.sh" moby_dick
  fi
  if [[ ! -s "$CTITAN_DEFAULT_TOKENIZER" ]]; then
    "$CTITAN_ROOT/scripts/train_tokenizer.sh" "$CTITAN_DATA_DIR/moby_dick/moby_dick.txt" \
      "$CTITAN_DEFAULT_TOKENIZER" 2048
  fi
}

# ctitan_metrics_field <metrics.jsonl> <key>: the key's value in the last metrics line;
# step_time: the mean step time of steps 2..N; comm_per_step: comm_wait_s summed over steps
# 2..N, per step (the benchmarks' tables).
ctitan_metrics_field() {
  /usr/bin/python3 -c '
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
k=sys.argv[2]
if k=="step_time":
    print((rows[-1]["elapsed_s"]-rows[0]["elapsed_s"])/(len(rows)-1))
elif k=="comm_per_step":
    print(sum(r.get("comm_wait_s",0.0) for r in rows[1:])/(len(rows)-1))
else:
    print(rows[-1][k])' "$1" "$2"
}
