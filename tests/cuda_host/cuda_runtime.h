// The part of CUDA's runtime that kernels/*_cuda.cu use, for compiling those files for the host
// (tests/test_cuda_kernels_on_host.cpp; cmake/cuda_on_host.cmake). Not CUDA: a model of its
// thread hierarchy that runs the kernels' own source on the CPU, so that their indexing, bounds,
// tails and barriers are checked without a GPU. What it does not model: the GPU's float
// arithmetic (expf and friends are glibc's here), its memory model beyond barriers, partial-warp
// masks, several streams, shared memory sizes.
//
// How a launch runs (cuda_host.cpp): the `<<<grid, block, shmem, stream>>>` of the source is
// rewritten into ctitan::cuda_host::launch(...) at build time; the blocks run one after another,
// and each thread of a block is a fiber (ucontext) on one OS thread, switched at __syncthreads and
// at warp shuffles. When no thread of the first block reaches a barrier, the later blocks' threads
// run one after another without fibers (a barrier reached there then stops the process). A barrier that not every thread of its block (or warp) reaches, a shuffle
// with a lane that does not exist, or an invalid launch configuration ends the process with one
// line saying which; an invalid configuration is also cudaGetLastError()'s answer, as on a GPU.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
typedef enum cudaError cudaError_t;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;

struct float2 {
  float x, y;
};
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

// The running thread's coordinates, set by the scheduler before it switches to a thread.
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One block runs at a time, so a function-local static is the block's shared memory. All of
// them share one ELF section, which the scheduler fills with 0xFF bytes before each block (NaN
// as a float, −1 as an integer): shared memory starts undefined on a GPU, and a kernel that
// reads it before writing it gets poison here, not a zero or the previous block's value.
#define __shared__ static __attribute__((section("ctitan_cuda_shared")))

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t e);

namespace ctitan::cuda_host {

// Runs body as every thread of every block of the grid (see the header comment).
void run_grid(dim3 grid, dim3 block, const std::function<void()>& body);
// Warp shuffle support: exchanges `bits` across the calling thread's warp.
uint64_t shuffle_xor(unsigned mask, uint64_t bits, int lane_mask, int width);
void sync_block();

// kernel<<<grid, block, shmem, stream>>>(args...) becomes launch(kernel, grid, block, shmem, stream)(args...).
template <class... P>
auto launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t /*shmem*/ = 0, cudaStream_t /*stream*/ = nullptr) {
  return [=](auto... args) { run_grid(grid, block, [&] { kernel(args...); }); };
}

}  // namespace ctitan::cuda_host

inline void __syncthreads() { ctitan::cuda_host::sync_block(); }

// CUDA's float operations rounded to nearest even one at a time (nvcc never contracts them into a
// fused multiply-add): the host's IEEE operations, which GCC does not contract in ISO C++ mode
// (cmake/cuda_on_host.cmake also passes -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }

template <class V>
V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<V> && sizeof(V) <= 8, "a shuffle moves at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  bits = ctitan::cuda_host::shuffle_xor(mask, bits, lane_mask, width);
  V out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
