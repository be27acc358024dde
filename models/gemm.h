// Matrix multiplies for the model's projections and attention tiles.
//
// LibTorch 1.13 (Debian's CPU build) sends fp32 matmuls to the system BLAS (OpenBLAS) and
// bf16 ones to oneDNN's matmul primitive. The same libdnnl that LibTorch links also exports
// plain GEMM entry points (dnnl_sgemm, and dnnl_gemm_bf16bf16f32: bf16 operands, fp32
// result). Measured on this machine (2 cores, Zen 4; bench/gemm_bench.py, the 33M model's
// shapes), oneDNN's sgemm runs the backward's layouts (dY·W and dYᵀ·X) 1.06-1.18x faster
// than OpenBLAS (190-219 against 178-196 GFLOP/s; other runs of the same script 150-185
// for OpenBLAS), and both GEMMs take leading dimensions, alpha and beta: attention tiles are read
// in place (no strip copies), the softmax scale rides in alpha and dK/dV accumulate in fp32
// with beta = 1 (no partial-product tensors, no bf16 rounding of the partial sums).
//
// Backend, chosen once per process: oneDNN when its symbols are found, else ATen (at::mm,
// what at::linear would run). CTITAN_GEMM=aten forces ATen (A/B measurements, and a way
// out should a oneDNN build misbehave); CTITAN_GEMM=onednn insists on oneDNN (error if absent).
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace ctitan::gemm {

enum class Backend { OneDNN, MKL, ATen };
Backend backend();
const char* backend_name(Backend b);

// A matrix operand in row-major storage: element (i, j) of op(M) is
//   p[i * ld + j] (trans false) or p[j * ld + i] (trans true).
struct Operand {
  const void* p;
  int64_t ld;
  bool trans;
};

// C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, C row-major with leading
// dimension ldc. A and B both of `type`: kFloat or kBFloat16 (C float; bf16 products
// accumulated in fp32), or kDouble (C double; always through ATen). beta 0 ignores what C
// held (NaN included). Runs on the calling thread's OpenMP team: all intra-op threads from
// the main thread, one inside a parallel region (as attention's per-item calls are).
void gemm(at::ScalarType type, int64_t m, int64_t n, int64_t k, double alpha, Operand a, Operand b, double beta,
          void* c, int64_t ldc);

// Best-of-4 FLOP/s of gemm() on n×n×n operands of `type` (kFloat or kBFloat16), on the
// calling thread's intra-op threads: the MFU reference next to ATen's own matmul peak.
double peak_flops(at::ScalarType type, int64_t n = 2048);

// The operand view of a 2-D tensor with one unit stride (row-major or a transposed view of
// a row-major matrix); false if it has neither.
bool as_operand(const at::Tensor& t, Operand& out);

// y = x Wᵀ for x [..., in], w [out, in] → [..., out], differentiable in x and w. fp32
// multiplies go through gemm(); bf16 (oneDNN's matmul primitive, bf16 out: faster in a
// training step, see on_gemm), other dtypes and the ATen backend run the calls at::linear's
// autograd would.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w);

// The backward of linear for an output gradient g [..., out]: {dx or undefined, dw or
// undefined}. Shared with activation checkpointing's reuse of kept outputs, so a matmul
// whose output was kept gets bit-for-bit the gradients of one that was recomputed.
std::pair<at::Tensor, at::Tensor> linear_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                                  bool need_x, bool need_w);

}  // namespace ctitan::gemm
