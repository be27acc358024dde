# cmake -DIN=<kernels/x_cuda.cu> -DOUT=<file.cpp> -P cuda_host_source.cmake
# Writes IN with every `kernel<targs> <<<grid, block, shmem, stream>>>(` turned into
# `::ctitan::cuda_host::launch(kernel<targs>, grid, block, shmem, stream)(`, line breaks kept so
# that compiler messages name the .cu's lines. That is the one piece of CUDA syntax that is not
# C++; tests/cuda_host/cuda_runtime.h supplies the rest. Stops when a launch is left over (a
# form this rewrite does not know).
file(READ "${IN}" _src)
string(REGEX REPLACE
  "([A-Za-z_][A-Za-z_0-9]*(<[^<>;(){}]*>)?)([ \t\r\n]*)<<<([^;]*)>>>([ \t\r\n]*)\\("
  "::ctitan::cuda_host::launch(\\1,\\3\\4)\\5(" _out "${_src}")
string(FIND "${_out}" "<<<" _left)
if(NOT _left EQUAL -1)
  message(FATAL_ERROR "cuda_host_source: ${IN} has a kernel launch the rewrite does not know (at character ${_left})")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/cuda_host_source.cmake: do not edit.\n#line 1 \"${IN}\"\n${_out}")
file(RENAME "${OUT}.tmp" "${OUT}")
