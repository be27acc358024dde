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
# lines; no header in checkpoint/ includes models/, datasets/ or parallelisms/; models/ and
# checkpoint/ include nothing of each other (hf_types/ below both carries what they share); the
# training step reads values back to the host only through read_to_host.
(
  cd "$CTITAN_ROOT"
  ./scripts/check_format.sh
  python3 scripts/check_function_length.py checkpoint/*.cpp checkpoint/*.h tools/*.cpp tools/*.h train*.cpp train.h \
    training/*.cpp training/*.h
  if grep -nE '^#include "(models|datasets|parallelisms)/' checkpoint/*.h; then
    echo "test.sh: a header in checkpoint/ includes models/, datasets/ or parallelisms/ (above)" >&2
    exit 1
  fi
  if grep -rnE '^#include "models/' checkpoint/ || grep -rnE '^#include "checkpoint/' models/; then
    echo "test.sh: checkpoint/ and models/ include each other (above; hf_types/ holds what they share)" >&2
    exit 1
  fi
  # Issue 33's: the training step reads device values back only through read_to_host
  # (kernels/device_route.h), which tests count; a bare .item() / .cpu() would bypass the count.
  if grep -nE '\.item(<[a-z0-9_]+>)?\(|\.cpu\(\)' training/trainer.cpp | grep -v 'read_to_host('; then
    echo "test.sh: training/trainer.cpp reads a tensor to the host without read_to_host (above)" >&2
    exit 1
  fi
)
cuda="${CTITAN_CUDA:-$(( $# == 0 ))}"
if [[ "$cuda" != 0 ]]; then
  # The CUDA part's venv and build run beside the CPU build and tests (its log is shown when the
  # CUDA part's tests start): the venv (~5.5 GB unzipped from wheel files on disk, ~90 s) during
  # the CPU build, then the CUDA build at nice 19, so that it takes only the CPU time the CPU
  # build and the CPU tests leave idle (tests waiting on process start-up, sockets, sleeps) and
  # does not slow them down; whatever is left of it runs at full speed after the CPU tests.
  # A process group of its own (set -m), to renice and stop it as a whole, in this session: with
  # the kernel's autogroups a new session (setsid) would be scheduled beside this one as an
  # equal, whatever its nice value.
  cuda_log="$(mktemp)"
  set -m
  "$CTITAN_ROOT/scripts/test_cuda.sh" --build-only >"$cuda_log" 2>&1 &
  cuda_pid=$!
  set +m
  trap 'kill -- -"$cuda_pid" 2>/dev/null || true; rm -f "$cuda_log"' EXIT
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
# The free space, for reading a failed run: at peak two tests at a time hold ~1.5 GB of the
# temp folder's disk (measured: 1.06 GB for the TP checkpoint test alone).
tmp="${TMPDIR:-/tmp}"
ctitan_log "free space before the tests: $(df -h --output=avail "$tmp" | tail -1 | tr -d ' ') in $tmp, $(df -h --output=avail "$CTITAN_ROOT" | tail -1 | tr -d ' ') in $CTITAN_ROOT"
status=0
ctest --output-on-failure --timeout 900 --parallel "$(( $(nproc) < 2 ? 2 : $(nproc) ))" "$@" || status=$?
if [[ "$cuda" != 0 ]]; then
  # The rest of the CUDA build at the normal priority, then its tests. test_cuda.sh builds
  # again (a no-op after a success); after a failure it also checks the venv again, so the
  # failure shows there too.
  renice -n 0 -g "$cuda_pid" >/dev/null 2>&1 || true
  cuda_status=0
  wait "$cuda_pid" || cuda_status=$?
  cat "$cuda_log" >&2
  if ((cuda_status == 0)); then
    export CTITAN_CUDA_BUILT=1
  else
    ctitan_log "the CUDA build beside the CPU tests failed (exit $cuda_status, above)"
  fi
  "$CTITAN_ROOT/scripts/test_cuda.sh" || status=$?
fi
exit $status
