// ctitan's own CUDA kernels for the GPU routes of fused_swiglu, fused_rotary_emb and
// fused_cross_entropy (issue 33's fusion): one pass forward and one backward each, where
// ATen's route takes 2 + 4 kernels (SwiGLU), a float32 cast, a complex multiply and a cast
// back each way (RoPE), or a float32 cast, log_softmax, gather and sum per chunk and a
// softmax, scatter and multiply per chunk backward (the cross-entropy).
//
// Compiled into the CUDA build only (kernels/fused_kernels_cuda.cu by nvcc, the torch side in
// fused_ops_cuda.cpp); chosen with CTITAN_GPU_KERNELS=ctitan. ATen's route stays the default
// until the two are measured against each other on a GPU: bench/gpu_kernel_check (part (g) of
// scripts/gpu_check.sh) checks each kernel against ATen and times both. Without a GPU,
// tests/test_cuda_kernels_on_host.cpp runs the kernels' source on the CPU (tests/cuda_host/:
// CUDA's threads as fibers), which checks their paths, indexing and barriers.
//
// Numerics: as the CPU kernels of fused_ops.h. SwiGLU rounds silu(a) to the input dtype before
// the product, and its backward rounds where autograd's mul and silu backward round, so it
// matches at::silu(a) * b. RoPE computes ATen's complex product in float32 and rounds once,
// as the route's cast back does. The cross-entropy works in float32 from the logits' own dtype
// (online max and sum of exp per row), sums the rows in float64, and writes the gradient
// (softmax − one-hot) · upstream · scale straight in the logits' dtype.
#pragma once
#include <cstdint>

namespace ctitan::gpu {

// Element type of a kernel's operands.
enum class Elem { Float32, BFloat16 };

// The launchers: raw device pointers, `stream` a cudaStream_t. Each returns the launch's
// cudaError_t as an int (0: launched).
int swiglu_forward(Elem t, const void* a, const void* b, void* y, int64_t n, void* stream);
int swiglu_backward(Elem t, const void* a, const void* b, const void* dy, void* da, void* db, int64_t n, void* stream);
// RoPE over x [rows, hd] (rows = B·T·heads, row r at position (r / heads) mod T_len), freqs
// float32 [T_len, hd/2, 2] (cos, sin): each pair (a, b) → (a·c − b·s, a·s + b·c); with
// `conjugate` the inverse rotation (the backward). hd even; y may not overlap x.
int rope(Elem t, bool conjugate, const void* x, const float* freqs, void* y, int64_t rows, int64_t hd, int64_t heads,
         int64_t T_len, void* stream);
// Per row of logits [rows, V]: lse[r] = logsumexp(x_r), row_loss[r] = lse[r] − x_r[label_r]
// (NaN for a label outside [0, V): no host check, which would synchronise).
int cross_entropy_forward(Elem t, const void* logits, const int64_t* labels, int64_t rows, int64_t V, float* lse,
                          float* row_loss, void* stream);
// dx[r, j] = (exp(x[r, j] − lse[r]) − [j == label_r]) · coef[0], in the logits' dtype; coef is
// a device float (the upstream gradient times the scale), read by the kernel.
int cross_entropy_backward(Elem t, const void* logits, const int64_t* labels, const float* lse, const float* coef,
                           int64_t rows, int64_t V, void* dx, void* stream);

}  // namespace ctitan::gpu

// The torch side (kernels/fused_ops_cuda.cpp): the CUDA build's, or the CPU build's copy that
// runs the kernels on CPU tensors (CTITAN_CUDA_ON_HOST, tests/test_cuda_kernels_on_host.cpp).
#if defined(CTITAN_WITH_CUDA) || defined(CTITAN_CUDA_ON_HOST)
#include <ATen/core/Tensor.h>

namespace ctitan {

// CTITAN_GPU_KERNELS=ctitan: the GPU routes run the kernels above (read once per process).
bool own_gpu_kernels();
// Whether the GPU route of a layer over t runs ctitan's kernel: own_gpu_kernels() and t
// float32 or bfloat16 (other dtypes stay on ATen's ops).
bool own_gpu_kernel_for(const at::Tensor& t);
// The autograd functions over them (tensors on one CUDA device, float32 or bfloat16; CPU
// tensors with CTITAN_CUDA_ON_HOST).
at::Tensor swiglu_cuda(const at::Tensor& a, const at::Tensor& b);
// x [B, T, heads, hd], freqs_cis float32 [>= T, hd/2, 2] (any device: moved to x's).
at::Tensor rotary_emb_cuda(const at::Tensor& x, const at::Tensor& freqs_cis);
at::Tensor cross_entropy_cuda(const at::Tensor& logits, const at::Tensor& labels, double scale);

}  // namespace ctitan
#endif
