# Sourced by the scripts in this folder: locate the repo, install what is missing, build.
# shellcheck shell=bash
CTITAN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CTITAN_BUILD_DIR="${CTITAN_BUILD_DIR:-$CTITAN_ROOT/build}"
export CTITAN_DATA_DIR="${CTITAN_DATA_DIR:-$CTITAN_ROOT/data}"

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
    cmake -S "$CTITAN_ROOT" -B "$CTITAN_BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
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
