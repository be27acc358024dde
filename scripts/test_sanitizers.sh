#!/usr/bin/env bash
# Builds ctitan with AddressSanitizer + UndefinedBehaviorSanitizer in its own build folder
# (build-asan, or $CTITAN_ASAN_BUILD_DIR) and runs the unit tests under them.
#
#   ./scripts/test_sanitizers.sh              # the default selection (below)
#   ./scripts/test_sanitizers.sh -R Config    # extra arguments go to ctest instead
#
# LibTorch, OpenBLAS and sentencepiece are not instrumented: ASan still checks every access
# ctitan's own code makes (into LibTorch's tensors too) and UBSan ctitan's arithmetic. Leak
# checking is off (LibTorch keeps allocations until exit on purpose), and the first error
# ends the test (halt_on_error), so a report cannot scroll by unnoticed.
#
# Default selection: every unit test (multi-process collectives and dead-rank tests included);
# not the end-to-end suites that train the model in several processes for tens of steps
# (HEAVY below), which take several times longer under ASan and run code the unit tests
# reach. Set CTITAN_SANITIZE_ALL=1 to run everything.
set -euo pipefail
source "$(dirname "$0")/common.sh"
cd "$CTITAN_ROOT"
ctitan_ensure_deps
BUILD="${CTITAN_ASAN_BUILD_DIR:-$CTITAN_ROOT/build-asan}"
HEAVY='TrainE2E|MetricsE2E|CheckpointE2E|HFE2E|DcpE2E|FSDPParity|FSDP\.Bf16|ACParity\.TwoRanks|MixtralACParity\.TwoRanks|TrainBinary'

if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S "$CTITAN_ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCTITAN_SANITIZE=ON >/dev/null
fi
start=$(date +%s)
cmake --build "$BUILD" -j"$(nproc)"
ctitan_log "sanitizer build took $(( $(date +%s) - start )) s"

export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_odr_violation=0:alloc_dealloc_mismatch=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"

cd "$BUILD"
start=$(date +%s)
if (($#)); then
  ctest --output-on-failure --timeout 1800 "$@"
elif [[ "${CTITAN_SANITIZE_ALL:-0}" == 1 ]]; then
  ctest --output-on-failure --timeout 1800
else
  ctest --output-on-failure --timeout 1800 -E "$HEAVY"
fi
ctitan_log "sanitizer tests took $(( $(date +%s) - start )) s"
