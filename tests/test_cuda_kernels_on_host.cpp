// ctitan's own CUDA kernels (kernels/fused_kernels_cuda.cu), their source compiled for the host
// and run on the CPU under tests/cuda_host/cuda_runtime.h's model of CUDA's threads: every block
// and thread of each launch, with __syncthreads and warp shuffles as barriers. What this checks
// before a GPU is lent: the launchers' choice of path (16-byte packs, the one-value tails,
// misaligned operands, 256 or 512 threads a row), the kernels' indexing (each output element
// written, nothing read or written past an operand: every operand ends at an inaccessible page),
// the grid-stride loops, the block reductions' barriers, and the arithmetic's formulas against
// float64 references and ATen (AdamW: against the CPU update's float32 operations bit for bit,
// and a float64 evaluation). What it cannot check: the GPU's own float arithmetic (expf is
// glibc's here) and speed; bench/gpu_kernel_check (scripts/gpu_check.sh part (g)) does that on a
// GPU, with the same references (tests/fused_cuda_reference.h).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/fused_cuda.h"
#include "tests/fused_cuda_reference.h"
// Last: its macros (__global__, __shared__, ...) are for the test kernels below.
#include "tests/cuda_host/cuda_runtime.h"

namespace {

using at::Tensor;
using namespace ctitan::kernel_reference;
namespace gpu = ctitan::gpu;

constexpr unsigned char kCanary = 0xA5;

// `bytes` of memory starting `offset` bytes past a 16-byte boundary and ending within 16 bytes
// of a page that may not be touched (a read or write past the end faults); the bytes around
// the operand in its mapping hold a canary, which intact() checks.
class Guarded {
 public:
  Guarded(size_t bytes, size_t offset) : bytes_(bytes) {
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t slack = (16 - (bytes + offset) % 16) % 16;  // guard − slack − bytes ≡ offset (mod 16)
    body_ = (64 + bytes + slack + page - 1) / page * page;
    map_size_ = body_ + page;
    void* m = mmap(nullptr, map_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap failed");
    base_ = static_cast<unsigned char*>(m);
    if (mprotect(base_ + body_, page, PROT_NONE) != 0) throw std::runtime_error("mprotect failed");
    std::memset(base_, kCanary, body_);
    data_ = base_ + body_ - slack - bytes;
  }
  ~Guarded() { munmap(base_, map_size_); }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  void* data() const { return data_; }
  bool intact() const {
    for (const unsigned char* p = base_; p < data_; ++p)
      if (*p != kCanary) return false;
    for (const unsigned char* p = data_ + bytes_; p < base_ + body_; ++p)
      if (*p != kCanary) return false;
    return true;
  }

 private:
  size_t bytes_, body_ = 0, map_size_ = 0;
  unsigned char* base_ = nullptr;
  unsigned char* data_ = nullptr;
};

// The operands of one check, each in its own Guarded memory.
class Arena {
 public:
  // A copy of src (contiguous), misaligned: starting one element past a 16-byte boundary.
  Tensor copy_of(const Tensor& src, bool misaligned = false) {
    auto t = place(src.sizes(), src.scalar_type(), misaligned);
    t.copy_(src);
    return t;
  }
  // An output, every byte 0xFF first (NaN in float32 and bf16): an element the kernel does not
  // write stays NaN and fails the comparison.
  Tensor output(at::IntArrayRef shape, at::ScalarType t, bool misaligned = false) {
    auto out = place(shape, t, misaligned);
    std::memset(out.data_ptr(), 0xFF, out.nbytes());
    return out;
  }
  bool intact() const {
    for (const auto& m : memory_)
      if (!m->intact()) return false;
    return true;
  }

 private:
  Tensor place(at::IntArrayRef shape, at::ScalarType t, bool misaligned) {
    const size_t elem = c10::elementSize(t);
    const size_t bytes = static_cast<size_t>(c10::multiply_integers(shape)) * elem;
    memory_.push_back(std::make_unique<Guarded>(bytes, misaligned ? elem : 0));
    return at::from_blob(memory_.back()->data(), shape, at::TensorOptions().dtype(t));
  }
  std::vector<std::unique_ptr<Guarded>> memory_;
};

gpu::Elem elem_of(at::ScalarType t) { return t == at::kBFloat16 ? gpu::Elem::BFloat16 : gpu::Elem::Float32; }

Tensor random_values(at::IntArrayRef shape, at::ScalarType t, double scale) {
  return (at::randn(shape, at::kFloat) * scale).to(t);
}

bool is_aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// ---- SwiGLU -----------------------------------------------------------------------------
// Against the float64 formulas (swiglu_ref64). Not against ATen's CPU composition in float32:
// its silu takes x · sigmoid(x) with a vectorised exp, where the kernel (as ATen's CUDA silu)
// takes x / (1 + exp(−x)) with expf, so the two differ by a few ulps, and by far more in da
// where 1 + a · (1 − σ(a)) cancels. (On a GPU, gpu_kernel_check compares with ATen's CUDA ops,
// whose formulas are the kernel's: there within one ulp.)
void check_swiglu(int64_t n, at::ScalarType t, bool misaligned) {
  SCOPED_TRACE("swiglu n " + std::to_string(n) + (t == at::kBFloat16 ? " bf16" : " fp32") +
               (misaligned ? " misaligned" : ""));
  Arena arena;
  const auto a = arena.copy_of(random_values({n}, t, 3.0), misaligned);
  const auto b = arena.copy_of(random_values({n}, t, 1.0), misaligned);
  const auto dy = arena.copy_of(random_values({n}, t, 1.0), misaligned);
  auto y = arena.output({n}, t, misaligned), da = arena.output({n}, t, misaligned),
       db = arena.output({n}, t, misaligned);
  ASSERT_EQ(is_aligned16(a), !misaligned);
  ASSERT_EQ(gpu::swiglu_forward(elem_of(t), a.data_ptr(), b.data_ptr(), y.data_ptr(), n, nullptr), 0);
  ASSERT_EQ(gpu::swiglu_backward(elem_of(t), a.data_ptr(), b.data_ptr(), dy.data_ptr(), da.data_ptr(), db.data_ptr(), n,
                                 nullptr),
            0);
  const auto ref = swiglu_ref64(a, b, dy);
  const double bound = swiglu_bound(t);
  EXPECT_LE(max_scaled_error(y, ref.y, ref.y.abs()), bound);
  EXPECT_LE(max_scaled_error(db, ref.db, ref.db.abs()), bound);
  EXPECT_LE(max_scaled_error(da, ref.da, ref.da_scale), bound);
  EXPECT_TRUE(arena.intact()) << "a kernel wrote outside its operands";
}

TEST(CudaKernelsOnHost, SwigluMatchesTheFormulasOnEveryPath) {
  torch::manual_seed(1);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    for (const int64_t n : {1, 3, 8, 37 * 91, 64 * 1024 + 5}) check_swiglu(n, t, false);  // packs and a tail
    check_swiglu(64 * 16, t, true);                                                       // one value a thread
  }
}

// More packs than the launch's 8192 × 256 threads: each thread's grid-stride loop takes a second
// pack (16-byte path) or a second value (the misaligned path).
TEST(CudaKernelsOnHost, SwigluGridStrideLoops) {
  torch::manual_seed(2);
  const int64_t threads = int64_t{8192} * 256;
  check_swiglu(threads * 4 + 4 * 1000 + 3, at::kFloat, false);  // 4-float packs, then a 3-value tail
  check_swiglu(threads + 777, at::kFloat, true);
}

// ---- RoPE -------------------------------------------------------------------------------
void check_rope(int64_t B, int64_t T, int64_t h, int64_t hd, at::ScalarType t, bool misaligned, bool conjugate) {
  SCOPED_TRACE("rope [" + std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(h) + ", " +
               std::to_string(hd) + "]" + (t == at::kBFloat16 ? " bf16" : " fp32") + (misaligned ? " misaligned" : "") +
               (conjugate ? " conjugate" : ""));
  Arena arena;
  const auto x = arena.copy_of(random_values({B, T, h, hd}, t, 2.0), misaligned);
  const auto table = rope_table(T, hd, 3, at::kCPU);
  const auto freqs = arena.copy_of(table.narrow(0, 0, T).contiguous());  // the T rows the route passes
  auto y = arena.output({B, T, h, hd}, t, misaligned);
  ASSERT_EQ(gpu::rope(elem_of(t), conjugate, x.data_ptr(), freqs.data_ptr<float>(), y.data_ptr(), B * T * h, hd, h, T,
                      nullptr),
            0);
  EXPECT_LE(max_pair_error(y, rope_ref64(x, table, conjugate), x), rope_bound(t));
  EXPECT_TRUE(arena.intact()) << "a kernel wrote outside its operands";
}

TEST(CudaKernelsOnHost, RopeMatchesTheRotationOnEveryPath) {
  torch::manual_seed(3);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    for (const bool conj : {false, true}) {
      check_rope(2, 5, 3, 6, t, false, conj);    // hd 6: a pair a thread in both dtypes
      check_rope(1, 7, 2, 2, t, false, conj);    // hd 2
      check_rope(2, 16, 4, 16, t, true, conj);   // misaligned: a pair a thread
      check_rope(2, 16, 4, 16, t, false, conj);  // 16-byte packs
      check_rope(2, 33, 4, 64, t, false, conj);  // positions wrap per batch row
      check_rope(1, 3, 2, 4, t, false, conj);    // hd 4: packs in float32, pairs in bf16
    }
  }
}

TEST(CudaKernelsOnHost, RopeRefusesWhatItCannotRotate) {
  Arena arena;
  const auto x = arena.copy_of(at::ones({1, 2, 1, 6}));
  const auto freqs = arena.copy_of(at::ones({2 * 3 * 2 + 1}));
  auto y = arena.output({1, 2, 1, 6}, at::kFloat);
  float* f = freqs.data_ptr<float>();
  // An odd head size, no heads or positions, a table not 8-byte aligned (read as float2).
  EXPECT_EQ(gpu::rope(gpu::Elem::Float32, false, x.data_ptr(), f, y.data_ptr(), 2, 5, 1, 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::rope(gpu::Elem::Float32, false, x.data_ptr(), f, y.data_ptr(), 2, 6, 0, 2, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::rope(gpu::Elem::Float32, false, x.data_ptr(), f, y.data_ptr(), 2, 6, 1, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(gpu::rope(gpu::Elem::Float32, false, x.data_ptr(), f + 1, y.data_ptr(), 2, 6, 1, 2, nullptr),
            cudaErrorInvalidValue);
  // Nothing to do: no launch, nothing written.
  EXPECT_EQ(gpu::rope(gpu::Elem::Float32, false, x.data_ptr(), f, y.data_ptr(), 0, 6, 1, 2, nullptr), 0);
  EXPECT_TRUE(at::isnan(y).all().item<bool>());
  EXPECT_TRUE(arena.intact());
}

// ---- Cross-entropy ----------------------------------------------------------------------
void check_cross_entropy(int64_t rows, int64_t V, at::ScalarType t, bool misaligned) {
  SCOPED_TRACE("cross-entropy [" + std::to_string(rows) + ", " + std::to_string(V) + "]" +
               (t == at::kBFloat16 ? " bf16" : " fp32") + (misaligned ? " misaligned" : ""));
  auto values = random_values({rows, V}, t, 4.0);
  auto label_values = at::randint(V, {rows}, at::kLong);
  label_values[0] = 0;
  if (rows > 1) label_values[1] = V - 1;
  if (rows > 2 && V > 8) values[2][label_values[2].item<int64_t>() == 5 ? 6 : 5] = -INFINITY;
  Arena arena;
  const auto x = arena.copy_of(values, misaligned);
  const auto labels = arena.copy_of(label_values);
  const double coef = 0.75 / static_cast<double>(rows);
  const auto c = arena.copy_of(at::full({1}, coef, at::kFloat));
  auto lse = arena.output({rows}, at::kFloat), row_loss = arena.output({rows}, at::kFloat);
  auto dx = arena.output({rows, V}, t, misaligned);
  ASSERT_EQ(gpu::cross_entropy_forward(elem_of(t), x.data_ptr(), labels.data_ptr<int64_t>(), rows, V,
                                       lse.data_ptr<float>(), row_loss.data_ptr<float>(), nullptr),
            0);
  ASSERT_EQ(gpu::cross_entropy_backward(elem_of(t), x.data_ptr(), labels.data_ptr<int64_t>(), lse.data_ptr<float>(),
                                        c.data_ptr<float>(), rows, V, dx.data_ptr(), nullptr),
            0);
  // Each row's lse and loss within 1e-5 of the larger of 1 and |lse| (a loss near 0 is a
  // difference of two values of that size), their sum within 1e-5 of the larger of 1 and the
  // reference's, the gradient as on the GPU.
  double lse_err = 0, loss_err = 0, grad_err = 0;
  const double loss_ref = cross_entropy_ref64(
      x, labels, static_cast<float>(coef),
      [&](int64_t r, int64_t n, const Tensor& l, const Tensor& rl, const Tensor& d) {
        const auto scale = l.abs().clamp_min(1.0).squeeze(1);
        lse_err = std::max(lse_err,
                           ((lse.narrow(0, r, n).to(at::kDouble) - l.squeeze(1)).abs() / scale).max().item<double>());
        loss_err = std::max(
            loss_err, ((row_loss.narrow(0, r, n).to(at::kDouble) - rl.squeeze(1)).abs() / scale).max().item<double>());
        grad_err = std::max(grad_err, max_rel(dx.narrow(0, r, n), d));
      });
  EXPECT_LE(lse_err, 1e-5);
  EXPECT_LE(loss_err, 1e-5);
  EXPECT_LE(std::abs(row_loss.to(at::kDouble).sum().item<double>() - loss_ref) / std::max(1.0, std::abs(loss_ref)),
            1e-5);
  EXPECT_LE(grad_err, cross_entropy_grad_bound(t));
  EXPECT_TRUE(arena.intact()) << "a kernel wrote outside its operands";
}

TEST(CudaKernelsOnHost, CrossEntropyMatchesTheReferenceOnEveryPath) {
  torch::manual_seed(4);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    check_cross_entropy(37, 2051, t, false);  // V not a multiple of a pack: one value a thread, 256 threads
    check_cross_entropy(6, 2048, t, false);   // 16-byte packs, 256 threads
    check_cross_entropy(6, 2048, t, true);    // misaligned: one value a thread
    check_cross_entropy(3, 16384, t, false);  // 16-byte packs, 512 threads
    check_cross_entropy(3, 16385, t, false);  // one value a thread, 512 threads
    check_cross_entropy(4, 7, t, false);      // fewer values than threads
    check_cross_entropy(2, 1, t, false);      // one class: loss 0, gradient 0
  }
}

// A label outside [0, V) gives that row a NaN loss (no host check, which would synchronise on a
// GPU) and a gradient without the one-hot term; the other rows are unaffected.
TEST(CudaKernelsOnHost, CrossEntropyLabelsOutsideTheVocabulary) {
  torch::manual_seed(5);
  const int64_t rows = 3, V = 64;
  Arena arena;
  const auto x = arena.copy_of(random_values({rows, V}, at::kFloat, 2.0));
  const auto labels = arena.copy_of(at::tensor({int64_t{-1}, V, int64_t{7}}));
  const auto c = arena.copy_of(at::full({1}, 1.0, at::kFloat));
  auto lse = arena.output({rows}, at::kFloat), row_loss = arena.output({rows}, at::kFloat);
  auto dx = arena.output({rows, V}, at::kFloat);
  ASSERT_EQ(gpu::cross_entropy_forward(gpu::Elem::Float32, x.data_ptr(), labels.data_ptr<int64_t>(), rows, V,
                                       lse.data_ptr<float>(), row_loss.data_ptr<float>(), nullptr),
            0);
  ASSERT_EQ(gpu::cross_entropy_backward(gpu::Elem::Float32, x.data_ptr(), labels.data_ptr<int64_t>(),
                                        lse.data_ptr<float>(), c.data_ptr<float>(), rows, V, dx.data_ptr(), nullptr),
            0);
  const auto xd = x.to(at::kDouble);
  const auto lse_ref = at::logsumexp(xd, {1});
  EXPECT_LE(max_rel(lse, lse_ref), 1e-6);
  EXPECT_TRUE(std::isnan(row_loss[0].item<float>()));
  EXPECT_TRUE(std::isnan(row_loss[1].item<float>()));
  EXPECT_NEAR(row_loss[2].item<double>(), (lse_ref[2] - xd[2][7]).item<double>(), 1e-5);
  auto grad_ref = at::softmax(xd, 1);
  grad_ref[2][7] -= 1.0;
  EXPECT_LE(max_rel(dx, grad_ref), 1e-5);
  EXPECT_TRUE(arena.intact());
}

TEST(CudaKernelsOnHost, CrossEntropyWithNothingToDoLaunchesNothing) {
  Arena arena;
  const auto labels = arena.copy_of(at::zeros({1}, at::kLong));
  auto lse = arena.output({1}, at::kFloat), row_loss = arena.output({1}, at::kFloat);
  const auto x = arena.copy_of(at::zeros({1}, at::kFloat));
  EXPECT_EQ(gpu::cross_entropy_forward(gpu::Elem::Float32, x.data_ptr(), labels.data_ptr<int64_t>(), 0, 5,
                                       lse.data_ptr<float>(), row_loss.data_ptr<float>(), nullptr),
            0);
  EXPECT_EQ(gpu::cross_entropy_forward(gpu::Elem::Float32, x.data_ptr(), labels.data_ptr<int64_t>(), 1, 0,
                                       lse.data_ptr<float>(), row_loss.data_ptr<float>(), nullptr),
            0);
  EXPECT_TRUE(at::isnan(lse).all().item<bool>());
  EXPECT_TRUE(arena.intact());
}

// ---- The torch side: kernels/fused_ops_cuda.cpp's autograd functions on CPU tensors ------
// The functions the GPU route calls (swiglu_cuda, rotary_emb_cuda, cross_entropy_cuda), with
// what the kernels' launchers do not see: operands that are not contiguous, RoPE's table with
// more rows than positions, labels not int64, the loss's sum and scale, the upstream gradient.
TEST(CudaKernelsOnHost, AutogradFunctionsMatchTheReferences) {
  torch::manual_seed(6);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(t == at::kBFloat16 ? "bf16" : "fp32");
    {  // SwiGLU over transposed (non-contiguous) operands
      const auto a = random_values({40, 24}, t, 3.0).t().requires_grad_(true);
      const auto b = random_values({40, 24}, t, 1.0).t().requires_grad_(true);
      const auto gy = random_values({24, 40}, t, 1.0);
      ASSERT_FALSE(a.is_contiguous());
      const auto y = ctitan::swiglu_cuda(a, b);
      const auto g = torch::autograd::grad({y}, {a, b}, {gy});
      const auto ref = swiglu_ref64(a.detach(), b.detach(), gy);
      EXPECT_LE(max_scaled_error(y, ref.y, ref.y.abs()), swiglu_bound(t));
      EXPECT_LE(max_scaled_error(g[0], ref.da, ref.da_scale), swiglu_bound(t));
      EXPECT_LE(max_scaled_error(g[1], ref.db, ref.db.abs()), swiglu_bound(t));
    }
    {  // RoPE over [B, T, h, hd] transposed from [B, h, T, hd], a table 5 rows longer than T
      const auto x = random_values({2, 3, 9, 16}, t, 2.0).transpose(1, 2).requires_grad_(true);
      const auto gy = random_values({2, 9, 3, 16}, t, 2.0);
      const auto table = rope_table(9, 16, 5, at::kCPU);
      const auto y = ctitan::rotary_emb_cuda(x, table);
      const auto dx = torch::autograd::grad({y}, {x}, {gy})[0];
      EXPECT_LE(max_pair_error(y, rope_ref64(x.detach(), table, false), x.detach()), rope_bound(t));
      EXPECT_LE(max_pair_error(dx, rope_ref64(gy, table, true), gy), rope_bound(t));
      EXPECT_EQ(dx.scalar_type(), t);
    }
    {  // The loss: int32 labels, scale 1/rows, an upstream gradient of 0.75
      const int64_t rows = 37, V = 300;
      const auto x = random_values({rows, V}, t, 4.0).requires_grad_(true);
      const auto labels = at::randint(V, {rows}, at::kInt);
      const double scale = 1.0 / rows;
      const auto loss = ctitan::cross_entropy_cuda(x, labels, scale);
      const auto dx = torch::autograd::grad({loss}, {x}, {at::full({}, 0.75, at::kFloat)})[0];
      double grad_err = 0;
      const double loss_ref =
          cross_entropy_ref64(x.detach(), labels.to(at::kLong), 0.75 * scale,
                              [&](int64_t r, int64_t n, const Tensor&, const Tensor&, const Tensor& d) {
                                grad_err = std::max(grad_err, max_rel(dx.narrow(0, r, n), d));
                              }) *
          scale;
      EXPECT_EQ(loss.scalar_type(), at::kFloat);
      EXPECT_LE(std::abs(loss.item<double>() - loss_ref) / std::abs(loss_ref), 1e-5);
      EXPECT_LE(grad_err, cross_entropy_grad_bound(t));
    }
  }
  // What the kernels do not take: one line naming the dtype.
  try {
    ctitan::swiglu_cuda(at::ones({4}, at::kDouble), at::ones({4}, at::kDouble));
    ADD_FAILURE() << "a float64 operand was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("take float32 or bfloat16 tensors"), std::string::npos) << e.what();
  }
}

// ---- AdamW ------------------------------------------------------------------------------
// adamw_cuda on CPU tensors in guarded memory, against the CPU update written out in float32
// (adamw_float32: expected bit for bit, the kernel's operations being the same ones, each
// rounded to nearest, and the bias corrections from glibc's pow here as there) and against the
// float64 evaluation within AdamWBounds. The hyperparameters: ctitan's defaults (OptimizerSpec)
// with a larger learning rate, so every update moves a parameter by far more than the bounds.
constexpr double kLr = 3e-3, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWd = 0.1;

struct AdamWSpec {
  int64_t n;
  at::ScalarType grad;
  bool copy;
  double step;
  bool misaligned = false;
};

struct AdamWState {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, copies, steps;
};

// Parameters ~ N(0, 1); gradients ~ N(0, 10^-4) in their dtype; exp_avg ~ N(0, 10^-4) (so β1·m
// and (1 − β1)·g are of a size and sometimes cancel); exp_avg_sq the square of N(0, 10^-4)
// values (√v from 0 to a few 10^-2: eps counts where it is small); the copies undefined.
AdamWState random_adamw(const std::vector<AdamWSpec>& specs) {
  AdamWState s;
  for (const auto& sp : specs) {
    s.params.push_back(random_values({sp.n}, at::kFloat, 1.0));
    s.grads.push_back(random_values({sp.n}, sp.grad, 1e-2));
    s.exp_avgs.push_back(random_values({sp.n}, at::kFloat, 1e-2));
    s.exp_avg_sqs.push_back(random_values({sp.n}, at::kFloat, 1e-2).square());
    s.copies.emplace_back();
    s.steps.push_back(at::full({}, sp.step, at::kFloat));
  }
  return s;
}

// A copy of s in guarded memory, each operand misaligned where its spec says, with a copy
// (NaN until written) for each spec that asks for one.
AdamWState guarded(Arena& arena, const AdamWState& s, const std::vector<AdamWSpec>& specs) {
  AdamWState g;
  for (size_t i = 0; i < specs.size(); ++i) {
    const bool mis = specs[i].misaligned;
    g.params.push_back(arena.copy_of(s.params[i], mis));
    g.grads.push_back(arena.copy_of(s.grads[i], mis));
    g.exp_avgs.push_back(arena.copy_of(s.exp_avgs[i], mis));
    g.exp_avg_sqs.push_back(arena.copy_of(s.exp_avg_sqs[i], mis));
    g.copies.push_back(specs[i].copy ? arena.output({specs[i].n}, at::kBFloat16, mis) : Tensor());
    g.steps.push_back(arena.copy_of(s.steps[i]));
  }
  return g;
}

void run_adamw(const AdamWState& s, bool with_copies, const std::optional<Tensor>& grad_scale = std::nullopt,
               const std::optional<Tensor>& found_inf = std::nullopt) {
  ctitan::adamw_cuda(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, with_copies ? s.copies : std::vector<Tensor>{},
                     s.steps, kLr, kBeta1, kBeta2, kEps, kWd, grad_scale, found_inf);
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return a.numel() == 0 ? 0.0 : (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// `after` is `before` updated once at rate lr (gradients divided by grad_scale; 0: none): bitwise the float32
// evaluation, within the bounds of the float64 one, each defined copy of `after` bf16(param)
// exactly, the gradients and step counts untouched.
void expect_updated(const AdamWState& before, const AdamWState& after, float grad_scale, double lr = kLr) {
  const AdamWBounds bound;
  for (size_t i = 0; i < before.params.size(); ++i) {
    const int64_t n = before.params[i].numel();
    SCOPED_TRACE("tensor " + std::to_string(i) + " of " + std::to_string(before.params.size()) + ", " +
                 std::to_string(n) + " elements, " +
                 (before.grads[i].scalar_type() == at::kBFloat16 ? "bf16" : "fp32") + " gradient, step " +
                 std::to_string(before.steps[i].item<double>()));
    const auto k = adamw_coefficients(lr, kBeta1, kBeta2, kEps, kWd, before.steps[i].item<double>());
    auto p = before.params[i].clone(), m = before.exp_avgs[i].clone(), v = before.exp_avg_sqs[i].clone();
    const auto copy = adamw_float32(p, before.grads[i], m, v, k, grad_scale);
    EXPECT_TRUE(at::equal(after.params[i], p)) << "param: max |kernel − float32| " << max_abs_diff(after.params[i], p);
    EXPECT_TRUE(at::equal(after.exp_avgs[i], m))
        << "exp_avg: max |kernel − float32| " << max_abs_diff(after.exp_avgs[i], m);
    EXPECT_TRUE(at::equal(after.exp_avg_sqs[i], v))
        << "exp_avg_sq: max |kernel − float32| " << max_abs_diff(after.exp_avg_sqs[i], v);
    if (after.copies[i].defined()) {
      EXPECT_TRUE(at::equal(after.copies[i], copy)) << "the bf16 copy is not bf16(param)";
      EXPECT_TRUE(at::equal(after.copies[i], after.params[i].to(at::kBFloat16)));
    }
    EXPECT_TRUE(at::equal(after.grads[i], before.grads[i])) << "the gradient changed";
    EXPECT_TRUE(at::equal(after.steps[i], before.steps[i])) << "the step count changed";
    if (n == 0) continue;
    const auto ref =
        adamw_ref64(before.params[i], before.grads[i], before.exp_avgs[i], before.exp_avg_sqs[i], k, grad_scale);
    EXPECT_LE(max_scaled_error(after.params[i], ref.param, ref.param_scale), bound.param);
    EXPECT_LE(max_scaled_error(after.exp_avgs[i], ref.exp_avg, ref.exp_avg_scale), bound.exp_avg);
    EXPECT_LE(max_scaled_error(after.exp_avg_sqs[i], ref.exp_avg_sq, ref.exp_avg_sq_scale), bound.exp_avg_sq);
  }
}

// Bitwise the same tensors (NaN bits included: a copy never written stays the same NaN).
bool same_bits(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  const auto as_ints = [](const Tensor& t) { return t.view(t.element_size() == 2 ? at::kShort : at::kInt); };
  return at::equal(as_ints(a), as_ints(b));
}

bool same_state(const AdamWState& a, const AdamWState& b) {
  for (size_t i = 0; i < a.params.size(); ++i)
    if (!same_bits(a.params[i], b.params[i]) || !same_bits(a.exp_avgs[i], b.exp_avgs[i]) ||
        !same_bits(a.exp_avg_sqs[i], b.exp_avg_sqs[i]) || !same_bits(a.copies[i], b.copies[i]))
      return false;
  return true;
}

AdamWState clone(const AdamWState& s) {
  const auto all = [](const std::vector<Tensor>& list) {
    std::vector<Tensor> out;
    for (const auto& t : list) out.push_back(t.defined() ? t.clone() : Tensor());
    return out;
  };
  return {all(s.params), all(s.grads), all(s.exp_avgs), all(s.exp_avg_sqs), all(s.copies), all(s.steps)};
}

// Sizes around a block's 4096 elements (256 threads × 16): one element, fewer than a warp, fewer
// than the threads, exactly the threads, exactly a block, a block and one, several blocks and a
// part; step counts from 1 (the largest bias correction) to 1000; copies for some tensors only;
// misaligned operands for some.
std::vector<AdamWSpec> odd_sizes(at::ScalarType grad) {
  return {{1, grad, true, 1},
          {7, grad, false, 2},
          {1000, grad, true, 3, true},
          {256, grad, true, 10},
          {4096, grad, false, 1000},
          {4097, grad, true, 7},
          {3 * 4096 + 17, grad, true, 100, true},
          {5, grad, false, 1, true}};
}

TEST(CudaKernelsOnHost, AdamWMatchesTheCpuFormulaOnEveryTensor) {
  torch::manual_seed(7);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(t == at::kBFloat16 ? "bf16 gradients" : "fp32 gradients");
    const auto specs = odd_sizes(t);
    const auto before = random_adamw(specs);
    for (const bool with_copies : {true, false}) {
      SCOPED_TRACE(with_copies ? "with copies" : "param_copies empty");
      Arena arena;
      const auto s = guarded(arena, before, specs);
      run_adamw(s, with_copies);
      if (with_copies) {
        expect_updated(before, s, 0);
      } else {  // the copies not passed: never written
        auto without = s;
        without.copies.assign(specs.size(), Tensor());
        expect_updated(before, without, 0);
        for (const auto& c : s.copies) {
          if (c.defined()) {
            EXPECT_TRUE(at::isnan(c).all().item<bool>());
          }
        }
      }
      EXPECT_TRUE(arena.intact()) << "the kernel wrote outside its operands";
    }
  }
}

// One launch takes 48 tensors: 48 (a full table, no second launch), 49 and 100 (a second and a
// third launch, the last partial), and 110 with the gradients' dtypes interleaved (55 of each: two
// launches each), sizes from 0 (skipped) to 4400.
TEST(CudaKernelsOnHost, AdamWMoreTensorsThanOneLaunchTakes) {
  torch::manual_seed(8);
  for (const int count : {48, 49, 100, 110}) {
    SCOPED_TRACE(std::to_string(count) + " tensors");
    std::vector<AdamWSpec> specs;
    for (int i = 0; i < count; ++i)
      specs.push_back({(i * 677) % 4401, count == 110 && i % 2 ? at::kBFloat16 : at::kFloat, i % 3 == 0,
                       1.0 + (i * 7) % 50, i % 5 == 1});
    const auto before = random_adamw(specs);
    Arena arena;
    const auto s = guarded(arena, before, specs);
    run_adamw(s, true);
    expect_updated(before, s, 0);
    EXPECT_TRUE(arena.intact()) << "the kernel wrote outside its operands";
  }
}

// grad_scale divides each gradient as it is read; found_inf nonzero changes nothing at all (the
// copies stay the NaN they were), zero changes what no found_inf changes, bit for bit.
TEST(CudaKernelsOnHost, AdamWGradScaleAndFoundInf) {
  torch::manual_seed(9);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(t == at::kBFloat16 ? "bf16 gradients" : "fp32 gradients");
    const auto specs = odd_sizes(t);
    const auto before = random_adamw(specs);
    Arena arena;
    const auto scale = arena.copy_of(at::full({}, 1.7, at::kFloat));
    const auto yes = arena.copy_of(at::full({}, 1.0, at::kFloat)), no = arena.copy_of(at::full({}, 0.0, at::kFloat));
    {
      const auto s = guarded(arena, before, specs);
      run_adamw(s, true, scale);
      expect_updated(before, s, 1.7f);
    }
    {
      const auto s = guarded(arena, before, specs);
      const auto untouched = clone(s);
      run_adamw(s, true, scale, yes);
      EXPECT_TRUE(same_state(s, untouched)) << "found_inf 1 with grad_scale: something changed";
      run_adamw(s, true, std::nullopt, at::full({}, -0.5, at::kFloat));
      EXPECT_TRUE(same_state(s, untouched)) << "found_inf −0.5: something changed";
    }
    {
      const auto s = guarded(arena, before, specs), plain = guarded(arena, before, specs);
      run_adamw(s, true, std::nullopt, no);
      run_adamw(plain, true);
      EXPECT_TRUE(same_state(s, plain)) << "found_inf 0 is not the step without found_inf";
      expect_updated(before, s, 0);
    }
    EXPECT_TRUE(arena.intact()) << "the kernel wrote outside its operands";
  }
}

// Each precondition refused with a line naming it, before anything is launched: the first
// tensor of the list is unchanged when the last one is refused.
TEST(CudaKernelsOnHost, AdamWRefusesWhatItCannotTake) {
  const std::vector<AdamWSpec> specs = {{5, at::kFloat, true, 1}, {6, at::kBFloat16, true, 1}};
  const auto refused = [&](const std::function<void(AdamWState&)>& spoil, const std::string& message,
                           std::optional<Tensor> grad_scale = std::nullopt,
                           std::optional<Tensor> found_inf = std::nullopt) {
    SCOPED_TRACE(message);
    auto s = random_adamw(specs);
    s.copies = {at::full({5}, NAN, at::kBFloat16), at::full({6}, NAN, at::kBFloat16)};
    spoil(s);
    const auto untouched = clone(s);
    try {
      run_adamw(s, true, grad_scale, found_inf);
      ADD_FAILURE() << "accepted";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("[kernels] adamw_cuda: " + message), std::string::npos) << what;
    }
    EXPECT_TRUE(same_bits(s.params[0], untouched.params[0]) && same_bits(s.exp_avgs[0], untouched.exp_avgs[0]));
  };
  refused([](AdamWState& s) { s.grads.pop_back(); }, "2 params, 1 grads");
  refused([](AdamWState& s) { s.copies.pop_back(); }, "2 params, 2 grads, 2 exp_avgs, 2 exp_avg_sqs, 1 param_copies");
  refused([](AdamWState& s) { s.params[1] = s.params[1].to(at::kDouble); }, "params[1] is Double, not Float");
  refused([](AdamWState& s) { s.grads[1] = s.grads[1].to(at::kHalf); }, "grads[1] is Half, not Float or BFloat16");
  refused([](AdamWState& s) { s.exp_avgs[1] = s.exp_avgs[1].to(at::kBFloat16); }, "exp_avgs[1] is BFloat16");
  refused([](AdamWState& s) { s.exp_avg_sqs[1] = at::zeros({7}); }, "exp_avg_sqs[1] has 7 elements, params[1] 6");
  refused([](AdamWState& s) { s.grads[1] = at::zeros({12}, at::kBFloat16).slice(0, 0, 12, 2); },
          "grads[1] is not contiguous");
  refused([](AdamWState& s) { s.copies[1] = at::zeros({6}); }, "param_copies[1] is Float, not BFloat16");
  refused([](AdamWState& s) { s.copies[1] = at::zeros({5}, at::kBFloat16); }, "param_copies[1] has 5 elements");
  refused([](AdamWState& s) { s.steps[1] = at::ones({1}); }, "steps[1] must be 0-d");
  refused([](AdamWState& s) { s.steps[1] = at::ones({}, at::kDouble); }, "steps[1] is Double");
  refused([](AdamWState& s) { s.grads[1] = Tensor(); }, "grads[1] is undefined");
  refused([](AdamWState&) {}, "grad_scale must be 0-d", at::ones({1}));
  refused([](AdamWState&) {}, "found_inf is Bool, not Float", std::nullopt, at::zeros({}, at::kBool));
  // Nothing to update: nothing to refuse.
  EXPECT_NO_THROW(
      ctitan::adamw_cuda({}, {}, {}, {}, {}, {}, kLr, kBeta1, kBeta2, kEps, kWd, std::nullopt, std::nullopt));
}

// The learning rate read from the device (training.cuda_graphs replays the step with each step's
// rate there): bit for bit the update with that rate passed by value, whatever the value passed
// beside it; 0.0422164789… and 0.0544747693… are rates whose decay 1 − lr·wd computed in float32
// would round to another float than the host's float64 computation does. Each rate's result is
// also the float32 reference's.
TEST(CudaKernelsOnHost, AdamWLearningRateOnTheDeviceGivesTheBitsOfTheValue) {
  torch::manual_seed(11);
  for (const auto t : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(t == at::kBFloat16 ? "bf16 gradients" : "fp32 gradients");
    const auto specs = odd_sizes(t);
    const auto before = random_adamw(specs);
    for (const double lr : {kLr, 1e-4 / 3, 7.77e-4, 0.0, 0.1, 0.042216478926141915, 0.05447476933625466}) {
      SCOPED_TRACE("lr " + std::to_string(lr));
      Arena by_value_arena, on_device_arena;
      const auto by_value = guarded(by_value_arena, before, specs);
      const auto on_device = guarded(on_device_arena, before, specs);
      ctitan::adamw_cuda(by_value.params, by_value.grads, by_value.exp_avgs, by_value.exp_avg_sqs, by_value.copies,
                         by_value.steps, lr, kBeta1, kBeta2, kEps, kWd, std::nullopt, std::nullopt);
      // The value beside the tensor is a wrong one: it must not be read.
      ctitan::adamw_cuda(on_device.params, on_device.grads, on_device.exp_avgs, on_device.exp_avg_sqs, on_device.copies,
                         on_device.steps, 0.5, kBeta1, kBeta2, kEps, kWd, std::nullopt, std::nullopt,
                         on_device_arena.copy_of(at::full({}, lr, at::kDouble)));
      for (size_t i = 0; i < specs.size(); ++i) {
        EXPECT_TRUE(same_bits(on_device.params[i], by_value.params[i])) << "param " << i;
        EXPECT_TRUE(same_bits(on_device.exp_avgs[i], by_value.exp_avgs[i])) << "exp_avg " << i;
        EXPECT_TRUE(same_bits(on_device.exp_avg_sqs[i], by_value.exp_avg_sqs[i])) << "exp_avg_sq " << i;
        EXPECT_TRUE(same_bits(on_device.copies[i], by_value.copies[i])) << "copy " << i;
      }
      expect_updated(before, on_device, 0, lr);
      EXPECT_TRUE(by_value_arena.intact() && on_device_arena.intact()) << "the kernel wrote outside its operands";
    }
  }
  // A rate that is not a float64 0-d tensor is refused, naming it.
  auto s = random_adamw({{5, at::kFloat, false, 1}});
  for (const auto& [bad, message] : {std::pair{at::full({}, kLr, at::kFloat), "lr_on_device is Float, not Double"},
                                     std::pair{at::full({1}, kLr, at::kDouble), "lr_on_device must be 0-d"}}) {
    try {
      ctitan::adamw_cuda(s.params, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, s.steps, kLr, kBeta1, kBeta2, kEps, kWd,
                         std::nullopt, std::nullopt, bad);
      ADD_FAILURE() << "accepted: " << message;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("[kernels] adamw_cuda: ") + message), std::string::npos)
          << e.what();
    }
  }
}

// The launcher itself: nothing to do launches nothing; what it cannot take is cudaErrorInvalidValue.
TEST(CudaKernelsOnHost, AdamWLauncherEdgeCases) {
  Arena arena;
  auto p = arena.output({4}, at::kFloat), m = arena.output({4}, at::kFloat), v = arena.output({4}, at::kFloat);
  const auto g = arena.copy_of(at::ones({4}));
  const auto step = arena.copy_of(at::ones({}));
  const gpu::AdamWHyper h{kLr, kBeta1, kBeta2, kEps, kWd};
  gpu::AdamWTensor t{
      p.data_ptr<float>(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), nullptr, step.data_ptr<float>(), 0};
  EXPECT_EQ(gpu::adamw(gpu::Elem::Float32, &t, 0, h, nullptr, nullptr, nullptr), 0);
  EXPECT_EQ(gpu::adamw(gpu::Elem::Float32, &t, 1, h, nullptr, nullptr, nullptr), 0);  // no elements
  EXPECT_TRUE(at::isnan(p).all().item<bool>());
  t.n = -1;
  EXPECT_EQ(gpu::adamw(gpu::Elem::Float32, &t, 1, h, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::adamw(gpu::Elem::Float32, &t, -1, h, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(gpu::adamw(gpu::Elem::Float32, nullptr, 1, h, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_TRUE(at::isnan(p).all().item<bool>() && at::isnan(m).all().item<bool>() && at::isnan(v).all().item<bool>());
  EXPECT_TRUE(arena.intact());
}

// ---- The model itself -------------------------------------------------------------------
// A block's sum by warp shuffles, shared memory and __syncthreads, as the cross-entropy's
// reduction does; every thread then reads the block's sum back from shared memory.
__global__ void block_sums(const int* in, int* out, int* seen, int n) {
  __shared__ int per_warp[32];
  __shared__ int total;
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  int v = i < n ? in[i] : 0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) per_warp[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += per_warp[w];
    total = s;
    out[blockIdx.x] = s;
  }
  __syncthreads();
  seen[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

TEST(CudaOnHost, BlocksThreadsSharedMemoryAndShuffles) {
  const int blocks = 5, threads = 96, n = blocks * threads - 17;
  const auto in = at::randint(-1000, 1000, {n}, at::kInt);
  auto out = at::full({blocks}, -1, at::kInt), seen = at::full({blocks * threads}, -1, at::kInt);
  ctitan::cuda_host::launch(block_sums, blocks, threads)(in.data_ptr<int>(), out.data_ptr<int>(), seen.data_ptr<int>(),
                                                         n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const auto want = at::constant_pad_nd(in, {0, blocks * threads - n}).view({blocks, threads}).sum(1, false, at::kInt);
  EXPECT_TRUE(at::equal(out, want)) << out << want;
  EXPECT_TRUE(at::equal(seen.view({blocks, threads}), want.unsqueeze(1).expand({blocks, threads})));
}

// Shared memory read before it is written: poison (0xFF bytes) in every block, not a zero and
// not what the block before left.
__global__ void read_shared_before_writing(int* out, float* outf) {
  __shared__ int count;
  __shared__ float value;
  out[blockIdx.x * blockDim.x + threadIdx.x] = count;
  outf[blockIdx.x * blockDim.x + threadIdx.x] = value;
  __syncthreads();
  count = 7;
  value = 1.5f;
}

TEST(CudaOnHost, SharedMemoryStartsAsPoisonInEveryBlock) {
  auto out = at::zeros({3 * 32}, at::kInt);
  auto outf = at::zeros({3 * 32}, at::kFloat);
  ctitan::cuda_host::launch(read_shared_before_writing, 3, 32)(out.data_ptr<int>(), outf.data_ptr<float>());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_TRUE(at::equal(out, at::full({3 * 32}, -1, at::kInt))) << out;
  EXPECT_TRUE(at::isnan(outf).all().item<bool>()) << outf;
}

__global__ void divergent_syncthreads(int* out) {
  if (threadIdx.x < 40) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void divergent_shuffle(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

// Blocks that differ in whether they synchronise: legal CUDA, but the model runs the blocks after
// a barrier-free first block without fibers, so it stops rather than run them wrongly.
__global__ void barrier_after_block_zero(int* out) {
  if (blockIdx.x > 0) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

TEST(CudaOnHostDeathTest, BarriersNotEveryThreadReachesStopTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto out = at::zeros({64}, at::kInt);
  EXPECT_DEATH(ctitan::cuda_host::launch(divergent_syncthreads, 1, 64)(out.data_ptr<int>()),
               "__syncthreads that not every thread of the block reaches");
  EXPECT_DEATH(ctitan::cuda_host::launch(divergent_shuffle, 1, 64)(out.data_ptr<int>()),
               "a warp shuffle that not every lane of the warp reaches");
  EXPECT_DEATH(ctitan::cuda_host::launch(barrier_after_block_zero, 2, 32)(out.data_ptr<int>()),
               "a barrier in a block after the first");
}

__global__ void mark(int* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = 1; }

TEST(CudaOnHost, AnInvalidConfigurationIsTheLaunchsErrorAndRunsNothing) {
  auto out = at::zeros({2048}, at::kInt);
  ctitan::cuda_host::launch(mark, 1, 2048)(out.data_ptr<int>());  // more than 1024 threads a block
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);                   // reading the error clears it, as CUDA's does
  ctitan::cuda_host::launch(mark, 0, 32)(out.data_ptr<int>());  // no blocks
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(out.sum().item<int>(), 0);
  ctitan::cuda_host::launch(mark, 2, 1024)(out.data_ptr<int>());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(out.sum().item<int>(), 2048);
}

// The operands' guard: a read one element past the end faults, and a write into the slack
// before the page is seen by intact().
TEST(CudaOnHostDeathTest, OperandsEndAtAPageThatFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const bool misaligned : {false, true}) {
    Arena arena;
    const auto t = arena.output({10}, at::kFloat, misaligned);
    EXPECT_EQ(is_aligned16(t), !misaligned);
    EXPECT_TRUE(arena.intact());
    // 10 floats end 8 bytes short of a 16-byte boundary when aligned: a write there is slack.
    volatile float* p = t.data_ptr<float>();
    if (!misaligned) {
      p[10] = 1.0f;
      EXPECT_FALSE(arena.intact());
    }
  }
  EXPECT_DEATH(
      {
        Arena arena;
        const auto t = arena.output({12}, at::kFloat);  // 48 bytes: ends exactly at the page
        volatile float* p = t.data_ptr<float>();
        std::printf("%f\n", static_cast<double>(p[12]));
      },
      "");
}

}  // namespace
