# The CUDA LibTorch of a PyTorch wheel (torch==2.11.0 in .venv-cuda here, the GPU machine's
# build; the device image's PyTorch 2.11 there), used without its TorchConfig: that wants a full
# CUDA toolkit (nvcc, cudart, cuDNN/cuSPARSE headers where CMake's FindCUDA looks), which neither
# a fresh Debian 12 machine nor the device image has in one place. ctitan compiles no .cu file;
# the GPU work goes through ATen and c10d, so the headers (torch's, the CUDA runtime's and
# NCCL's, which the wheels' nvidia-* packages carry) and the shared libraries are all it needs.
#
# Also the CPU build (CTITAN_WITH_CUDA=OFF) against a wheel's LibTorch given as
# CTITAN_TORCH_ROOT: only its CPU side (libtorch_cpu, libc10), no CUDA header or library. PyPI
# has CUDA wheels only for most releases, so this is how a CPU build against them is checked
# (scripts/check_libtorch_range.sh).
#
# In:  CTITAN_TORCH_ROOT (…/site-packages/torch), else Torch_DIR (…/torch/share/cmake/Torch),
#      else <source>/.venv-cuda's torch.
# Out: TORCH_LIBRARIES (one interface target: ctitan_torch_cuda, or ctitan_torch_cpu in the CPU
#      build), TORCH_INSTALL_PREFIX,
#      Torch_VERSION, CTITAN_CUDA_VERSION, CTITAN_NCCL_VERSION (the last two: CUDA build only).

if(NOT CTITAN_TORCH_ROOT)
  if(Torch_DIR)
    get_filename_component(CTITAN_TORCH_ROOT "${Torch_DIR}/../../.." ABSOLUTE)
  else()
    file(GLOB _roots "${CMAKE_SOURCE_DIR}/.venv-cuda/lib/python3*/site-packages/torch")
    list(GET _roots 0 CTITAN_TORCH_ROOT)
  endif()
endif()
# What was found under another LibTorch (a build folder configured again with another venv)
# is found again under this one.
if(DEFINED CACHE{CTITAN_TORCH_ROOT_CONFIGURED} AND NOT CTITAN_TORCH_ROOT_CONFIGURED STREQUAL CTITAN_TORCH_ROOT)
  foreach(_var CTITAN_CUDART_INCLUDE CTITAN_NCCL_INCLUDE CTITAN_CUDART_LIBRARY CTITAN_NCCL_LIBRARY CTITAN_CUDA_CRT_INCLUDE)
    unset(${_var} CACHE)
  endforeach()
endif()
set(CTITAN_TORCH_ROOT_CONFIGURED "${CTITAN_TORCH_ROOT}" CACHE INTERNAL "the LibTorch the cached paths belong to")
# The same venv's torch reinstalled at another version configures the build again.
set_property(DIRECTORY "${CMAKE_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${CTITAN_TORCH_ROOT}/version.py")
set(_lib "${CTITAN_TORCH_ROOT}/lib")

if(NOT CTITAN_WITH_CUDA)
  if(NOT EXISTS "${_lib}/libtorch_cpu.so")
    message(FATAL_ERROR "ctitan: no LibTorch at CTITAN_TORCH_ROOT '${CTITAN_TORCH_ROOT}' (lib/libtorch_cpu.so missing)")
  endif()
  set(TORCH_INSTALL_PREFIX "${CTITAN_TORCH_ROOT}")
  file(STRINGS "${CTITAN_TORCH_ROOT}/version.py" _v REGEX "^__version__")
  string(REGEX REPLACE "^__version__ *= *'([^'+]*).*" "\\1" Torch_VERSION "${_v}")
  add_library(ctitan_torch_cpu INTERFACE IMPORTED)
  set_target_properties(ctitan_torch_cpu PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CTITAN_TORCH_ROOT}/include;${CTITAN_TORCH_ROOT}/include/torch/csrc/api/include"
    # What torch_cpu's exported target defines (Caffe2Targets.cmake), less the NCCL group.
    INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_RPC;USE_TENSORPIPE"
    INTERFACE_LINK_LIBRARIES "${_lib}/libtorch_cpu.so;${_lib}/libtorch.so;${_lib}/libc10.so")
  set(TORCH_LIBRARIES ctitan_torch_cpu)
  message(STATUS "ctitan: CPU build against the wheel's LibTorch ${Torch_VERSION} at ${CTITAN_TORCH_ROOT} "
    "(its CPU side only: libtorch_cpu, libc10)")
  return()
endif()

if(NOT EXISTS "${CTITAN_TORCH_ROOT}/lib/libtorch_cuda.so")
  message(FATAL_ERROR "CTITAN_WITH_CUDA: no CUDA LibTorch at '${CTITAN_TORCH_ROOT}' (lib/libtorch_cuda.so "
    "missing); pass -DCTITAN_TORCH_ROOT=<site-packages>/torch of a CUDA PyTorch (scripts/test_cuda.sh "
    "installs torch==2.11.0 into .venv-cuda)")
endif()
set(TORCH_INSTALL_PREFIX "${CTITAN_TORCH_ROOT}")
get_filename_component(_site "${CTITAN_TORCH_ROOT}/.." ABSOLUTE)

# Versions, from the files the wheel installs.
file(STRINGS "${CTITAN_TORCH_ROOT}/version.py" _v REGEX "^__version__")
string(REGEX REPLACE "^__version__ *= *'([^'+]*).*" "\\1" Torch_VERSION "${_v}")
file(STRINGS "${CTITAN_TORCH_ROOT}/version.py" _v REGEX "^cuda")
string(REGEX REPLACE ".*'([0-9.]+)'.*" "\\1" CTITAN_CUDA_VERSION "${_v}")
if(NOT CTITAN_CUDA_VERSION MATCHES "^[0-9]")
  message(FATAL_ERROR "CTITAN_WITH_CUDA: ${CTITAN_TORCH_ROOT} is a LibTorch without CUDA (version.py: ${_v})")
endif()

# Headers: the CUDA runtime's and NCCL's, where the nvidia-* wheels put them (cu13: nvidia/cu13,
# cu12: nvidia/cuda_runtime; nvidia/nccl), else a CUDA toolkit.
file(GLOB _cuda_hints "${_site}/nvidia/*/include")
find_path(CTITAN_CUDART_INCLUDE cuda_runtime_api.h HINTS ${_cuda_hints} $ENV{CUDA_HOME}/include
  /usr/local/cuda/include NO_CMAKE_SYSTEM_PATH)
find_path(CTITAN_NCCL_INCLUDE nccl.h HINTS ${_cuda_hints} $ENV{CUDA_HOME}/include /usr/local/cuda/include)
file(GLOB _cuda_lib_hints "${_site}/nvidia/*/lib")
find_library(CTITAN_CUDART_LIBRARY NAMES cudart libcudart.so.13 libcudart.so.12
  HINTS ${_cuda_lib_hints} $ENV{CUDA_HOME}/lib64 /usr/local/cuda/lib64)
find_library(CTITAN_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_cuda_lib_hints})
foreach(_var CTITAN_CUDART_INCLUDE CTITAN_NCCL_INCLUDE CTITAN_CUDART_LIBRARY CTITAN_NCCL_LIBRARY)
  if(NOT ${_var})
    message(FATAL_ERROR "CTITAN_WITH_CUDA: ${_var} not found under ${_site}/nvidia (the nvidia-* wheels "
      "that come with the CUDA PyTorch) nor in a CUDA toolkit (CUDA_HOME, /usr/local/cuda)")
  endif()
endforeach()
# cuda_runtime.h includes crt/host_config.h and cuda_fp16.h nv/target, which come with nvcc (the
# nvidia-cuda-crt and nvidia-cuda-cccl wheels), not with the runtime PyTorch's wheel depends on:
# scripts/test_cuda.sh installs them into the same venv; scripts/vendor_build_deps.sh copies
# them into build-deps/cuda for the GPU machine.
find_path(CTITAN_CUDA_CRT_INCLUDE crt/host_config.h HINTS ${CTITAN_CUDART_INCLUDE} ${_cuda_hints}
  "${CMAKE_SOURCE_DIR}/build-deps/cuda/include" $ENV{CUDA_HOME}/include /usr/local/cuda/include NO_CMAKE_SYSTEM_PATH)
if(NOT CTITAN_CUDA_CRT_INCLUDE OR NOT EXISTS "${CTITAN_CUDA_CRT_INCLUDE}/nv/target")
  message(FATAL_ERROR "CTITAN_WITH_CUDA: crt/host_config.h and nv/target (included by cuda_runtime.h) not found "
    "beside ${CTITAN_CUDART_INCLUDE}: pip install nvidia-cuda-crt nvidia-cuda-cccl (the CUDA runtime's "
    "version) into that venv")
endif()
set(_cuda_includes "${CTITAN_CUDART_INCLUDE};${CTITAN_NCCL_INCLUDE}")
if(NOT CTITAN_CUDA_CRT_INCLUDE STREQUAL CTITAN_CUDART_INCLUDE)
  list(APPEND _cuda_includes "${CTITAN_CUDA_CRT_INCLUDE}")
endif()
file(STRINGS "${CTITAN_NCCL_INCLUDE}/nccl.h" _n REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*NCCL_MINOR ([0-9]+).*NCCL_PATCH ([0-9]+).*" "\\1.\\2.\\3"
  CTITAN_NCCL_VERSION "${_n}")

# The NCCL process group is compiled into libtorch_cuda only when PyTorch was built with
# USE_C10D_NCCL; its exported target properties say so.
file(STRINGS "${CTITAN_TORCH_ROOT}/share/cmake/Caffe2/Caffe2Targets.cmake" _defs REGEX "USE_C10D_NCCL")
if(NOT _defs)
  message(FATAL_ERROR "CTITAN_WITH_CUDA: ${CTITAN_TORCH_ROOT} was built without USE_C10D_NCCL (no ProcessGroupNCCL)")
endif()

add_library(ctitan_torch_cuda INTERFACE IMPORTED)
set_target_properties(ctitan_torch_cuda PROPERTIES
  # (an imported target's include directories are system ones: no warnings from them)
  INTERFACE_INCLUDE_DIRECTORIES "${CTITAN_TORCH_ROOT}/include;${CTITAN_TORCH_ROOT}/include/torch/csrc/api/include;${_cuda_includes}"
  # What torch_cpu's and torch_cuda's exported targets define (Caffe2Targets.cmake).
  INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_C10D_NCCL;USE_RPC;USE_TENSORPIPE"
  # --no-as-needed: nothing of ctitan's calls into libtorch_cuda for the CUDA kernels, which
  # register themselves with the dispatcher when the library is loaded.
  INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed,${_lib}/libtorch_cuda.so,${_lib}/libtorch_cpu.so,${_lib}/libtorch.so -Wl,--as-needed;${_lib}/libc10_cuda.so;${_lib}/libc10.so;${CTITAN_CUDART_LIBRARY};${CTITAN_NCCL_LIBRARY}")
set(TORCH_LIBRARIES ctitan_torch_cuda)
message(STATUS "ctitan: CUDA build: LibTorch ${Torch_VERSION} at ${CTITAN_TORCH_ROOT}, CUDA ${CTITAN_CUDA_VERSION}, "
  "NCCL ${CTITAN_NCCL_VERSION} (${CTITAN_NCCL_LIBRARY}); ProcessGroupNCCL: libtorch_cuda.so built with USE_C10D_NCCL")
