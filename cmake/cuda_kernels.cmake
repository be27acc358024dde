# ctitan's own CUDA kernels (kernels/*_cuda.cu; kernels/fused_cuda.h says what they are), in the
# CUDA build only. nvcc compiles each file on its own into an object of ctitan_kernels: plain
# CUDA C++ with no LibTorch header, so neither CMake's CUDA language (which wants a whole
# toolkit in one place) nor nvcc's parse of LibTorch is needed; the objects' host side calls
# libcudart, which the CUDA build links already (cmake/torch_cuda.cmake).
#
# nvcc: CTITAN_NVCC, else the CUDA PyTorch venv's nvidia-cuda-nvcc wheel (nvidia/cu13/bin;
# scripts/test_cuda.sh installs it beside torch, with its nvidia-nvvm), else CUDA_HOME,
# /usr/local/cuda, PATH (the GPU machine's image has it there).
# CTITAN_CUDA_ARCHS: the GPU generations compiled for (default 80;90: A100, H100/H200), the last
# also as PTX, which newer GPUs compile at load time.
get_filename_component(_cuda_site "${CTITAN_TORCH_ROOT}/.." ABSOLUTE)
file(GLOB _nvcc_hints "${_cuda_site}/nvidia/*/bin")
find_program(CTITAN_NVCC nvcc HINTS ${_nvcc_hints} $ENV{CUDA_HOME}/bin /usr/local/cuda/bin)
if(NOT CTITAN_NVCC)
  message(FATAL_ERROR "CTITAN_WITH_CUDA: nvcc not found (for kernels/*_cuda.cu): pip install "
    "nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 into ${_cuda_site}/.. (scripts/test_cuda.sh does), "
    "or pass -DCTITAN_NVCC=<path>")
endif()
execute_process(COMMAND "${CTITAN_NVCC}" --version OUTPUT_VARIABLE _nvcc_out ERROR_QUIET)
string(REGEX MATCH "release [0-9.]+" _nvcc_release "${_nvcc_out}")
set(CTITAN_CUDA_ARCHS "80;90" CACHE STRING "GPU generations (sm_XX) of ctitan's CUDA kernels; the last also as PTX")
set(_gencode "")
foreach(_arch ${CTITAN_CUDA_ARCHS})
  list(APPEND _gencode "-gencode=arch=compute_${_arch},code=sm_${_arch}")
endforeach()
list(GET CTITAN_CUDA_ARCHS -1 _last_arch)
list(APPEND _gencode "-gencode=arch=compute_${_last_arch},code=compute_${_last_arch}")

file(GLOB _cuda_sources CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/*_cuda.cu)
set(_cuda_objects "")
foreach(_src ${_cuda_sources})
  get_filename_component(_name "${_src}" NAME_WE)
  set(_obj "${CMAKE_BINARY_DIR}/cuda_objects/${_name}.o")
  add_custom_command(OUTPUT "${_obj}"
    COMMAND "${CMAKE_COMMAND}" -E make_directory "${CMAKE_BINARY_DIR}/cuda_objects"
    COMMAND "${CTITAN_NVCC}" -c -O3 -std=c++17 -ccbin "${CMAKE_CXX_COMPILER}" -Xcompiler -fPIC
      "-I${CMAKE_SOURCE_DIR}" ${_gencode} "${_src}" -o "${_obj}"
    DEPENDS "${_src}" "${CMAKE_SOURCE_DIR}/kernels/fused_cuda.h"
    COMMENT "nvcc kernels/${_name}.cu (sm ${CTITAN_CUDA_ARCHS})"
    VERBATIM)
  list(APPEND _cuda_objects "${_obj}")
endforeach()
set_source_files_properties(${_cuda_objects} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
target_sources(ctitan_kernels PRIVATE ${_cuda_objects})
message(STATUS "ctitan: CUDA kernels: ${CTITAN_NVCC} (${_nvcc_release}), sm ${CTITAN_CUDA_ARCHS}")
