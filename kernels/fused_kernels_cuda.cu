// The CUDA kernels of kernels/fused_cuda.h. Plain CUDA C++, no LibTorch header: nvcc compiles
// this file alone (cmake/cuda_kernels.cmake), fused_ops_cuda.cpp is the torch side.
//
// Element-wise kernels (SwiGLU, RoPE) move 16 bytes per load and store where the pointers allow it
// (8 bf16 or 4 float32 values), with a scalar tail; the cross-entropy runs one block per row,
// each thread keeping a running maximum and sum of exp over its share of the row (one exp per
// element), combined across the block in a fixed order, so every result is reproducible. AdamW
// runs over a table of tensors passed by value (up to 48 a launch), each block taking 4096
// consecutive elements of one of them, with the operations of ctitan's CPU update each rounded on
// its own (__fmul_rn and friends, which nvcc never contracts into a fused multiply-add).
#include "kernels/fused_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace ctitan::gpu {
namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(bf16 v) { return __bfloat162float(v); }
template <class T>
__device__ __forceinline__ T narrow(float v);
template <>
__device__ __forceinline__ float narrow<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 narrow<bf16>(float v) {
  return __float2bfloat16_rn(v);  // round to nearest even, as c10::BFloat16
}
// v rounded to T's precision and widened back: where ATen's composition stores a T in between.
template <class T>
__device__ __forceinline__ float rounded(float v) {
  return widen(narrow<T>(v));
}

// VEC values of T as one aligned access (VEC · sizeof(T) = 16 bytes, or one value).
template <class T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

constexpr int kThreads = 256;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Blocks for `work` items, one per thread, at most 8192 (the loops stride over the rest).
unsigned blocks_for(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b > 8192 ? 8192 : b);
}

// ---- SwiGLU -----------------------------------------------------------------------------
// y = silu(a) · b, silu(a) = a / (1 + exp(−a)) rounded to T first (ATen's silu, then its mul).
template <class T, int VEC>
__global__ void swiglu_forward_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y,
                                      int64_t packs) {
  using P = Pack<T, VEC>;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < packs; p += int64_t{gridDim.x} * blockDim.x) {
    const P av = reinterpret_cast<const P*>(a)[p];
    const P bv = reinterpret_cast<const P*>(b)[p];
    P out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float x = widen(av.v[k]);
      const float h = rounded<T>(x / (1.0f + expf(-x)));
      out.v[k] = narrow<T>(h * widen(bv.v[k]));
    }
    reinterpret_cast<P*>(y)[p] = out;
  }
}

// db = dy · silu(a) (autograd's mul backward), dh = dy · b rounded to T (the same), and
// da = dh · σ(a) · (1 + a · (1 − σ(a))) (ATen's silu backward), each written in T.
template <class T, int VEC>
__global__ void swiglu_backward_kernel(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ dy,
                                       T* __restrict__ da, T* __restrict__ db, int64_t packs) {
  using P = Pack<T, VEC>;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < packs; p += int64_t{gridDim.x} * blockDim.x) {
    const P av = reinterpret_cast<const P*>(a)[p];
    const P bv = reinterpret_cast<const P*>(b)[p];
    const P gv = reinterpret_cast<const P*>(dy)[p];
    P dav, dbv;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float x = widen(av.v[k]), g = widen(gv.v[k]);
      const float e = expf(-x);
      const float sig = 1.0f / (1.0f + e);
      const float h = rounded<T>(x / (1.0f + e));
      dbv.v[k] = narrow<T>(g * h);
      const float dh = rounded<T>(g * widen(bv.v[k]));
      dav.v[k] = narrow<T>(dh * sig * (1.0f + x * (1.0f - sig)));
    }
    reinterpret_cast<P*>(da)[p] = dav;
    reinterpret_cast<P*>(db)[p] = dbv;
  }
}

// The 16-byte kernel over the largest multiple of VEC elements when every pointer is 16-byte
// aligned, the one-value kernel over the rest (all of it otherwise). `launch(vec, offset, count)`
// launches one of the two over [offset, offset + count).
template <class T, class Launch>
int over_elements(int64_t n, bool all_aligned, Launch launch) {
  constexpr int VEC = 16 / sizeof(T);
  int64_t done = 0;
  if (all_aligned && n >= VEC) {
    launch(std::integral_constant<int, VEC>{}, int64_t{0}, n / VEC);
    done = n / VEC * VEC;
  }
  if (done < n) launch(std::integral_constant<int, 1>{}, done, n - done);
  return static_cast<int>(cudaGetLastError());
}

template <class T>
int swiglu_forward_as(const void* a, const void* b, void* y, int64_t n, cudaStream_t s) {
  const T* A = static_cast<const T*>(a);
  const T* B = static_cast<const T*>(b);
  T* Y = static_cast<T*>(y);
  return over_elements<T>(n, aligned16(a) && aligned16(b) && aligned16(y), [&](auto vec, int64_t off, int64_t packs) {
    constexpr int V = decltype(vec)::value;
    swiglu_forward_kernel<T, V><<<blocks_for(packs), kThreads, 0, s>>>(A + off, B + off, Y + off, packs);
  });
}

template <class T>
int swiglu_backward_as(const void* a, const void* b, const void* dy, void* da, void* db, int64_t n, cudaStream_t s) {
  const T* A = static_cast<const T*>(a);
  const T* B = static_cast<const T*>(b);
  const T* G = static_cast<const T*>(dy);
  T* DA = static_cast<T*>(da);
  T* DB = static_cast<T*>(db);
  const bool all = aligned16(a) && aligned16(b) && aligned16(dy) && aligned16(da) && aligned16(db);
  return over_elements<T>(n, all, [&](auto vec, int64_t off, int64_t packs) {
    constexpr int V = decltype(vec)::value;
    swiglu_backward_kernel<T, V>
        <<<blocks_for(packs), kThreads, 0, s>>>(A + off, B + off, G + off, DA + off, DB + off, packs);
  });
}

// ---- RoPE -------------------------------------------------------------------------------
// Each interleaved pair (a, b) of x [rows, hd] (row r at position (r / heads) mod T) times
// cos + i·sin of its frequency, in float32: (a·c − b·s, a·s + b·c), rounded once to T; the
// backward is the same rotation by the conjugate, (a·c + b·s, b·c − a·s) (CONJ). VEC values per
// access, VEC even and dividing hd, so a pack never straddles two rows.
template <class T, int VEC, bool CONJ>
__global__ void rope_kernel(const T* __restrict__ x, const float2* __restrict__ freqs, T* __restrict__ y, int64_t packs,
                            int64_t hd, int64_t heads, int64_t T_len) {
  using P = Pack<T, VEC>;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < packs; p += int64_t{gridDim.x} * blockDim.x) {
    const int64_t e = p * VEC;  // first element of the pack
    const int64_t row = e / hd, col = e - row * hd;
    const float2* f = freqs + ((row / heads) % T_len) * (hd / 2) + col / 2;
    P xv, out;
    if constexpr (sizeof(P) == 16) {
      xv = reinterpret_cast<const P*>(x)[p];
    } else {  // one pair, element by element: x may be aligned to its element only
#pragma unroll
      for (int k = 0; k < VEC; ++k) xv.v[k] = x[e + k];
    }
#pragma unroll
    for (int k = 0; k < VEC; k += 2) {
      const float a = widen(xv.v[k]), b = widen(xv.v[k + 1]);
      const float2 cs = f[k / 2];
      if (CONJ) {
        out.v[k] = narrow<T>(a * cs.x + b * cs.y);
        out.v[k + 1] = narrow<T>(b * cs.x - a * cs.y);
      } else {
        out.v[k] = narrow<T>(a * cs.x - b * cs.y);
        out.v[k + 1] = narrow<T>(a * cs.y + b * cs.x);
      }
    }
    if constexpr (sizeof(P) == 16) {
      reinterpret_cast<P*>(y)[p] = out;
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[e + k] = out.v[k];
    }
  }
}

// 16-byte packs when both pointers are 16-byte aligned and hd is a multiple of the pack, else
// one pair per thread.
template <class T, bool CONJ>
int rope_as(const void* x, const float* freqs, void* y, int64_t rows, int64_t hd, int64_t heads, int64_t T_len,
            cudaStream_t s) {
  constexpr int VEC = 16 / sizeof(T);
  const T* X = static_cast<const T*>(x);
  const auto* F = reinterpret_cast<const float2*>(freqs);
  T* Y = static_cast<T*>(y);
  const int64_t n = rows * hd;
  if (aligned16(x) && aligned16(y) && hd % VEC == 0)
    rope_kernel<T, VEC, CONJ><<<blocks_for(n / VEC), kThreads, 0, s>>>(X, F, Y, n / VEC, hd, heads, T_len);
  else
    rope_kernel<T, 2, CONJ><<<blocks_for(n / 2), kThreads, 0, s>>>(X, F, Y, n / 2, hd, heads, T_len);
  return static_cast<int>(cudaGetLastError());
}

// ---- Cross-entropy ----------------------------------------------------------------------
// A running maximum m and Σ exp(x − m) over the values seen. A NaN makes s NaN, which every
// later combination keeps.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ void add_value(MaxSum& r, float v) {
  if (v > r.m) {
    r.s = r.s * expf(r.m - v) + 1.0f;
    r.m = v;
  } else if (v != -INFINITY) {
    r.s += expf(v - r.m);
  }
}

__device__ __forceinline__ MaxSum combine(MaxSum x, MaxSum y) {
  const float m = fmaxf(x.m, y.m);
  if (m == -INFINITY) return {m, x.s + y.s};  // nothing above −inf yet (0, or NaN)
  return {m, x.s * expf(x.m - m) + y.s * expf(y.m - m)};
}

// The block's combination, valid in thread 0: within each warp by butterfly, then the warps'
// results by the first warp (a fixed order).
template <int THREADS>
__device__ MaxSum block_combine(MaxSum r) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    r = combine(r, MaxSum{__shfl_xor_sync(0xffffffffu, r.m, o), __shfl_xor_sync(0xffffffffu, r.s, o)});
  __shared__ MaxSum per_warp[THREADS / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) per_warp[warp] = r;
  __syncthreads();
  if (warp == 0) {
    r = lane < THREADS / 32 ? per_warp[lane] : MaxSum{-INFINITY, 0.0f};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      r = combine(r, MaxSum{__shfl_xor_sync(0xffffffffu, r.m, o), __shfl_xor_sync(0xffffffffu, r.s, o)});
  }
  return r;
}

// One block per row: lse and lse − x[label].
template <class T, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
    cross_entropy_forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels, int64_t V,
                                 float* __restrict__ lse, float* __restrict__ row_loss) {
  using P = Pack<T, VEC>;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  MaxSum r{-INFINITY, 0.0f};
  for (int64_t p = threadIdx.x; p < V / VEC; p += THREADS) {
    const P xv = reinterpret_cast<const P*>(x)[p];
#pragma unroll
    for (int k = 0; k < VEC; ++k) add_value(r, widen(xv.v[k]));
  }
  r = block_combine<THREADS>(r);
  if (threadIdx.x == 0) {
    const float l = r.m + logf(r.s);
    const int64_t y = labels[row];
    lse[row] = l;
    row_loss[row] = y >= 0 && y < V ? l - widen(x[y]) : NAN;
  }
}

// One block per row: (exp(x − lse) − [j == label]) · coef.
template <class T, int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
    cross_entropy_backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ labels,
                                  const float* __restrict__ lse, const float* __restrict__ coef, int64_t V,
                                  T* __restrict__ dx) {
  using P = Pack<T, VEC>;
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  T* d = dx + row * V;
  const float l = lse[row], c = coef[0];
  const int64_t y = labels[row];
  for (int64_t p = threadIdx.x; p < V / VEC; p += THREADS) {
    const P xv = reinterpret_cast<const P*>(x)[p];
    P out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float prob = expf(widen(xv.v[k]) - l);
      out.v[k] = narrow<T>((p * VEC + k == y ? prob - 1.0f : prob) * c);
    }
    reinterpret_cast<P*>(d)[p] = out;
  }
}

// 16-byte rows when every row starts 16-byte aligned (V a multiple of VEC, the base aligned);
// 512 threads a row from 16,384 values up, 256 below.
template <class T, class Launch>
int over_rows(int64_t rows, int64_t V, bool base_aligned, Launch launch) {
  if (rows == 0 || V == 0) return 0;
  constexpr int VEC = 16 / sizeof(T);
  const bool vec = base_aligned && V % VEC == 0;
  const bool wide = V >= 16384;
  if (vec && wide) launch(std::integral_constant<int, VEC>{}, std::integral_constant<int, 512>{});
  if (vec && !wide) launch(std::integral_constant<int, VEC>{}, std::integral_constant<int, 256>{});
  if (!vec && wide) launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 512>{});
  if (!vec && !wide) launch(std::integral_constant<int, 1>{}, std::integral_constant<int, 256>{});
  return static_cast<int>(cudaGetLastError());
}

template <class T>
int cross_entropy_forward_as(const void* logits, const int64_t* labels, int64_t rows, int64_t V, float* lse,
                             float* row_loss, cudaStream_t s) {
  const T* X = static_cast<const T*>(logits);
  return over_rows<T>(rows, V, aligned16(logits), [&](auto vec, auto threads) {
    constexpr int VC = decltype(vec)::value, TH = decltype(threads)::value;
    cross_entropy_forward_kernel<T, VC, TH><<<static_cast<unsigned>(rows), TH, 0, s>>>(X, labels, V, lse, row_loss);
  });
}

template <class T>
int cross_entropy_backward_as(const void* logits, const int64_t* labels, const float* lse, const float* coef,
                              int64_t rows, int64_t V, void* dx, cudaStream_t s) {
  const T* X = static_cast<const T*>(logits);
  T* D = static_cast<T*>(dx);
  return over_rows<T>(rows, V, aligned16(logits) && aligned16(dx), [&](auto vec, auto threads) {
    constexpr int VC = decltype(vec)::value, TH = decltype(threads)::value;
    cross_entropy_backward_kernel<T, VC, TH><<<static_cast<unsigned>(rows), TH, 0, s>>>(X, labels, lse, coef, V, D);
  });
}

// ---- AdamW ------------------------------------------------------------------------------
// A launch's table: entry e covers blocks [first_block[e], first_block[e + 1]), kAdamWPerThread
// elements a thread (thread t of a block: its elements start + t + k · blockDim). A tensor of
// more than kAdamWMaxPieceBlocks blocks takes several entries (pieces), so the block counts of a
// full table stay far below CUDA's 2^31 − 1 blocks.
constexpr int kAdamWTensors = 48;
constexpr int kAdamWPerThread = 16;
constexpr int64_t kAdamWChunk = int64_t{kThreads} * kAdamWPerThread;  // elements a block
constexpr int64_t kAdamWMaxPieceBlocks = int64_t{1} << 24;

struct AdamWTable {
  AdamWTensor t[kAdamWTensors];
  unsigned first_block[kAdamWTensors + 1];
  int count;
};

// The step-independent coefficients, rounded to float32 as the CPU update rounds them, and what
// the bias corrections and the decay need in float64.
struct AdamWConstants {
  double lr, beta1, beta2, weight_decay;
  float b1, b2, c1, c2, eps;
};

// A launch's arguments: at most 4 KiB (32 KiB only from CUDA 12.1 on, on Volta and later GPUs).
static_assert(sizeof(AdamWTable) + sizeof(AdamWConstants) + 3 * sizeof(void*) <= 4096, "adamw's arguments");

// The block's tensor is found by a scan of the table (entries are read by value: taking the
// address of a kernel argument would copy the whole table to each thread's local memory). Its
// step's coefficients are computed by each thread before its elements, in float64 as the CPU
// update computes them from the integer step count; then, per element, the CPU update's float32
// operations in its order. The rate is k.lr, or the float64 at lr_on_device (read when the kernel
// runs: a captured CUDA graph replays with each step's rate); the decay 1 − lr·wd is computed from
// it with the CPU update's two float64 roundings (no fused multiply-add), so both routes give the
// same bits for the same rate.
template <class G>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const AdamWTable table, const AdamWConstants k, const float* __restrict__ grad_scale,
                 const float* __restrict__ found_inf, const double* __restrict__ lr_on_device) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  int e = 0;
  while (blockIdx.x >= table.first_block[e + 1]) ++e;
  const AdamWTensor t = table.t[e];
  const double s = static_cast<double>(*t.step);
  const double bc1 = 1.0 - pow(k.beta1, s), bc2 = 1.0 - pow(k.beta2, s);
  const float sqrt_bc2 = static_cast<float>(sqrt(bc2));
  const double lr = lr_on_device != nullptr ? *lr_on_device : k.lr;
  const float decay = static_cast<float>(__dsub_rn(1.0, __dmul_rn(lr, k.weight_decay)));
  const float step_size = static_cast<float>(lr / bc1);
  const float scale = grad_scale != nullptr ? *grad_scale : 1.0f;
  float* __restrict__ P = t.param;
  const G* __restrict__ Gr = static_cast<const G*>(t.grad);
  float* __restrict__ M = t.exp_avg;
  float* __restrict__ V = t.exp_avg_sq;
  bf16* __restrict__ C = static_cast<bf16*>(t.param_copy);
  const int64_t start =
      int64_t{blockIdx.x - table.first_block[e]} * blockDim.x * kAdamWPerThread + int64_t{threadIdx.x};
#pragma unroll
  for (int j = 0; j < kAdamWPerThread; ++j) {
    const int64_t i = start + int64_t{j} * blockDim.x;
    if (i >= t.n) break;
    float g = widen(Gr[i]);
    if (grad_scale != nullptr) g = __fdiv_rn(g, scale);
    const float p = __fmul_rn(P[i], decay);
    const float m = __fadd_rn(__fmul_rn(M[i], k.b1), __fmul_rn(g, k.c1));
    const float v = __fadd_rn(__fmul_rn(V[i], k.b2), __fmul_rn(__fmul_rn(g, g), k.c2));
    M[i] = m;
    V[i] = v;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), sqrt_bc2), k.eps);
    const float out = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
    P[i] = out;
    if (C != nullptr) C[i] = narrow<bf16>(out);
  }
}

// Fills tables of up to kAdamWTensors pieces and launches each when full, and the last.
template <class G>
int adamw_as(const AdamWTensor* tensors, int64_t count, const AdamWConstants& k, const float* grad_scale,
             const float* found_inf, const double* lr_on_device, cudaStream_t s) {
  AdamWTable table{};
  auto flush = [&]() -> int {
    if (table.count == 0) return 0;
    adamw_kernel<G><<<table.first_block[table.count], kThreads, 0, s>>>(table, k, grad_scale, found_inf, lr_on_device);
    table.count = 0;
    return static_cast<int>(cudaGetLastError());
  };
  for (int64_t i = 0; i < count; ++i) {
    const AdamWTensor& t = tensors[i];
    for (int64_t done = 0; done < t.n;) {
      const int64_t n = std::min(t.n - done, kAdamWMaxPieceBlocks * kAdamWChunk);
      bf16* copy = static_cast<bf16*>(t.param_copy);
      table.t[table.count] = {t.param + done,
                              static_cast<const G*>(t.grad) + done,
                              t.exp_avg + done,
                              t.exp_avg_sq + done,
                              copy ? copy + done : nullptr,
                              t.step,
                              n};
      table.first_block[table.count + 1] =
          table.first_block[table.count] + static_cast<unsigned>((n + kAdamWChunk - 1) / kAdamWChunk);
      done += n;
      if (++table.count == kAdamWTensors) {
        if (const int rc = flush()) return rc;
      }
    }
  }
  return flush();
}

}  // namespace

int swiglu_forward(Elem t, const void* a, const void* b, void* y, int64_t n, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (n == 0) return 0;
  return t == Elem::BFloat16 ? swiglu_forward_as<bf16>(a, b, y, n, s) : swiglu_forward_as<float>(a, b, y, n, s);
}

int swiglu_backward(Elem t, const void* a, const void* b, const void* dy, void* da, void* db, int64_t n, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (n == 0) return 0;
  return t == Elem::BFloat16 ? swiglu_backward_as<bf16>(a, b, dy, da, db, n, s)
                             : swiglu_backward_as<float>(a, b, dy, da, db, n, s);
}

int rope(Elem t, bool conjugate, const void* x, const float* freqs, void* y, int64_t rows, int64_t hd, int64_t heads,
         int64_t T_len, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (rows == 0 || hd == 0) return 0;
  // Odd head sizes have no pairs; the table is read as float2 (8-byte aligned).
  if (hd % 2 != 0 || heads <= 0 || T_len <= 0 || (reinterpret_cast<uintptr_t>(freqs) & 7) != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  if (t == Elem::BFloat16)
    return conjugate ? rope_as<bf16, true>(x, freqs, y, rows, hd, heads, T_len, s)
                     : rope_as<bf16, false>(x, freqs, y, rows, hd, heads, T_len, s);
  return conjugate ? rope_as<float, true>(x, freqs, y, rows, hd, heads, T_len, s)
                   : rope_as<float, false>(x, freqs, y, rows, hd, heads, T_len, s);
}

int cross_entropy_forward(Elem t, const void* logits, const int64_t* labels, int64_t rows, int64_t V, float* lse,
                          float* row_loss, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  return t == Elem::BFloat16 ? cross_entropy_forward_as<bf16>(logits, labels, rows, V, lse, row_loss, s)
                             : cross_entropy_forward_as<float>(logits, labels, rows, V, lse, row_loss, s);
}

int cross_entropy_backward(Elem t, const void* logits, const int64_t* labels, const float* lse, const float* coef,
                           int64_t rows, int64_t V, void* dx, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  return t == Elem::BFloat16 ? cross_entropy_backward_as<bf16>(logits, labels, lse, coef, rows, V, dx, s)
                             : cross_entropy_backward_as<float>(logits, labels, lse, coef, rows, V, dx, s);
}

int adamw(Elem grad, const AdamWTensor* tensors, int64_t count, const AdamWHyper& h, const float* grad_scale,
          const float* found_inf, void* stream, const double* lr_on_device) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (count < 0 || (count > 0 && tensors == nullptr)) return static_cast<int>(cudaErrorInvalidValue);
  for (int64_t i = 0; i < count; ++i)
    if (tensors[i].n < 0) return static_cast<int>(cudaErrorInvalidValue);
  // As components/optimizer.cpp's FusedAdamW::update rounds them.
  const AdamWConstants k{h.lr,
                         h.beta1,
                         h.beta2,
                         h.weight_decay,
                         static_cast<float>(h.beta1),
                         static_cast<float>(h.beta2),
                         static_cast<float>(1.0 - h.beta1),
                         static_cast<float>(1.0 - h.beta2),
                         static_cast<float>(h.eps)};
  return grad == Elem::BFloat16 ? adamw_as<bf16>(tensors, count, k, grad_scale, found_inf, lr_on_device, s)
                                : adamw_as<float>(tensors, count, k, grad_scale, found_inf, lr_on_device, s);
}

}  // namespace ctitan::gpu
