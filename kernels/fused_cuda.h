// ctitan's own CUDA kernels for the GPU routes of fused_swiglu, fused_rotary_emb and
// fused_cross_entropy (issue 33's fusion): one pass forward and one backward each, where
// ATen's route takes 2 + 4 kernels (SwiGLU), a float32 cast, a complex multiply and a cast
// back each way (RoPE), or a float32 cast, log_softmax, gather and sum per chunk and a
// softmax, scatter and multiply per chunk backward (the cross-entropy). And AdamW's update
// (adamw, adamw_cuda): one multi-tensor pass that reads the gradients in their own dtype (bf16
// under mixed precision, where ATen's fused AdamW needs a float32 copy of them first, an extra
// pass) and can write a bf16 copy of each updated parameter, with ctitan's CPU formula.
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
// (softmax − one-hot) · upstream · scale straight in the logits' dtype. AdamW is the CPU
// update of components/optimizer.cpp (FusedAdamW) operation for operation: the step's
// coefficients in float64 rounded to float32 where it rounds them, then float32 per element in
// its order, each operation rounded on its own (no fused multiply-add); only the device's pow
// (for the bias corrections, in float64) may differ from glibc's in the last bit.
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

// One tensor of an AdamW step: float32 param / exp_avg / exp_avg_sq of n elements, the gradient in
// the launch's Elem (float32 or bf16), an optional bf16 copy of the updated parameter (nullptr:
// none), and a device float holding this tensor's step count (already counting this step).
struct AdamWTensor {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_copy;  // bf16 [n] or nullptr
  const float* step;
  int64_t n;
};
struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
};
// AdamW over `count` tensors, all with gradients of type `grad`: with s = *step, bc_i = 1 − β_i^s,
//   g = grad (/ *grad_scale);  p ← p·(1 − lr·wd);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²;
//   p ← p − (lr / bc1) · m / (√v / √bc2 + eps);  copy ← bf16(p) (round to nearest even).
// One launch covers up to 48 tensors (several launches for more); tensors of no elements are
// skipped. grad_scale (nullable device float): gradients are divided by it as they are read.
// found_inf (nullable device float): when it is nonzero the kernel changes nothing.
// lr_on_device (nullable device double): the learning rate, read by the kernel in place of h.lr,
// so that a captured CUDA graph replays each step with that step's rate; the same bits as
// h.lr = *it (the kernel computes the decay 1 − lr·wd from whichever rate it has).
// Returns cudaError_t as int (cudaErrorInvalidValue for a negative count or size, or no table).
int adamw(Elem grad, const AdamWTensor* tensors, int64_t count, const AdamWHyper& h, const float* grad_scale,
          const float* found_inf, void* stream, const double* lr_on_device = nullptr);

}  // namespace ctitan::gpu

// The torch side (kernels/fused_ops_cuda.cpp): the CUDA build's, or the CPU build's copy that
// runs the kernels on CPU tensors (CTITAN_CUDA_ON_HOST, tests/test_cuda_kernels_on_host.cpp).
#if defined(CTITAN_WITH_CUDA) || defined(CTITAN_CUDA_ON_HOST)
#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

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
// AdamW over lists of tensors on one device (CPU tensors with CTITAN_CUDA_ON_HOST) with ctitan's CPU
// formula. params / exp_avgs / exp_avg_sqs float32 contiguous; grads contiguous float32 or bfloat16
// (may differ between tensors: one launch per dtype); param_copies empty or one per param, each
// undefined (no copy) or a contiguous bfloat16 tensor of the param's numel; steps: float32 0-d
// tensors, this step already counted. grad_scale / found_inf: float32 0-d tensors or nullopt.
// lr_on_device: a float64 0-d tensor on the params' device whose value the kernel reads as the
// learning rate (lr is then unused; training.cuda_graphs replays the step with it), or nullopt.
// Nothing is read back to the host; the step counts are read, never changed.
void adamw_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& param_copies, const std::vector<at::Tensor>& steps, double lr,
                double beta1, double beta2, double eps, double weight_decay,
                const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
                const std::optional<at::Tensor>& lr_on_device = std::nullopt);

}  // namespace ctitan
#endif
