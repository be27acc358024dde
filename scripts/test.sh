#!/usr/bin/env bash
# The README's test command: installs what is missing, builds everything, runs every test,
# then the CUDA build's part (scripts/test_cuda.sh: compiled, linked and CPU-tested without a
# GPU; CTITAN_CUDA=0 skips it, CTITAN_CUDA=1 runs it after a selection of CPU tests too).
#   ./scripts/test.sh                 # all tests
#   ./scripts/test.sh -R config       # extra arguments go to ctest (of the CPU build; no CUDA part)
set -euo pipefail
source "$(dirname "$0")/common.sh"
ctitan_ensure_deps
# Issue 15's rules, checked before anything is built: every C++ file formatted as
# .clang-format says; no function in checkpoint/, tools/, train*.cpp or training/ over 80
# lines; no header in checkpoint/ includes models/, datasets/ or parallelisms/.
(
  cd "$CTITAN_ROOT"
  ./scripts/check_format.sh
  python3 scripts/check_function_length.py checkpoint/*.cpp checkpoint/*.h tools/*.cpp tools/*.h train*.cpp train.h \
    training/*.cpp training/*.h
  if grep -nE '^#include "(models|datasets|parallelisms)/' checkpoint/*.h; then
    echo "test.sh: a header in checkpoint/ includes models/, datasets/ or parallelisms/ (above)" >&2
    exit 1
  fi
)
cuda="${CTITAN_CUDA:-$(( $# == 0 ))}"
if [[ "$cuda" != 0 ]]; then
  # The CUDA part's venv (PyTorch 2.14.1 and its nvidia-* wheels, ~5.5 GB unpacked from wheel
  # files on disk: mostly unzipping and writing, ~100 s) is installed while the CPU build
  # compiles, instead of after the CPU tests; its log is shown when the CUDA part starts.
  venv_log="$(mktemp)"
  "$CTITAN_ROOT/scripts/test_cuda.sh" --venv-only >"$venv_log" 2>&1 &
  venv_pid=$!
  trap 'kill "$venv_pid" 2>/dev/null || true; rm -f "$venv_log"' EXIT
fi
start=$(date +%s)
ctitan_build
ctitan_log "build took $(( $(date +%s) - start )) s"
# test_hf_tokenizer compares ctitan with Hugging Face tokenizers on both corpora (its
# scripts/make_hf_tokenizers.py trains the tokenizers and writes the reference ids once).
"$CTITAN_ROOT/scripts/fetch_data.sh" all
cd "$CTITAN_BUILD_DIR"
# Tests run nproc at a time, at least two: many of them wait on
# process start-up, sockets and sleeps, and the whole suite must fit CI's 30 minutes.
status=0
ctest --output-on-failure --timeout 900 --parallel "$(( $(nproc) < 2 ? 2 : $(nproc) ))" "$@" || status=$?
if [[ "$cuda" != 0 ]]; then
  venv_status=0
  wait "$venv_pid" || venv_status=$?
  cat "$venv_log" >&2
  if ((venv_status)); then
    ctitan_log "installing the CUDA venv during the build failed (exit $venv_status, above); test_cuda.sh tries again"
  fi
  "$CTITAN_ROOT/scripts/test_cuda.sh" || status=$?
fi
exit $status
