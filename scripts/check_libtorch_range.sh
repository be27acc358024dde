#!/usr/bin/env bash
# ctitan against the PyTorch releases it claims to build with (issue 32): for each version, the
# PyTorch wheel from PyPI in a venv of its own, then ctitan's CPU build and/or its CUDA build
# against that wheel's LibTorch, each in a build folder of its own; one line per build says what
# happened. Run before each release (not in CI: docs/build_and_tests.md, "LibTorch versions", says why and what it
# gave last); CI builds the two ends that matter every run: the CPU build on 2.13 (.venv) and
# the CUDA build on 2.11.0, the GPU machine's (scripts/test_cuda.sh).
#   scripts/check_libtorch_range.sh                      # 2.15.0 (CPU and CUDA), 2.11.0 (CPU)
#   scripts/check_libtorch_range.sh 2.14.1 2.12.1:cuda   # VERSION, VERSION:cpu or VERSION:cuda
#
# Per version V:
#   - the venv: $CTITAN_ROOT/.venv-torch-V (~5.5 GB: PyPI's Linux wheels are CUDA builds, with
#     their nvidia-* wheels), or .venv-cuda when that already holds torch V; installed past this
#     machine's pip constraint (PIP_CONSTRAINT=/dev/null: /etc/xdg/pip caps torch at 2.14.1).
#     The CUDA build also needs nvidia-cuda-crt and nvidia-cuda-cccl (the headers cuda_runtime.h
#     includes; cmake/torch_cuda.cmake): installed at the wheel's CUDA major.minor unless the
#     wheel brought them;
#   - the CPU build (build-torch-V-cpu/): -DCTITAN_TORCH_ROOT=<the venv's torch>
#     -DCTITAN_WITH_CUDA=OFF, which links the wheel's CPU side only (libtorch_cpu, libc10) without
#     PyTorch's TorchConfig: a CUDA wheel's TorchConfig wants a whole CUDA toolkit, and PyPI has
#     no CPU wheel of most releases (cmake/torch_cuda.cmake);
#   - the CUDA build (build-torch-V-cuda/): the same with -DCTITAN_WITH_CUDA=ON, as
#     scripts/test_cuda.sh configures build-cuda/;
#   - in each: the libraries, train, checkpoint_tool, generate, tokenize and test_gpu_plan, at
#     nice $CTITAN_RANGE_NICE (default 10), through a ccache folder of the build's own (so these
#     builds do not push CI's entries out of the shared cache); then test_gpu_plan runs (its 18
#     tests take milliseconds, need no GPU, and load the LibTorch the build linked).
# Logs: <build folder>/check.log. Exit status: 0 when every build passed.
set -euo pipefail
source "$(dirname "$0")/common.sh"
NICE="${CTITAN_RANGE_NICE:-10}"
TARGETS=(train checkpoint_tool generate tokenize test_gpu_plan)
specs=("$@")
((${#specs[@]})) || specs=(2.15.0 2.11.0:cpu)

# The torch version a venv holds, read from its files (importing torch takes ~15 s).
venv_torch() {
  local f
  for f in "$1"/lib/python3*/site-packages/torch/version.py; do
    [[ -f "$f" ]] && sed -n "s/^__version__ *= *'\([^']*\)'.*/\1/p" "$f"
  done
  return 0
}
venv_cuda() {
  sed -n "s/^cuda[^=]*= *'\([0-9.]*\)'.*/\1/p" "$1"/lib/python3*/site-packages/torch/version.py 2>/dev/null || true
}

# Prints the venv holding torch $1 (installed when missing), with crt/cccl when $2 is 1.
ensure_venv() {
  local v="$1" want_cuda_headers="$2" venv="$CTITAN_ROOT/.venv-torch-$1" have
  have="$(venv_torch "$venv")"
  if [[ "${have%%+*}" != "$v" && "$(venv_torch "$CTITAN_ROOT/.venv-cuda")" == "$v"* ]]; then
    venv="$CTITAN_ROOT/.venv-cuda"
    have="$(venv_torch "$venv")"
  fi
  if [[ "${have%%+*}" != "$v" ]]; then
    ctitan_log "installing torch==$v from PyPI into $venv"
    [[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
    PIP_CONSTRAINT=/dev/null nice -n "$NICE" "$venv/bin/python" -m pip install -q \
      --disable-pip-version-check "torch==$v" >&2
  fi
  if [[ "$want_cuda_headers" == 1 ]]; then
    local mm pkgs=() p
    mm="$(venv_cuda "$venv" | cut -d. -f1,2)"
    for p in nvidia-cuda-crt nvidia-cuda-cccl; do
      "$venv/bin/python" -m pip show -q "$p" >/dev/null 2>&1 || pkgs+=("$p==$mm.*")
    done
    if [[ -n "$mm" ]] && ((${#pkgs[@]})); then
      ctitan_log "installing ${pkgs[*]} into $venv"
      PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pkgs[@]}" >&2
    fi
  fi
  echo "$venv"
}

# Builds and checks one (version, mode); prints its result line, returns its status.
check_one() {
  local v="$1" mode="$2" venv="$3" build="$CTITAN_ROOT/build-torch-$1-$2" root full cuda t0 t1 std
  root="$(echo "$venv"/lib/python3*/site-packages/torch)"
  full="$(venv_torch "$venv")"
  cuda="$(venv_cuda "$venv")"
  mkdir -p "$build"
  local log="$build/check.log" step=configure
  t0=$(date +%s)
  {
    echo "== torch $full (CUDA ${cuda:-none}), $mode build, $(date -u +%FT%TZ), ctitan $(git -C "$CTITAN_ROOT" rev-parse --short HEAD)$(git -C "$CTITAN_ROOT" diff --quiet HEAD -- || echo '+changes')"
    cmake -S "$CTITAN_ROOT" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCTITAN_WITH_CUDA="$([[ $mode == cuda ]] && echo ON || echo OFF)" -DCTITAN_TORCH_ROOT="$root" &&
      step=build &&
      CCACHE_DIR="$build/ccache" nice -n "$NICE" cmake --build "$build" -j"$(nproc)" --target "${TARGETS[@]}" &&
      step=test_gpu_plan &&
      (cd "$build" && ./test_gpu_plan --gtest_brief=1) &&
      step=done
  } >"$log" 2>&1 || true
  t1=$(date +%s)
  std="$(sed -n 's/^-- ctitan: LibTorch .*C++\([0-9]*\)).*/\1/p' "$log" | tail -1)"
  local what="torch $full (CUDA ${cuda:-none}), ${mode^^} build, C++${std:-?}"
  if [[ "$step" == done ]]; then
    local ran
    ran="$(grep -oE '\[  PASSED  \] [0-9]+ tests?' "$log" | tail -1 | grep -oE '[0-9]+')"
    ctitan_log "LibTorch range: $what: OK, built ${TARGETS[*]} and test_gpu_plan passed ($ran tests) in $((t1 - t0)) s"
    return 0
  fi
  ctitan_log "LibTorch range: $what: FAILED at $step after $((t1 - t0)) s ($log); first error:"
  grep -m1 -E 'error|Error|FAILED' "$log" | cut -c1-400 >&2 || true
  return 1
}

status=0
results=()
for spec in "${specs[@]}"; do
  v="${spec%%:*}"
  modes=(cpu cuda)
  [[ "$spec" == *:* ]] && modes=("${spec#*:}")
  need_headers=0
  [[ " ${modes[*]} " == *" cuda "* ]] && need_headers=1
  if ! venv="$(ensure_venv "$v" "$need_headers")"; then
    ctitan_log "LibTorch range: torch $v: FAILED at pip install"
    status=1
    continue
  fi
  for mode in "${modes[@]}"; do
    if line="$(check_one "$v" "$mode" "$venv" 2>&1)"; then :; else status=1; fi
    echo "$line" >&2
    line="$(head -1 <<<"$line")"
    results+=("${line#*LibTorch range: }")
  done
done
ctitan_log "LibTorch range, summary:"
printf '  %s\n' "${results[@]}" >&2
exit $status
