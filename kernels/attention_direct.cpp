#include "kernels/attention_direct.h"
#include "kernels/kernel_math.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <unistd.h>

namespace ctitan::attention_direct {
namespace {

using kernel::Lanes;
using kernel::lanes16f;
using kernel::ld;
using kernel::st;

constexpr int kRows = 8;    // query rows per strip: the register block of every loop below
constexpr int kLanes = 16;  // keys per score vector

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The row stride of every [rows][keys] scratch (transposed heads, score strips): the keys
// rounded up to whole vectors, then to an odd number of cache lines, so that the rows one
// vector loop walks fall into different cache sets (with a stride of 512 keys, 2 KiB, sixteen
// rows would share two of a 48 KiB L1's 64 sets).
int64_t key_stride(int64_t T) {
  const int64_t t = round_up(T, kLanes);
  return (t / kLanes) % 2 == 0 ? t + kLanes : t;
}

// A worker's scratch, from the caching CPU allocator (no page faults per call).
float* scratch(torch::Tensor& keep, int64_t n) {
  keep = torch::empty({std::max<int64_t>(n, 1)}, torch::kFloat);
  return keep.data_ptr<float>();
}

// Xt[d][j] = X[j][d] for the T rows of one head (leading dimension ld), zero for j in [T, ks):
// a score vector is then sixteen consecutive keys of one dimension.
CTITAN_KERNEL void transpose_head(const float* X, int64_t ld, int64_t T, int64_t hd, float* Xt, int64_t ks) {
  for (int64_t j = 0; j < T; ++j)
    for (int64_t d = 0; d < hd; ++d) Xt[d * ks + j] = X[j * ld + d];
  for (int64_t d = 0; d < hd; ++d) std::fill(Xt + d * ks + T, Xt + (d + 1) * ks, 0.0f);
}

// The T rows of one head (leading dimension ld) packed together: read in place, rows KV·hd
// floats apart would share a few cache sets (512 bytes apart in the debug model: 8 of a
// 48 KiB L1's 64 sets).
void pack_head(const float* X, int64_t ld, int64_t T, int64_t hd, float* out) {
  for (int64_t j = 0; j < T; ++j) std::memcpy(out + j * hd, X + j * ld, hd * sizeof(float));
}

// S[r][j] = scale · a_r · Bt[·][j] for the kRows rows of A (kRows × HD, contiguous) and the
// keys of `chunks` score vectors.
template <int HD>
CTITAN_KERNEL void row_scores(const float* A, const float* Bt, int64_t ks, int64_t chunks, float scale, float* S) {
  for (int64_t c = 0; c < chunks; ++c) {
    const Lanes j{c * kLanes};
    lanes16f acc[kRows] = {};
    for (int d = 0; d < HD; ++d) {
      const lanes16f b = ld(Bt + d * ks, j);
      for (int r = 0; r < kRows; ++r) acc[r] += A[r * HD + d] * b;
    }
    for (int r = 0; r < kRows; ++r) st(S + r * ks, j, acc[r] * scale);
  }
}

// The backward's two score strips in one pass: S = scale · q kᵀ and dP = dO vᵀ.
template <int HD>
CTITAN_KERNEL void row_scores_pair(const float* Q, const float* Kt, const float* DO, const float* Vt, int64_t ks,
                                   int64_t chunks, float scale, float* S, float* DP) {
  for (int64_t c = 0; c < chunks; ++c) {
    const Lanes j{c * kLanes};
    lanes16f s[kRows] = {}, p[kRows] = {};
    for (int d = 0; d < HD; ++d) {
      const lanes16f kd = ld(Kt + d * ks, j), vd = ld(Vt + d * ks, j);
      for (int r = 0; r < kRows; ++r) {
        s[r] += Q[r * HD + d] * kd;
        p[r] += DO[r * HD + d] * vd;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      st(S + r * ks, j, s[r] * scale);
      st(DP + r * ks, j, p[r]);
    }
  }
}

// Out[r] = Σ_j W[r][j] · X_j over keys j < n (rows of X with leading dimension ldx): P·V in
// the forward, dS·K in the backward.
template <int HD>
CTITAN_KERNEL void weighted_rows(const float* W, int64_t ks, const float* X, int64_t ldx, int64_t n, float* Out) {
  constexpr int NV = HD / kLanes;
  lanes16f o[kRows][NV] = {};
  for (int64_t j = 0; j < n; ++j) {
    lanes16f x[NV];
    for (int v = 0; v < NV; ++v) x[v] = ld(X + j * ldx, Lanes{v * kLanes});
    for (int r = 0; r < kRows; ++r) {
      const float w = W[r * ks + j];
      for (int v = 0; v < NV; ++v) o[r][v] += w * x[v];
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < NV; ++v) st(Out + r * HD, Lanes{v * kLanes}, o[r][v]);
}

// Dt[·][j] += Σ_r W[r][j] · A_r for the keys of `chunks` score vectors, into a transposed
// accumulator Dt [HD][ks] (a vector is sixteen keys of one dimension, so every dimension is
// a chain of its own): Pᵀ·dO into dVᵀ, dSᵀ·Q into dKᵀ. W's entries past a row's last visible
// key are zero.
template <int HD>
CTITAN_KERNEL void accumulate_keys(const float* W, int64_t ks, const float* A, int64_t chunks, float* Dt) {
  for (int64_t c = 0; c < chunks; ++c) {
    const Lanes j{c * kLanes};
    lanes16f w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = ld(W + r * ks, j);
    // Eight dimensions at a time: eight independent chains of kRows products each (one
    // dimension's chain alone would wait on every add).
    for (int d0 = 0; d0 < HD; d0 += 8) {
      lanes16f acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = ld(Dt + (d0 + i) * ks, j);
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < 8; ++i) acc[i] += A[r * HD + d0 + i] * w[r];
      for (int i = 0; i < 8; ++i) st(Dt + (d0 + i) * ks, j, acc[i]);
    }
  }
}

// X[j][d] += alpha · Xt[d][j] for the T rows of one head (leading dimension ld).
CTITAN_KERNEL void add_transposed(const float* Xt, int64_t ks, int64_t T, int64_t hd, float alpha, float* X,
                                  int64_t ld) {
  for (int64_t j = 0; j < T; ++j)
    for (int64_t d = 0; d < hd; ++d) X[j * ld + d] += alpha * Xt[d * ks + j];
}

// Sixteen lanes reduced in a fixed tree (a chain of sixteen dependent adds would wait on each).
inline float lanes_sum(lanes16f v) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}
inline float lanes_max(lanes16f v) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] = v[i + w] > v[i] ? v[i + w] : v[i];
  return v[0];
}

using lanes16i = int32_t __attribute__((vector_size(64)));

// Which lanes of score vector c a row that sees keys [0, vis) sees.
inline lanes16i seen_lanes(int64_t c, int64_t vis) {
  const lanes16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lane < static_cast<int32_t>(vis - c * kLanes);
}

// Score vector c with the lanes a row does not see at −inf.
inline lanes16f visible(const float* row, int64_t c, int64_t vis) {
  const lanes16f v = ld(row, Lanes{c * kLanes});
  return seen_lanes(c, vis) ? v : kernel::splat<lanes16f>(-std::numeric_limits<float>::infinity());
}

// e^x for x <= 0 (a score minus its row's maximum or log-sum-exp), the lanes a row does not
// see at 0: kernel::exp_held's degree 6 (|r| <= ln2/2: relative error below 1.3e-7), x held
// at -87 or above (e^-87 ~ 1.6e-38, the smallest value the exponent trick writes; against a
// row sum of at least 1). Fewer steps than kernel::exp_fast (degree 7, any sign): the
// softmax's exps are the most vector work per score after the products.
inline lanes16f exp_seen(lanes16f x, lanes16i seen) {
  x = x < -87.0f ? kernel::splat<lanes16f>(-87.0f) : x;
  return seen ? kernel::exp_held<6, lanes16f, kernel::lanes16u>(x) : lanes16f{};
}

// Forward softmax of a strip's rows in place: row r (query position t0 + r, r < nr) sees keys
// [0, t0 + r + 1); P = e^(S − m) there and 0 on every other key of its `chunks` vectors; rows
// from nr on are 0. m and l: each row's maximum and sum.
CTITAN_KERNEL void softmax_rows(float* S, int64_t ks, int64_t chunks, int64_t t0, int64_t nr, float* m, float* l) {
  for (int64_t r = 0; r < kRows; ++r) {
    float* row = S + r * ks;
    if (r >= nr) {
      std::fill(row, row + chunks * kLanes, 0.0f);
      continue;
    }
    const int64_t vis = t0 + r + 1;
    lanes16f mx = kernel::splat<lanes16f>(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < chunks; ++c) {
      const lanes16f v = visible(row, c, vis);
      mx = v > mx ? v : mx;
    }
    const float mr = lanes_max(mx);
    lanes16f sum = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const lanes16f p = exp_seen(ld(row, Lanes{c * kLanes}) - mr, seen_lanes(c, vis));
      st(row, Lanes{c * kLanes}, p);
      sum += p;
    }
    m[r] = mr;
    l[r] = lanes_sum(sum);
  }
}

// Backward of a strip's rows in place (rows and keys as softmax_rows): S → P = e^(S − lse),
// DP → dS = P ∘ (dP − Σ P ∘ dP); both 0 on the keys a row does not see and on rows from nr on.
CTITAN_KERNEL void softmax_backward_rows(float* S, float* DP, int64_t ks, int64_t chunks, int64_t t0, int64_t nr,
                                         const float* lse) {
  for (int64_t r = 0; r < kRows; ++r) {
    float *s = S + r * ks, *dp = DP + r * ks;
    if (r >= nr) {
      std::fill(s, s + chunks * kLanes, 0.0f);
      std::fill(dp, dp + chunks * kLanes, 0.0f);
      continue;
    }
    const int64_t vis = t0 + r + 1;
    lanes16f dot = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const lanes16f p = exp_seen(ld(s, Lanes{c * kLanes}) - lse[r], seen_lanes(c, vis));
      st(s, Lanes{c * kLanes}, p);
      dot += p * ld(dp, Lanes{c * kLanes});
    }
    const float D = lanes_sum(dot);
    for (int64_t c = 0; c < chunks; ++c) {
      const Lanes j{c * kLanes};
      st(dp, j, ld(s, j) * (ld(dp, j) - D));  // P = 0 where the key is not seen: dS = 0 there
    }
  }
}

// Rows [t0, t0 + nr) of one head (leading dimension ld) into a kRows × hd block, the rows past
// nr zero.
void load_rows(const float* X, int64_t ld, int64_t t0, int64_t nr, int64_t hd, float* out) {
  for (int64_t r = 0; r < nr; ++r) std::memcpy(out + r * hd, X + (t0 + r) * ld, hd * sizeof(float));
  std::fill(out + nr * hd, out + kRows * hd, 0.0f);
}

// The strip of query rows [t0, t0 + nr) sees keys [0, t0 + nr); its score rows are computed
// for whole vectors of keys.
struct Strip {
  int64_t t0, nr, keys, chunks;
  Strip(int64_t t0_, int64_t T) : t0(t0_), nr(std::min<int64_t>(kRows, T - t0_)), keys(t0 + nr) {
    chunks = (keys + kLanes - 1) / kLanes;
  }
};

template <int HD>
void forward_hd(const Shape& s, float scale, const float* q, const float* k, const float* v, float* out, float* lse) {
  const int64_t T = s.T, H = s.H, KV = s.KV, rep = H / KV, ks = key_stride(T);
  const int64_t ldq = H * HD, ldk = KV * HD;
  // One task per (batch item, query head): equal work, so two threads split the range evenly.
  at::parallel_for(0, s.B * H, 1, [&](int64_t begin, int64_t end) {
    torch::Tensor k1, k2, k3, k4, k5;
    float* Kt = scratch(k1, HD * ks);
    float* Vp = scratch(k5, HD * T);
    float* S = scratch(k2, kRows * ks);
    float* Q = scratch(k3, kRows * HD);
    float* O = scratch(k4, kRows * HD);
    float m[kRows], l[kRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const float* qh = q + b * T * ldq + h * HD;
      const float* kh = k + b * T * ldk + (h / rep) * HD;
      const float* vh = v + b * T * ldk + (h / rep) * HD;
      float* oh = out + b * T * ldq + h * HD;
      float* lse_h = lse + (b * H + h) * T;
      if (task == begin || h % rep == 0) {  // the kv head changed
        transpose_head(kh, ldk, T, HD, Kt, ks);
        pack_head(vh, ldk, T, HD, Vp);
      }
      for (int64_t t0 = 0; t0 < T; t0 += kRows) {
        const Strip strip(t0, T);
        load_rows(qh, ldq, t0, strip.nr, HD, Q);
        row_scores<HD>(Q, Kt, ks, strip.chunks, scale, S);
        softmax_rows(S, ks, strip.chunks, t0, strip.nr, m, l);
        weighted_rows<HD>(S, ks, Vp, HD, strip.keys, O);
        for (int64_t r = 0; r < strip.nr; ++r) {
          const float inv = 1.0f / l[r];
          float* o = oh + (t0 + r) * ldq;
          for (int64_t d = 0; d < HD; ++d) o[d] = O[r * HD + d] * inv;
          lse_h[t0 + r] = m[r] + std::log(l[r]);
        }
      }
    }
  });
}

template <int HD>
void backward_hd(const Shape& s, float scale, const float* q, const float* k, const float* v, const float* dout,
                 const float* lse, float* dq, float* dk, float* dv) {
  const int64_t T = s.T, H = s.H, KV = s.KV, rep = H / KV, ks = key_stride(T);
  const int64_t ldq = H * HD, ldk = KV * HD;
  // One task per (batch item, kv head) with every query head that reads it: its dK and dV
  // rows collect all their terms on one thread, in a fixed order.
  at::parallel_for(0, s.B * KV, 1, [&](int64_t begin, int64_t end) {
    torch::Tensor k1, k2, k3, k4, k5, k6, k7, k8, k9, k10;
    float* Kp = scratch(k10, HD * T);
    float* Kt = scratch(k1, HD * ks);
    float* Vt = scratch(k2, HD * ks);
    float* dKt = scratch(k8, HD * ks);
    float* dVt = scratch(k9, HD * ks);
    float* S = scratch(k3, kRows * ks);
    float* DP = scratch(k4, kRows * ks);
    float* Q = scratch(k5, kRows * HD);
    float* DO = scratch(k6, kRows * HD);
    float* DQ = scratch(k7, kRows * HD);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, kvh = task % KV;
      const int64_t koff = b * T * ldk + kvh * HD;
      transpose_head(k + koff, ldk, T, HD, Kt, ks);
      transpose_head(v + koff, ldk, T, HD, Vt, ks);
      pack_head(k + koff, ldk, T, HD, Kp);
      std::fill(dKt, dKt + HD * ks, 0.0f);
      std::fill(dVt, dVt + HD * ks, 0.0f);
      for (int64_t h = kvh * rep; h < (kvh + 1) * rep; ++h) {
        const int64_t qoff = b * T * ldq + h * HD;
        const float* lse_h = lse + (b * H + h) * T;
        for (int64_t t0 = 0; t0 < T; t0 += kRows) {
          const Strip strip(t0, T);
          load_rows(q + qoff, ldq, t0, strip.nr, HD, Q);
          load_rows(dout + qoff, ldq, t0, strip.nr, HD, DO);
          row_scores_pair<HD>(Q, Kt, DO, Vt, ks, strip.chunks, scale, S, DP);
          softmax_backward_rows(S, DP, ks, strip.chunks, t0, strip.nr, lse_h + t0);
          weighted_rows<HD>(DP, ks, Kp, HD, strip.keys, DQ);
          for (int64_t r = 0; r < strip.nr; ++r) {
            float* o = dq + qoff + (t0 + r) * ldq;
            for (int64_t d = 0; d < HD; ++d) o[d] = DQ[r * HD + d] * scale;
          }
          accumulate_keys<HD>(S, ks, DO, strip.chunks, dVt);
          accumulate_keys<HD>(DP, ks, Q, strip.chunks, dKt);
        }
      }
      add_transposed(dVt, ks, T, HD, 1.0f, dv + koff, ldk);
      add_transposed(dKt, ks, T, HD, scale, dk + koff, ldk);
    }
  });
}

}  // namespace

bool takes(int64_t head_dim) { return head_dim == 16 || head_dim == 32 || head_dim == 64; }

int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 20;
  }();
  return bytes;
}

// A backward task's transposed keys and values and their gradient accumulators.
int64_t working_set_bytes(int64_t head_dim, int64_t T) {
  return 4 * head_dim * round_up(T, kLanes) * static_cast<int64_t>(sizeof(float));
}

bool wide_vectors() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
#else
  return false;
#endif
}

bool preferred(int64_t head_dim, int64_t T) {
  return takes(head_dim) && wide_vectors() && working_set_bytes(head_dim, T) <= l2_bytes() / 2;
}

void forward(const Shape& s, double scale, const float* q, const float* k, const float* v, float* out, float* lse) {
  RECORD_FUNCTION("ctitan::attention_direct_forward", std::vector<c10::IValue>());
  const auto f = static_cast<float>(scale);
  switch (s.hd) {
    case 16: return forward_hd<16>(s, f, q, k, v, out, lse);
    case 32: return forward_hd<32>(s, f, q, k, v, out, lse);
    case 64: return forward_hd<64>(s, f, q, k, v, out, lse);
    default: TORCH_CHECK(false, "[models] attention_direct: head dim ", s.hd, " not taken");
  }
}

void backward(const Shape& s, double scale, const float* q, const float* k, const float* v, const float* dout,
              const float* lse, float* dq, float* dk, float* dv) {
  RECORD_FUNCTION("ctitan::attention_direct_backward", std::vector<c10::IValue>());
  const auto f = static_cast<float>(scale);
  switch (s.hd) {
    case 16: return backward_hd<16>(s, f, q, k, v, dout, lse, dq, dk, dv);
    case 32: return backward_hd<32>(s, f, q, k, v, dout, lse, dq, dk, dv);
    case 64: return backward_hd<64>(s, f, q, k, v, dout, lse, dq, dk, dv);
    default: TORCH_CHECK(false, "[models] attention_direct: head dim ", s.hd, " not taken");
  }
}

}  // namespace ctitan::attention_direct
