#!/usr/bin/env bash
# The CUDA + NCCL build (issue 17), compiled, linked and tested in every CI run on a machine
# without a GPU: scripts/test.sh calls it after the CPU tests (CTITAN_CUDA=0 skips it).
#   1. PyTorch 2.11.0 (+cu130: CUDA 13.0, NCCL 2.28.9; its nvidia-* wheels), the GPU machine's
#      exact build, in a second venv, $CTITAN_CUDA_VENV (default <repo>/.venv-cuda, ~5.5 GB; its
#      LibTorch is what this build links), so that "compiles in CI" means "compiles there";
#      CTITAN_TORCH_CUDA_VERSION picks another (scripts/check_libtorch_range.sh builds newer ones);
#   2. build-cuda/ configured with -DCTITAN_WITH_CUDA=ON (cmake/torch_cuda.cmake: C++20, the
#      *_cuda.cpp files, libtorch_cuda + libc10_cuda + NCCL; cmake/cuda_kernels.cmake: ctitan's
#      own kernels/*_cuda.cu through the venv's nvcc) and built like the CPU build; configured
#      again when the venv's torch is another than the one it was configured with;
#   3. the log lines that show it: LibTorch's CUDA version, NCCL's, what `train` links;
#   4. tests run with the CUDA-built binaries, which must behave as the CPU build's without a
#      GPU: test_gpu_plan (the device choice, FSDP's stream plan, the pinned staging, the NCCL
#      group) and end-to-end runs of the CUDA-built `train` (a selection of TrainE2E: one and
#      two ranks, the launcher, a checkpoint resumed bitwise). The rest of the suite runs with
#      the CPU build only: CI's time (docs/gpus.md says why and what it took).
#   scripts/test_cuda.sh              # all of the above
#   scripts/test_cuda.sh -R DeviceChoice   # extra arguments replace the test selection
#   scripts/test_cuda.sh --build-only # steps 1-2, the build at nice 19 (scripts/test.sh runs
#                                     # this beside the CPU build and tests: see there)
set -euo pipefail
source "$(dirname "$0")/common.sh"
CUDA_VENV="${CTITAN_CUDA_VENV:-$CTITAN_ROOT/.venv-cuda}"
CUDA_BUILD="${CTITAN_CUDA_BUILD_DIR:-$CTITAN_ROOT/build-cuda}"
TORCH_CUDA_VERSION="${CTITAN_TORCH_CUDA_VERSION:-2.11.0}"
# What runs with the CUDA build's binaries by default (test_gpu_plan's suites, and TrainE2E's
# runs of `train` on one and two ranks, through the launcher, resumed after a stop signal, and
# training.cuda_graphs's refusals with the CUDA build's own graph code linked).
CUDA_TESTS='^((DeviceChoice|FsdpStreamPlan|PinnedStaging|NcclGroups|CudaBuild)\.|TrainE2E\.(TwentyStepsLossFalls|SameSeedGivesBitwiseEqualLosses|BadConfigExitsTwoWithOneLineAndWritesNothing|TwoRanksThroughTheLauncher|StopSignalSavesAndTheRerunResumesExactly|CudaGraphsRefuseWhatTheCaptureCannotTake)$)'


# Step 1: the venv, (re)installed when its torch is not $TORCH_CUDA_VERSION with CUDA or a
# toolkit wheel is missing. nvidia-cuda-crt and nvidia-cuda-cccl: crt/host_config.h and
# nv/target, which cuda_runtime.h and cuda_fp16.h include and PyTorch's wheel does not bring
# (cmake/torch_cuda.cmake); nvidia-cuda-nvcc with its nvidia-nvvm (cicc): the nvcc that compiles
# ctitan's own CUDA kernels (cmake/cuda_kernels.cmake; nvvm pinned, as the nvcc wheel alone
# would take the newest); the versions of the CUDA 13.0 toolkit (13.0.2) that torch 2.11.0's
# wheel depends on (its nvidia-cuda-nvrtc is 13.0.88, its nvidia-cuda-cupti 13.0.85).
ensure_cuda_venv() {
  local crt="${CTITAN_CUDA_CRT_VERSION:-13.0.88}" cccl="${CTITAN_CUDA_CCCL_VERSION:-13.0.85}"
  local nvcc="${CTITAN_CUDA_NVCC_VERSION:-13.0.88}"
  if ! "$CUDA_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_CUDA_VERSION' or not torch.version.cuda)" 2>/dev/null ||
     ! "$CUDA_VENV/bin/python" -m pip show -q nvidia-cuda-crt nvidia-cuda-cccl nvidia-cuda-nvcc nvidia-nvvm >/dev/null 2>&1; then
    ctitan_log "installing PyTorch $TORCH_CUDA_VERSION (CUDA), nvidia-cuda-crt, nvidia-cuda-cccl, nvidia-cuda-nvcc, nvidia-nvvm into $CUDA_VENV"
    [[ -x "$CUDA_VENV/bin/python" ]] || python3 -m venv "$CUDA_VENV"
    "$CUDA_VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_CUDA_VERSION" \
      "nvidia-cuda-crt==$crt" "nvidia-cuda-cccl==$cccl" "nvidia-cuda-nvcc==$nvcc" "nvidia-nvvm==$nvcc"
  fi
}
build_only=0
if [[ "${1:-}" == --build-only ]]; then
  build_only=1
  shift
else
  "$CTITAN_ROOT/scripts/fetch_data.sh" all >/dev/null
fi
t0=$(date +%s)
# CTITAN_CUDA_BUILT=1: scripts/test.sh's --build-only run of this script succeeded, so the venv
# was checked and its versions logged there (each check imports torch: ~15 s).
if [[ "${CTITAN_CUDA_BUILT:-0}" != 1 ]]; then
  ensure_cuda_venv
  "$CUDA_VENV/bin/python" - <<'EOF' >&2
import torch, torch.distributed as dist
print(f"[ctitan] CUDA LibTorch: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"torch.distributed.is_nccl_available() = {dist.is_nccl_available()}, "
      f"GPUs visible here: {torch.cuda.device_count()}")
EOF
fi
t1=$(date +%s)
((build_only == 0)) || renice -n 19 -p $$ >/dev/null

# Configured when build-cuda/ has no cache, was configured with another torch folder (another
# venv) or not as a quick build; the same venv's torch reinstalled at another version
# reconfigures by itself (cmake/torch_cuda.cmake makes the build depend on torch/version.py).
# CTITAN_QUICK_BUILD (CMakeLists.txt): -O1 without debug lines, ~25% less compile time; this
# build only has to compile, link and pass the tests below (scripts/gpu_check.sh builds the
# optimized one on a GPU machine).
TORCH_ROOT="$(echo "$CUDA_VENV"/lib/python3*/site-packages/torch)"
if [[ "$(sed -n 's/^CTITAN_TORCH_ROOT:[A-Z]*=//p' "$CUDA_BUILD/CMakeCache.txt" 2>/dev/null)" != "$TORCH_ROOT" ]] ||
   ! grep -q '^CTITAN_QUICK_BUILD:BOOL=ON$' "$CUDA_BUILD/CMakeCache.txt" 2>/dev/null; then
  cmake -S "$CTITAN_ROOT" -B "$CUDA_BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCTITAN_WITH_CUDA=ON \
    -DCTITAN_QUICK_BUILD=ON -DCTITAN_TORCH_ROOT="$TORCH_ROOT" | grep -E "^-- ctitan" >&2
fi
# Every library and executable, the two test programs run below (each further test program is
# another LibTorch translation unit of ~40 s here; the CPU benchmarks are not built either) and
# gpu_kernel_check (ctitan's CUDA kernels against ATen: runs on a GPU, scripts/gpu_check.sh (g)).
targets=(train checkpoint_tool generate tokenize test_gpu_plan test_train gpu_kernel_check)
cmake --build "$CUDA_BUILD" -j"$(nproc)" --target "${targets[@]}"
t2=$(date +%s)
if ((build_only)); then
  ctitan_log "CUDA build part: venv $((t1 - t0)) s, configure + build $((t2 - t1)) s"
  exit 0
fi

# What the binary links: libtorch_cuda (the CUDA kernels, ProcessGroupNCCL), libc10_cuda, NCCL.
ctitan_log "build-cuda/train links: $(ldd "$CUDA_BUILD/train" | grep -oE 'lib(torch_cuda|c10_cuda|nccl|cudart)[^ ]*' | sort -u | tr '\n' ' ')"
# ctitan's own CUDA kernels are in it: nvcc's fat binary section.
fatbin="$(size -A "$CUDA_BUILD/train" | awk '$1 == ".nv_fatbin" {print $2}')"
if [[ -z "$fatbin" ]]; then
  ctitan_log "build-cuda/train has no .nv_fatbin section: ctitan's CUDA kernels (kernels/*_cuda.cu) were not linked"
  exit 1
fi
ctitan_log "build-cuda/train carries ctitan's CUDA kernels (.nv_fatbin: $fatbin bytes)"

cd "$CUDA_BUILD"
if (($#)); then
  selection=("$@")
else
  selection=(-R "$CUDA_TESTS")
fi
status=0
ctest --output-on-failure --timeout 900 --parallel "$(( $(nproc) < 2 ? 2 : $(nproc) ))" "${selection[@]}" || status=$?
t3=$(date +%s)
ctitan_log "CUDA build part: venv $((t1 - t0)) s, configure + build $((t2 - t1)) s, tests $((t3 - t2)) s"
exit $status
