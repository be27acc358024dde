// Scalar helpers for ctitan's hand-written CPU loops (kernels/fused_ops.cpp,
// kernels/flash_attention.cpp): branch-free, so GCC vectorises the loops that use them when
// the file is built with -fno-trapping-math (see CMakeLists.txt). Used by models/ and
// components/optimizer.cpp.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The hot loops (each a plain function over raw pointers) are compiled three times — for
// AVX-512 (x86-64-v4), AVX2 + FMA (x86-64-v3) and baseline x86-64 — and the dynamic loader
// picks the best one the CPU runs (GCC function multiversioning, an ifunc). `flatten` inlines
// the helpers below into every version. Anything these functions call without inlining runs
// its baseline code, so a CPU never meets an instruction it lacks. The sanitizer build keeps
// one version (the runtimes do not instrument ifunc resolvers).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CTITAN_SANITIZE)
#define CTITAN_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))
#else
#define CTITAN_KERNEL
#endif

namespace ctitan::kernel {

// dtype of the statistics and accumulators (at::opmath_type's choice as a runtime value):
// float64 for float64 inputs, float32 for float32 and the 16-bit types.
inline c10::ScalarType acc_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Double ? c10::ScalarType::Double : c10::ScalarType::Float;
}

inline float widen(c10::BFloat16 h) {
  const uint32_t bits = static_cast<uint32_t>(h.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(float f) { return f; }
inline double widen(double d) { return d; }
template <class T>
inline T narrow_to(float f) {
  return static_cast<T>(f);
}
// 16 float32 lanes in a GCC vector (one AVX-512 register, two AVX2 or four SSE ones), and
// the same lanes as raw bits / as bf16 bits. Loops over a row hand their body a `Lanes` (or
// `WideLanes`) index for each full group of 16 elements and a plain int64_t for the tail; the
// helpers below (ld, st, exp_fast) take any, so one generic lambda serves all. (GCC does not
// vectorise a per-element body with exp's bit tricks and bf16 rounding by itself: it built
// each vector from 16 scalar broadcasts, which made the softmax loops the slowest part of
// attention.) Each lane computes exactly what the scalar code computes for its element.
using lanes16f = float __attribute__((vector_size(64)));
using lanes16u = uint32_t __attribute__((vector_size(64)));
using lanes16h = uint16_t __attribute__((vector_size(32)));
using lanes8f = float __attribute__((vector_size(32)));
using lanes8u = uint32_t __attribute__((vector_size(32)));
struct Lanes {
  int64_t j;  // the first of 16 consecutive elements
};
// The same 16 lanes for the AVX-512 clone (select_less says why there are two forms): a
// `WideLanes` index gives `Wide16` values, whose helpers compare whole vectors. The arithmetic
// is lanes16f's, lane for lane.
struct WideLanes {
  int64_t j;
};
struct Wide16 {
  lanes16f v;
};
#define CTITAN_WIDE16_OP(op)                                             \
  inline Wide16 operator op(Wide16 a, Wide16 b) { return {a.v op b.v}; } \
  inline Wide16 operator op(Wide16 a, float b) { return {a.v op b}; }    \
  inline Wide16 operator op(float a, Wide16 b) { return {a op b.v}; }    \
  inline Wide16& operator op##=(Wide16& a, Wide16 b) {                   \
    a.v = a.v op b.v;                                                    \
    return a;                                                            \
  }
CTITAN_WIDE16_OP(+)
CTITAN_WIDE16_OP(-)
CTITAN_WIDE16_OP(*)
CTITAN_WIDE16_OP(/)
#undef CTITAN_WIDE16_OP
inline Wide16 operator-(Wide16 a) { return {-a.v}; }
template <class T>
inline constexpr bool is_lanes_v = std::is_same_v<T, Lanes> || std::is_same_v<T, WideLanes>;

template <class V>
struct HalfLanes {};
template <>
struct HalfLanes<lanes16f> {
  using type = lanes8f;
};
template <>
struct HalfLanes<lanes16u> {
  using type = lanes8u;
};

// a < b ? x : y, lane by lane (or for scalars), in one of two forms for 16-lane vectors that
// select the same lanes. GCC compiles each CTITAN_KERNEL twice for x86-64 vectors, and neither
// form compiles well in both clones:
// - halves (Whole false): two 8-lane compares. GCC 12 compiles a 64-byte comparison in the
//   AVX2 clone (x86-64-v3, no 64-byte registers) into 16 scalar compares and conditional
//   moves through the stack, and so ran the cross-entropy rows at a tenth of their speed on a
//   Zen 3; 32-byte halves compile to vcmpps + vblendvps there.
// - whole (Whole true): one 64-byte compare. In the AVX-512 clone the halves' results are
//   joined back into one register through the stack (two 32-byte stores, then a 64-byte load
//   that store forwarding cannot serve), which made bf16 attention's softmax 2.5x slower on an
//   Intel Xeon (AMX) than whole compares (debug model, bf16: 9,701 -> 5,935 tokens/s).
// The 16-lane loops below take the whole form where the AVX-512 clone runs (wide_lanes()).
template <bool Whole = false, class V, class W>
inline W select_less(V a, V b, W x, W y) {
  if constexpr (!Whole && (std::is_same_v<V, lanes16f> || std::is_same_v<V, lanes16u>)) {
    using HV = typename HalfLanes<V>::type;
    using HW = typename HalfLanes<W>::type;
    HV a2[2], b2[2];
    HW x2[2], y2[2];
    std::memcpy(a2, &a, sizeof a);
    std::memcpy(b2, &b, sizeof b);
    std::memcpy(x2, &x, sizeof x);
    std::memcpy(y2, &y, sizeof y);
    for (int i = 0; i < 2; ++i) x2[i] = a2[i] < b2[i] ? x2[i] : y2[i];
    W r;
    std::memcpy(&r, x2, sizeof r);
    return r;
  } else {
    return a < b ? x : y;
  }
}

// True where the loader picks CTITAN_KERNEL's AVX-512 clone (x86-64-v4: AVX-512 F, BW, DQ and
// VL among its features): there the 16-lane loops compare whole vectors. Read once.
inline bool wide_lanes() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
#else
  return false;
#endif
}

// The bf16 bits of float32 bits u, rounded to nearest even, NaN kept NaN (in the low 16 bits).
// U: uint32_t, or a vector of them (kernel_math's 16-lane store uses the same rounding).
template <class U, bool Whole = false>
inline U bf16_bits(U u) {
  const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  // NaN: the magnitude's bits above infinity's
  return select_less<Whole>(U{} + 0x7F800000u, u & 0x7FFFFFFFu, U{} + 0x7FC0u, rounded);
}
template <>
inline c10::BFloat16 narrow_to<c10::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return c10::BFloat16(static_cast<uint16_t>(bf16_bits(u)), c10::BFloat16::from_bits());
}
template <class T>
inline T narrow_to(double d) {
  return static_cast<T>(d);
}

template <class V>
inline V splat(float c) {
  return V{} + c;
}

// 2^n · e^r for x = n·ln2 + r, with x already held within [-87, 88]: e^r by its Taylor
// polynomial of degree Degree (|r| <= ln2/2), 2^n written into the exponent, branch-free.
// V, U: float and uint32_t, or lanes16f and lanes16u.
template <int Degree, class V, class U>
inline V exp_held(V x) {
  static_assert(Degree >= 1 && Degree <= 7, "exp_held: degree 1 to 7");
  constexpr float inv_factorial[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};
  const V big = x * 1.44269504088896341f + 12582912.0f;  // n in big's low mantissa bits
  const V n = big - 12582912.0f;
  const V r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln2 in two parts
  V p = splat<V>(inv_factorial[Degree]);
  for (int k = Degree - 1; k >= 0; --k) p = p * r + inv_factorial[k];
  U bb;
  std::memcpy(&bb, &big, sizeof bb);
  const U e = (bb - 0x4B400000u + 127u) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// e^x in float32 within ~2 ulp, branch-free: exp_held's degree 7. Below -87 (e^x < 2^-125,
// where the exponent trick stops working) the result is 0, as for the masked keys' -inf.
// V, U: float and uint32_t, or lanes16f and lanes16u; Whole: select_less's form.
template <class V, class U, bool Whole = false>
inline V exp_fast_lanes(V x) {
  const V lo = splat<V>(-87.0f), hi = splat<V>(88.0f);
  const V held = select_less<Whole>(hi, x, hi, select_less<Whole>(x, lo, lo, x));
  return select_less<Whole>(x, lo, splat<V>(0.0f), exp_held<7, V, U>(held));
}
inline float exp_fast(float x) { return exp_fast_lanes<float, uint32_t>(x); }
inline lanes16f exp_fast(lanes16f x) { return exp_fast_lanes<lanes16f, lanes16u>(x); }
inline Wide16 exp_fast(Wide16 x) { return {exp_fast_lanes<lanes16f, lanes16u, true>(x.v)}; }
inline double exp_fast(double x) { return std::exp(x); }

// Element j of a row, widened to the accumulator type (scalar), or elements j.j .. j.j + 15.
template <class T>
inline auto ld(const T* p, int64_t j) {
  return widen(p[j]);
}
inline lanes16f ld(const float* p, Lanes j) {
  lanes16f v;
  std::memcpy(&v, p + j.j, sizeof v);
  return v;
}
inline lanes16f ld(const c10::BFloat16* p, Lanes j) {
  lanes16h h;
  std::memcpy(&h, p + j.j, sizeof h);
  const lanes16u bits = __builtin_convertvector(h, lanes16u) << 16;
  lanes16f v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// Store v rounded to T at element j (scalar), or 16 lanes from j.j on (narrow_to per lane).
template <class T, class A>
inline void st(T* p, int64_t j, A v) {
  p[j] = narrow_to<T>(v);
}
inline void st(float* p, Lanes j, lanes16f v) { std::memcpy(p + j.j, &v, sizeof v); }
template <bool Whole = false>
inline void st_bf16(c10::BFloat16* p, int64_t j, lanes16f v) {
  lanes16u u;
  std::memcpy(&u, &v, sizeof u);
  const lanes16h h = __builtin_convertvector((bf16_bits<lanes16u, Whole>(u)), lanes16h);
  std::memcpy(p + j, &h, sizeof h);
}
inline void st(c10::BFloat16* p, Lanes j, lanes16f v) { st_bf16(p, j.j, v); }
inline Wide16 ld(const float* p, WideLanes j) { return {ld(p, Lanes{j.j})}; }
inline Wide16 ld(const c10::BFloat16* p, WideLanes j) { return {ld(p, Lanes{j.j})}; }
inline void st(float* p, WideLanes j, Wide16 v) { st(p, Lanes{j.j}, v.v); }
inline void st(c10::BFloat16* p, WideLanes j, Wide16 v) { st_bf16<true>(p, j.j, v.v); }

// Acc float: f(Lanes{j}) for each full group of 16 elements of [0, n) (f(WideLanes{j}) where
// wide_lanes()), f(j) for the rest; Acc double: f(j) for every element. The groups' loops
// below take the index form as Index; the public loops choose it once per call.
inline lanes16f lanes_of(lanes16f v) { return v; }
inline lanes16f lanes_of(Wide16 v) { return v.v; }

template <class Index, class F>
inline int64_t for_groups(int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) f(Index{j});
  return j;
}
template <class Acc, class F>
inline void for_lanes(int64_t n, F&& f) {
  int64_t j = 0;
  if constexpr (std::is_same_v<Acc, float>) j = wide_lanes() ? for_groups<WideLanes>(n, f) : for_groups<Lanes>(n, f);
  for (; j < n; ++j) f(j);
}

// Reductions over j in [0, n) in interleaved partial lanes, combined at the end: without
// -ffast-math GCC will not reorder a float sum or max into vector lanes itself, and a scalar
// reduction is what made these loops slow. float: f(Lanes) gives 16 lanes at a time (see
// above), f(int64_t) one tail element; double: 8 scalar lanes of f(int64_t). The order is
// fixed, so results are reproducible, and the same in either index form.
template <class Index, class F>
inline lanes16f sum_groups(int64_t n, int64_t& j, F&& f) {
  lanes16f part = {};
  for (; j + 16 <= n; j += 16) part += lanes_of(f(Index{j}));
  return part;
}
template <class Acc, class F>
inline Acc lane_sum(int64_t n, F&& f) {
  int64_t j = 0;
  Acc s = 0;
  if constexpr (std::is_same_v<Acc, float>) {
    const lanes16f part = wide_lanes() ? sum_groups<WideLanes>(n, j, f) : sum_groups<Lanes>(n, j, f);
    for (int k = 0; k < 16; ++k) s += part[k];
  } else {
    Acc part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; j + 8 <= n; j += 8)
      for (int k = 0; k < 8; ++k) part[k] += f(j + k);
    for (int k = 0; k < 8; ++k) s += part[k];
  }
  for (; j < n; ++j) s += f(j);
  return s;
}
template <class Index, class F>
inline lanes16f max_groups(int64_t n, int64_t& j, float init, F&& f) {
  lanes16f part = splat<lanes16f>(init);
  for (; j + 16 <= n; j += 16) {
    const lanes16f v = lanes_of(f(Index{j}));
    part = select_less<std::is_same_v<Index, WideLanes>>(part, v, v, part);
  }
  return part;
}
template <class Acc, class F>
inline Acc lane_max(int64_t n, Acc init, F&& f) {
  int64_t j = 0;
  Acc m = init;
  if constexpr (std::is_same_v<Acc, float>) {
    const lanes16f part = wide_lanes() ? max_groups<WideLanes>(n, j, init, f) : max_groups<Lanes>(n, j, init, f);
    for (int k = 0; k < 16; ++k) m = part[k] > m ? part[k] : m;
  } else {
    Acc part[8] = {init, init, init, init, init, init, init, init};
    for (; j + 8 <= n; j += 8)
      for (int k = 0; k < 8; ++k) {
        const Acc v = f(j + k);
        part[k] = v > part[k] ? v : part[k];
      }
    for (int k = 0; k < 8; ++k) m = part[k] > m ? part[k] : m;
  }
  for (; j < n; ++j) {
    const Acc v = f(j);
    m = v > m ? v : m;
  }
  return m;
}

}  // namespace ctitan::kernel
