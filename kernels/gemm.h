// Matrix multiplies for the model's projections and attention tiles.
//
// ATen's matmul takes whole tensors: no leading dimensions, no alpha/beta accumulation. The
// GEMM libraries under LibTorch take both, so attention tiles are read in place (no strip
// copies), the softmax scale rides in alpha and dK/dV accumulate in fp32 with beta = 1 (no
// partial-product tensors, no bf16 rounding of the partial sums). Which library depends on
// the LibTorch: PyTorch 2.x's x86-64 wheels link MKL statically and export its sgemm_ and
// cblas_gemm_bf16bf16f32 (bf16 operands, fp32 result). oneDNN's dnnl_sgemm /
// dnnl_gemm_bf16bf16f32 come from PyPI's onednn-cpu-gomp, linked when CMake finds it in the venv
// (CTITAN_ONEDNN), or from a LibTorch built against a shared libdnnl (Debian's 1.13).
// bench/gemm_bench.py puts both libraries' entry points beside torch.mm on the 33M model's shapes.
//
// Backend, chosen once per process: with both libraries, MKL on an Intel CPU and oneDNN on any
// other (MKL takes slow paths off Intel; gemm.cpp's preferred_library has the numbers), except
// there the fp32 weight gradients of weights up to 2^19 elements, which run faster on MKL's
// (gemm.cpp's weight_grad); with
// one, that one; with neither, ATen (at::mm, what at::linear would run). CTITAN_GEMM=aten
// forces ATen (A/B measurements, and a way out should a library misbehave); CTITAN_GEMM=onednn
// or =mkl insists on that one (error if absent).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

namespace ctitan::gemm {

enum class Backend { OneDNN, MKL, ATen };
Backend backend();
const char* backend_name(Backend b);
// The backend's name and why it was chosen, for the start-up log.
std::string backend_choice();

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

// Best FLOP/s of gemm() on n×n×n operands of `type` (kFloat or kBFloat16), n up to max_n as
// best_product_rate picks it, on the calling thread's intra-op threads: the MFU reference next
// to ATen's own matmul peak.
double peak_flops(at::ScalarType type, int64_t max_n = 2048);

// The best FLOP/s of square products: product_of_size(n) prepares the operands of an n×n×n
// product and returns what runs it once. n is the smallest of 256, 512, ... max_n whose product
// takes >= 20 ms (a slow path, such as bfloat16 emulated on a CPU without native bf16
// matmuls, is not timed on 2048^3 products for a minute); the first run of each size is a
// warm-up; then the best of >= 3 runs and >= 0.2 s (one burst on a shared machine can land on a
// busy moment and make MFU read above 100%).
double best_product_rate(int64_t max_n, const std::function<std::function<void()>(int64_t n)>& product_of_size);

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
