#include "kernels/gemm.h"
#include "util/env.h"

#include <ATen/record_function.h>
#include <dlfcn.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ctitan::gemm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Row-major GEMM entry points (C[m, n] = alpha·op(A)·op(B) + beta·C, C fp32, bf16 operands
// as their 16 raw bits, products summed in fp32), bound to whichever library the loaded
// LibTorch exports. Looked up among the libraries already loaded, never dlopen'ed: a second
// copy could bring a second OpenMP runtime along.
using RowMajorSgemm = void (*)(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
using RowMajorBf16Gemm = void (*)(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a,
                                  int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c, int64_t ldc);

// oneDNN's C API (oneapi/dnnl/dnnl.h): row-major, dnnl_dim_t = int64_t, returns dnnl_status_t.
// Two ways it gets here: linked from PyPI's onednn-cpu-gomp (CTITAN_ONEDNN: CMake found its
// libdnnl.so.3 in the venv, scripts/install_deps.sh puts it there; it runs on the libgomp the
// process already has, the one LibTorch's wheel carries: same soname), or exported by a LibTorch
// built against a shared libdnnl (Debian's 1.13).
using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
using DnnlBf16 = int (*)(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*,
                         int64_t, float, float*, int64_t);
// MKL, which PyTorch's x86-64 wheels link statically and export: the Fortran BLAS sgemm_
// (column-major, 32-bit integers) and cblas_gemm_bf16bf16f32 (CBLAS enums, 32-bit MKL_INT).
using MklSgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                          const int*, const float*, const int*, const float*, float*, const int*);
using MklBf16 = void (*)(int layout, int ta, int tb, int m, int n, int k, float alpha, const uint16_t* a, int lda,
                         const uint16_t* b, int ldb, float beta, float* c, int ldc);
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

template <class F>
F lookup(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}

#ifdef CTITAN_ONEDNN
}  // namespace
}  // namespace ctitan::gemm
extern "C" int dnnl_sgemm(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                          float, float*, int64_t);
extern "C" int dnnl_gemm_bf16bf16f32(char, char, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t,
                                     const uint16_t*, int64_t, float, float*, int64_t);
namespace ctitan::gemm {
namespace {
DnnlSgemm dnnl_sgemm_entry() { return &::dnnl_sgemm; }
DnnlBf16 dnnl_bf16_entry() { return &::dnnl_gemm_bf16bf16f32; }
#else
DnnlSgemm dnnl_sgemm_entry() {
  static const auto f = lookup<DnnlSgemm>("dnnl_sgemm");
  return f;
}
DnnlBf16 dnnl_bf16_entry() {
  static const auto f = lookup<DnnlBf16>("dnnl_gemm_bf16bf16f32");
  return f;
}
#endif

struct Library {
  Backend backend = Backend::ATen;
  RowMajorSgemm sgemm = nullptr;
  RowMajorBf16Gemm bf16 = nullptr;
  const char* why = "neither oneDNN's nor MKL's GEMM found";
  // Set where the rule chose oneDNN with MKL beside it: the fp32 weight gradients of small
  // weights go to MKL's sgemm (weight_grad below).
  RowMajorSgemm small_weight_grad = nullptr;
  // Whether the fp32 forward of a weight with out <= in copies Wᵀ to pass oneDNN a plain B
  // (LinearFn::forward below).
  bool copy_narrow_weights = false;
};

// oneDNN's sgemm with AVX-512 reads a transposed B slower than a plain one when the output is
// narrow (a Zen 4, M = 2048: 167-169 vs 182-192 GFLOP/s for out <= in), so the forward copies
// Wᵀ there (one small copy: out·in, not M·anything). With AVX2 it is the other way round: on a
// Zen 3 (M = 2048, 2 threads, best of 7 × 10 calls, two interleaved rounds) the transposed B
// ran 148-163 GFLOP/s against 142-151 for the copy plus a plain B (512×512, 256×512,
// 512×1536 weights; each weight faster transposed), so it is read in place.
bool onednn_prefers_plain_b() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// oneDNN implements the bf16 GEMM only from AVX-512 on: elsewhere (an AVX2 CPU running bf16
// by request) it answers dnnl_unimplemented (3, C untouched); the caller then falls back.
std::atomic<bool> g_bf16_unimplemented{false};

void onednn_sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float al, const float* a, int64_t lda,
                  const float* b, int64_t ldb, float be, float* c, int64_t ldc) {
  const int rc = dnnl_sgemm_entry()(ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
  TORCH_CHECK(rc == 0, "[models] oneDNN sgemm ", m, "x", n, "x", k, " failed with dnnl status ", rc);
}
void onednn_bf16(char ta, char tb, int64_t m, int64_t n, int64_t k, float al, const uint16_t* a, int64_t lda,
                 const uint16_t* b, int64_t ldb, float be, float* c, int64_t ldc) {
  const int rc = dnnl_bf16_entry()(ta, tb, m, n, k, al, a, lda, b, ldb, be, c, ldc);
  if (rc == 3) {
    g_bf16_unimplemented = true;
    return;
  }
  TORCH_CHECK(rc == 0, "[models] oneDNN bf16 gemm ", m, "x", n, "x", k, " failed with dnnl status ", rc);
}

int i32(int64_t v) {
  TORCH_CHECK(v <= INT32_MAX, "[models] gemm: dimension ", v, " exceeds MKL's 32-bit integers");
  return static_cast<int>(v);
}
// Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the same buffers with A and B
// swapped, and m and n.
void mkl_sgemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float al, const float* a, int64_t lda, const float* b,
               int64_t ldb, float be, float* c, int64_t ldc) {
  static const auto f = lookup<MklSgemm>("sgemm_");
  const int M = i32(m), N = i32(n), K = i32(k), LDA = i32(lda), LDB = i32(ldb), LDC = i32(ldc);
  f(&tb, &ta, &N, &M, &K, &al, b, &LDB, a, &LDA, &be, c, &LDC);
}
void mkl_bf16(char ta, char tb, int64_t m, int64_t n, int64_t k, float al, const uint16_t* a, int64_t lda,
              const uint16_t* b, int64_t ldb, float be, float* c, int64_t ldc) {
  static const auto f = lookup<MklBf16>("cblas_gemm_bf16bf16f32");
  f(kCblasRowMajor, ta == 'T' ? kCblasTrans : kCblasNoTrans, tb == 'T' ? kCblasTrans : kCblasNoTrans, i32(m), i32(n),
    i32(k), al, a, i32(lda), b, i32(ldb), be, c, i32(ldc));
}

// With both libraries at hand and no CTITAN_GEMM: MKL on an Intel CPU, oneDNN on any other.
// MKL dispatches on the CPU's vendor and takes slower code paths off Intel: on a 2-core AMD
// EPYC (Zen 4) the LibTorch 1.13 build's projections on oneDNN's sgemm ran the 33M fp32 step at
// 90.9% of the measured peak, the 2.13 build's on MKL at 68.8% (issue 36). On an Intel Xeon
// (AMX) the two measured alike in alternating 33M fp32 runs, and oneDNN 3.2's bf16 GEMM ran
// attention's tiles 3-4x slower than MKL's (bench/kernel_bench with CTITAN_GEMM; gemm_bench.py
// has both per shape): MKL stays, the library PyTorch itself calls there. A rule, not a timing at start-up: the same
// machine always runs the same library, so repeated runs stay bitwise alike.
Backend preferred_library() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") ? Backend::MKL : Backend::OneDNN;
#else
  return Backend::OneDNN;
#endif
}

Library find_library(Backend want) {
  const bool dnnl = dnnl_sgemm_entry() != nullptr && dnnl_bf16_entry() != nullptr;
  const bool mkl = lookup<void*>("sgemm_") && lookup<void*>("cblas_gemm_bf16bf16f32");
  Library onednn{Backend::OneDNN, onednn_sgemm, onednn_bf16, "CTITAN_GEMM"};
  onednn.copy_narrow_weights = onednn_prefers_plain_b();
  Library intel_mkl{Backend::MKL, mkl_sgemm, mkl_bf16, "CTITAN_GEMM"};
  if (want == Backend::OneDNN) return dnnl ? onednn : Library{};
  if (want == Backend::MKL) return mkl ? intel_mkl : Library{};
  if (dnnl && mkl) {
    onednn.why =
        "not an Intel CPU: oneDNN's rather than MKL's, but MKL's for the weight gradients of weights of up to 2^19 "
        "elements; CTITAN_GEMM=mkl for MKL, =onednn for oneDNN alone";
    onednn.small_weight_grad = mkl_sgemm;
    intel_mkl.why = "an Intel CPU: MKL's rather than oneDNN's, CTITAN_GEMM=onednn for oneDNN";
    return preferred_library() == Backend::MKL ? intel_mkl : onednn;
  }
  onednn.why = intel_mkl.why = "the only GEMM library found";
  return dnnl ? onednn : mkl ? intel_mkl : Library{};
}

const Library& library() {
  static const Library lib = [] {
    const std::string& want = runtime_env().gemm;
    if (want == "aten") return Library{Backend::ATen, nullptr, nullptr, "CTITAN_GEMM"};
    const Backend w = want == "onednn" ? Backend::OneDNN : want == "mkl" ? Backend::MKL : Backend::ATen;
    if (!want.empty() && w == Backend::ATen)
      throw std::runtime_error("CTITAN_GEMM=" + want + " is not one of: aten, mkl, onednn");
    Library lib = find_library(w);
    if (w != Backend::ATen && lib.backend != w)
      throw std::runtime_error(
          "CTITAN_GEMM=" + want + ", but the loaded LibTorch does not export its GEMM (" +
          (w == Backend::MKL ? "sgemm_, cblas_gemm_bf16bf16f32" : "dnnl_sgemm, dnnl_gemm_bf16bf16f32") +
          "; unset CTITAN_GEMM to use the best one found)");
    return lib;
  }();
  return lib;
}

// fp32 projections only. bf16 ones stay on at::linear, i.e. oneDNN's matmul primitive for
// forward, dX and dW: it writes bf16 directly, and in a 33M bf16 step that beat the GEMM's
// fp32 dW plus a rounding pass (alternating 10-step runs: 1,755 vs 1,679 tok/s on average,
// 4 of 5 pairs; in isolation the GEMM's dW was 1-6% faster, bench/gemm_bench.py) — the
// forward and dX had already measured no faster through the GEMM.
bool on_gemm(const at::Tensor& x, const at::Tensor& w) {
  return backend() != Backend::ATen && x.device().is_cpu() && w.device().is_cpu() && w.dim() == 2 &&
         x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat;
}

// A 2-D tensor as a gemm operand, copied to row-major first if it has no unit stride.
Operand operand(const at::Tensor& t, at::Tensor& keep) {
  Operand o{};
  if (as_operand(t, o)) return o;
  keep = t.contiguous();
  as_operand(keep, o);
  return o;
}

// fp32 [rows, cols] result of op(A)·op(B) for 2-D tensors a [rows, k] and b [k, cols].
// `via`, for float32 operands only: that library's sgemm instead of gemm()'s choice.
at::Tensor mm_f32(const at::Tensor& a, const at::Tensor& b, RowMajorSgemm via = nullptr) {
  at::Tensor ka, kb;
  const Operand oa = operand(a, ka), ob = operand(b, kb);
  const int64_t m = a.size(0), n = b.size(1), k = a.size(1);
  auto c = at::empty({m, n}, a.options().dtype(at::kFloat));
  if (via != nullptr)
    via(oa.trans ? 'T' : 'N', ob.trans ? 'T' : 'N', m, n, k, 1.0f, static_cast<const float*>(oa.p), oa.ld,
        static_cast<const float*>(ob.p), ob.ld, 0.0f, c.data_ptr<float>(), n);
  else
    gemm(a.scalar_type(), m, n, k, 1.0, oa, ob, 0.0, c.data_ptr(), n);
  return c;
}

class LinearFn : public torch::autograd::Function<LinearFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    RECORD_FUNCTION("ctitan::linear", std::vector<c10::IValue>());
    ctx->save_for_backward({x, w});
    const int64_t in = w.size(1), out = w.size(0);
    const auto x2 = x.reshape({-1, in});
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out;
    // Wᵀ copied for oneDNN with AVX-512 only (onednn_prefers_plain_b). MKL's sgemm does not
    // want it: on the Intel Xeon (AMX) the copy plus a plain B took 2-15% longer than the
    // transposed B in 23 of 24 timings of the debug and 33M narrow shapes (M 2048, 4096).
    // _unsafe_view, as ATen's matmul: the output is a fresh tensor, not a view autograd would
    // forbid to modify in place (a view made inside a custom function).
    if (out <= in && library().copy_narrow_weights) return at::_unsafe_view(mm_f32(x2, w.t().contiguous()), shape);
    return at::_unsafe_view(mm_f32(x2, w.t()), shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dw] = linear_backward(grads[0], saved[0], saved[1], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
    return {dx, dw};
  }
};

// dW = dYᵀ X, [out, in] for g [N, out] and x2 [N, in]. Where the rule chose oneDNN and MKL is
// there too, a weight of up to 2^19 elements takes MKL's sgemm: oneDNN's runs this transposed-A
// product slowly when the result is small. On an AMD EPYC (Zen 3), 2 threads, GFLOP/s, oneDNN
// against MKL: the debug model's weights at N = 4096 (256×256, 128×256, 768×256, 256×768,
// 2048×256) 60-112 against 75-138, MKL ahead in each; the 33M model's at N = 2048 (512×512,
// 256×512) 72-83 against 112-120; larger ones (1536×512, 512×1536, 8192×512) 128-140 against
// 107-127, oneDNN ahead (docs/performance.md).
at::Tensor weight_grad(const at::Tensor& g, const at::Tensor& x2) {
  const Library& lib = library();
  const bool small = g.size(1) * x2.size(1) <= (int64_t{1} << 19);
  return mm_f32(g.t(), x2, small ? lib.small_weight_grad : nullptr);
}

}  // namespace

Backend backend() { return library().backend; }

std::string backend_choice() { return std::string(backend_name(backend())) + " (" + library().why + ")"; }

const char* backend_name(Backend b) {
  return b == Backend::OneDNN ? "oneDNN GEMM" : b == Backend::MKL ? "MKL GEMM" : "ATen matmul";
}

bool as_operand(const at::Tensor& t, Operand& out) {
  if (t.dim() != 2) return false;
  const int64_t r = t.size(0), c = t.size(1);
  if (t.stride(1) == 1 || c <= 1) {
    const int64_t ld = r <= 1 ? std::max<int64_t>(c, 1) : t.stride(0);
    if (ld < std::max<int64_t>(c, 1)) return false;
    out = Operand{t.data_ptr(), ld, false};
    return true;
  }
  if (t.stride(0) == 1 || r <= 1) {
    const int64_t ld = c <= 1 ? std::max<int64_t>(r, 1) : t.stride(1);
    if (ld < std::max<int64_t>(r, 1)) return false;
    out = Operand{t.data_ptr(), ld, true};
    return true;
  }
  return false;
}

void gemm(at::ScalarType type, int64_t m, int64_t n, int64_t k, double alpha, Operand a, Operand b, double beta,
          void* c, int64_t ldc) {
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kDouble,
              "[models] gemm: operands must be float32, bfloat16 or float64, got ", type);
  if (m == 0 || n == 0) return;
  const auto ctype = type == at::kDouble ? at::kDouble : at::kFloat;
  const auto cview = at::from_blob(c, {m, n}, {ldc, 1}, at::TensorOptions().dtype(ctype));
  if (k == 0) {  // op(A)·op(B) is all zeros: C = beta · C
    beta == 0.0 ? cview.zero_() : cview.mul_(beta);
    return;
  }
  const Library& lib = library();
  if (lib.backend != Backend::ATen && type != at::kDouble && !(type == at::kBFloat16 && g_bf16_unimplemented)) {
    const char ta = a.trans ? 'T' : 'N', tb = b.trans ? 'T' : 'N';
    float* cf = static_cast<float*>(c);
    const auto al = static_cast<float>(alpha), be = static_cast<float>(beta);
    if (type == at::kFloat) {
      lib.sgemm(ta, tb, m, n, k, al, static_cast<const float*>(a.p), a.ld, static_cast<const float*>(b.p), b.ld, be, cf,
                ldc);
      return;
    }
    lib.bf16(ta, tb, m, n, k, al, static_cast<const uint16_t*>(a.p), a.ld, static_cast<const uint16_t*>(b.p), b.ld, be,
             cf, ldc);
    if (!g_bf16_unimplemented) return;
  }
  // ATen: the same product through at::mm on views of the operands. bf16 operands are
  // widened first, so the products are summed in fp32 as oneDNN and MKL do (ATen's own bf16 mm of
  // small or strided operands can take a path that rounds far more).
  const auto opts = at::TensorOptions().dtype(type);
  auto view = [&](const Operand& o, int64_t rows, int64_t cols) {
    const auto t = o.trans ? at::from_blob(const_cast<void*>(o.p), {rows, cols}, {1, o.ld}, opts)
                           : at::from_blob(const_cast<void*>(o.p), {rows, cols}, {o.ld, 1}, opts);
    return t.to(ctype);
  };
  torch::NoGradGuard no_grad;
  const auto prod = at::mm(view(a, m, k), view(b, k, n));
  if (beta == 0.0) {
    cview.copy_(prod);
    if (alpha != 1.0) cview.mul_(alpha);
  } else {
    cview.mul_(beta).add_(prod, alpha);
  }
}

double best_product_rate(int64_t max_n, const std::function<std::function<void()>(int64_t n)>& product_of_size) {
  int64_t n = std::min<int64_t>(256, max_n);
  std::function<void()> run = product_of_size(n);
  const auto time_one = [&run] {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  run();  // warm-up: JIT, thread pool, first touch
  double s = time_one();
  while (s < 0.02 && n * 2 <= max_n) {
    n *= 2;
    run = product_of_size(n);
    run();
    s = time_one();
  }
  const double flop = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  double best = flop / s, spent = s;
  for (int rep = 1; rep < 3 || (spent < 0.2 && rep < 200); ++rep) {
    s = time_one();
    spent += s;
    best = std::max(best, flop / s);
  }
  return best;
}

double peak_flops(at::ScalarType type, int64_t max_n) {
  return best_product_rate(max_n, [type](int64_t n) -> std::function<void()> {
    // Constant operands: the speed does not depend on the values, and no random generator
    // that training uses is drawn from.
    const auto a = torch::full({n, n}, 0.5).to(type), b = torch::full({n, n}, 0.5).to(type);
    auto c = torch::empty({n, n});
    return [a, b, c, n, type] {
      gemm(type, n, n, n, 1.0, {a.data_ptr(), n, false}, {b.data_ptr(), n, false}, 0.0, c.data_ptr(), n);
    };
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  if (!on_gemm(x, w) || x.numel() == 0) return at::linear(x, w);
  return LinearFn::apply(x, w);
}

std::pair<at::Tensor, at::Tensor> linear_backward(const at::Tensor& g_in, const at::Tensor& x, const at::Tensor& w,
                                                  bool need_x, bool need_w) {
  RECORD_FUNCTION("ctitan::linear_backward", std::vector<c10::IValue>());
  const int64_t in = w.size(1), out = w.size(0);
  const at::Tensor g = g_in.reshape({-1, out});  // [N, out]
  const at::Tensor x2 = x.reshape({-1, in});     // [N, in], as matmul folds x
  at::Tensor gx, gw;
  if (!on_gemm(x, w) || x.numel() == 0) {
    // The calls autograd derives for linear → matmul → mm, in the same layouts (so the same
    // bits as a matmul it differentiated itself).
    const at::Tensor wt = w.t();  // [in, out], matmul's mat2
    if (need_x) {
      // mm's mat1 gradient: column-major mat1 gets a column-major gradient.
      gx = (x2.stride(0) == 1 && x2.stride(1) == x2.size(0)) ? wt.mm(g.t()).t() : g.mm(wt.t());
      gx = gx.reshape(x.sizes());
    }
    if (need_w)  // mm's mat2 gradient, then transposed back to W's shape.
      gw = (wt.stride(0) == 1 && wt.stride(1) == wt.size(0)) ? g.t().mm(x2) : x2.t().mm(g).t();
    return {gx, gw};
  }
  if (need_x) gx = mm_f32(g, w).view(x.sizes());  // dX = dY W
  if (need_w) gw = weight_grad(g, x2);            // dW = dYᵀ X
  return {gx, gw};
}

}  // namespace ctitan::gemm
