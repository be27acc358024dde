# ctitan's own CUDA kernels (kernels/*_cuda.cu) compiled for the host, as the library
# ctitan_cuda_kernels_on_host, which tests/test_cuda_kernels_on_host.cpp runs on the CPU. Each .cu
# is rewritten by cuda_host_source.cmake (its kernel launches into calls) and compiled against
# tests/cuda_host/'s cuda_runtime.h and cuda_bf16.h, which model CUDA's threads, blocks, barriers
# and warp shuffles on fibers (tests/cuda_host/cuda_runtime.h says what is and is not modelled).
# CPU build only: the CUDA build compiles the same files with nvcc (cmake/cuda_kernels.cmake).
file(GLOB _cuda_sources CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/*_cuda.cu)
set(_host_sources "")
foreach(_src ${_cuda_sources})
  get_filename_component(_name "${_src}" NAME_WE)
  set(_out "${CMAKE_BINARY_DIR}/cuda_host/${_name}.cpp")
  add_custom_command(OUTPUT "${_out}"
    COMMAND "${CMAKE_COMMAND}" -E make_directory "${CMAKE_BINARY_DIR}/cuda_host"
    COMMAND "${CMAKE_COMMAND}" "-DIN=${_src}" "-DOUT=${_out}" -P "${CMAKE_SOURCE_DIR}/cmake/cuda_host_source.cmake"
    DEPENDS "${_src}" "${CMAKE_SOURCE_DIR}/cmake/cuda_host_source.cmake"
    COMMENT "kernels/${_name}.cu for the host"
    VERBATIM)
  list(APPEND _host_sources "${_out}")
endforeach()
# With the torch side of the kernels (kernels/fused_ops_cuda.cpp: autograd functions), which
# CTITAN_CUDA_ON_HOST points at CPU tensors.
add_library(ctitan_cuda_kernels_on_host STATIC ${_host_sources} ${CMAKE_SOURCE_DIR}/tests/cuda_host/cuda_host.cpp
  ${CMAKE_SOURCE_DIR}/kernels/fused_ops_cuda.cpp)
target_compile_definitions(ctitan_cuda_kernels_on_host PUBLIC CTITAN_CUDA_ON_HOST=1)
target_include_directories(ctitan_cuda_kernels_on_host BEFORE PRIVATE ${CMAKE_SOURCE_DIR}/tests/cuda_host)
target_include_directories(ctitan_cuda_kernels_on_host PRIVATE ${CMAKE_SOURCE_DIR})
# `#pragma unroll` is nvcc's; GCC's warning about it says nothing here. No contraction of a · b + c
# into a fused multiply-add: the kernels' __fmul_rn and friends round each operation, as on a GPU.
target_compile_options(ctitan_cuda_kernels_on_host PRIVATE ${CTITAN_WARNINGS} -Wno-unknown-pragmas -ffp-contract=off)
# The test includes ctitan's headers and LibTorch's through the kernels' library.
target_link_libraries(ctitan_cuda_kernels_on_host PUBLIC ctitan_kernels)
