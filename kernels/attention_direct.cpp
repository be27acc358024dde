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

// A register geometry of the kernels: L float lanes per vector, R query rows per strip (the
// register block of every loop below), at most A vector accumulators in weighted_rows' block
// (R rows × some of the head's vectors), KD dimensions per block of the backward's key
// gradients (accumulate_keys), whether the backward's two score strips are computed in one
// pass (2R accumulators) or one after the other, SR rows per register block of the backward's
// row_scores and weighted_rows (Sub: the strip's rows SR at a time), and KC score vectors per
// register block of accumulate_keys.
template <int L, int R, int A, int KD, bool PAIR, int SR = R, int KC = 1>
struct Geometry {
  static constexpr int kLanes = L, kRows = R, kAcc = A, kKeyDims = KD, kKeyChunks = KC;
  static constexpr bool kPairScores = PAIR;
  using Sub = Geometry<L, SR, A, KD, PAIR, SR, KC>;
  typedef float V __attribute__((vector_size(4 * L)));
  typedef int32_t I __attribute__((vector_size(4 * L)));
  typedef uint32_t U __attribute__((vector_size(4 * L)));
};
// AVX-512's 32 zmm registers: sixteen keys per score vector, eight rows (row_scores_pair
// holds sixteen accumulators, weighted_rows up to 8 × 4, accumulate_keys 8 + 8).
using Wide = Geometry<16, 8, 32, 8, true>;
// AVX2's sixteen ymm registers: eight keys per vector. The forward takes four rows,
// weighted_rows in blocks of 4 × 2 and row_scores two vectors at a time (eight chains for the
// two FMA pipes). The backward takes eight rows: every pass over the head's transposed keys,
// values and key gradients (in the L2, not the L1, from head dim 32 on) then does twice the
// products per load. Its blocks: row_scores 8 × 1 (for S, then for dP), weighted_rows 8 × 1,
// accumulate_keys 8 row vectors + 4 accumulators. Against four rows, calls alternating in one
// process on a Zen 3 (min of 30, 2 threads): backward 29.0 → 25.4 ms at head dim 64 (4×512),
// 35.7 → 27.5 at 32 (8×512), 117 → 99 at 64 (1×2048) (docs/performance.md); the forward ran
// 5-10% slower with eight rows. The sums per element run in the same order either way, so the
// results are bitwise the same.
// Within the backward's eight-row strip, row_scores and weighted_rows take four rows at a time
// (the forward's 4 × 2 blocks: 6 loads per 8 FMAs against 9 with 8 × 1), and accumulate_keys
// blocks of 4 dimensions × 2 score vectors (8 accumulators whose row products reuse each
// loaded key vector 4 times and each broadcast twice; with 1 vector: 36 loads per 32 FMAs, the
// load ports the limit). Against 8 × 1 blocks (calls alternating in one process on a Zen 3,
// min of 40, 2 threads, two runs): backward 28.3 → 23.4 and 35.5 → 31.4 ms at head dim 64
// (4×512), 29.0 → 24.6 and 33.6 → 32.4 at 16 (8×512); bitwise the same (docs/performance.md).
using Narrow = Geometry<8, 4, 8, 8, true>;
using NarrowBackward = Geometry<8, 8, 8, 4, false, 4, 2>;

constexpr int kLineFloats = 16;  // floats per 64-byte cache line

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The row stride of every [rows][keys] scratch (transposed heads, score strips): the keys
// rounded up to whole cache lines (whole vectors of either geometry), then to an odd number of
// them, so that the rows one vector loop walks fall into different cache sets (with a stride
// of 512 keys, 2 KiB, sixteen rows would share two of a 48 KiB L1's 64 sets).
int64_t key_stride(int64_t T) {
  const int64_t t = round_up(T, kLineFloats);
  return (t / kLineFloats) % 2 == 0 ? t + kLineFloats : t;
}

template <class G>
inline typename G::V vld(const float* p) {
  typename G::V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class G>
inline void vst(float* p, typename G::V v) {
  std::memcpy(p, &v, sizeof v);
}
template <class G>
inline typename G::V vsplat(float c) {
  return typename G::V{} + c;
}

// A worker's scratch, from the caching CPU allocator (no page faults per call).
float* scratch(torch::Tensor& keep, int64_t n) {
  keep = torch::empty({std::max<int64_t>(n, 1)}, torch::kFloat);
  return keep.data_ptr<float>();
}

typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));

// An 8 × 8 block transposed in registers: r[i] holds row i, then column i.
inline void transpose8(F8 r[8]) {
  F8 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // rows 2i and 2i+1 interleaved: pairs of columns
    t[2 * i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], I8{0, 8, 1, 9, 4, 12, 5, 13});
    t[2 * i + 1] = __builtin_shuffle(r[2 * i], r[2 * i + 1], I8{2, 10, 3, 11, 6, 14, 7, 15});
  }
  for (int i = 0; i < 2; ++i)  // four rows' columns k and k + 4 in each of u[4i .. 4i + 3]
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = __builtin_shuffle(t[4 * i + h], t[4 * i + 2 + h], I8{0, 1, 8, 9, 4, 5, 12, 13});
      u[4 * i + 2 * h + 1] = __builtin_shuffle(t[4 * i + h], t[4 * i + 2 + h], I8{2, 3, 10, 11, 6, 7, 14, 15});
    }
  for (int k = 0; k < 4; ++k) {
    r[k] = __builtin_shuffle(u[k], u[4 + k], I8{0, 1, 2, 3, 8, 9, 10, 11});
    r[k + 4] = __builtin_shuffle(u[k], u[4 + k], I8{4, 5, 6, 7, 12, 13, 14, 15});
  }
}

// For the 8 × 8 blocks (j, d) of rows j < T rounded down to 8 and dimensions d < hd: load(j, d,
// r) fills r with eight vectors, which are transposed and handed to store(j, d, r).
template <class Load, class Store>
inline void transposed_blocks(int64_t T, int64_t hd, Load load, Store store) {
  for (int64_t j = 0; j + 8 <= T; j += 8)
    for (int64_t d = 0; d < hd; d += 8) {
      F8 r[8];
      load(j, d, r);
      transpose8(r);
      store(j, d, r);
    }
}

// Xt[d][j] = X[j][d] for the T rows of one head (leading dimension ld), zero for j in [T, ks):
// a score vector is then consecutive keys of one dimension. In 8 × 8 blocks through registers
// (hd is a multiple of 8); one element at a time it took ~5% of a forward + backward.
CTITAN_KERNEL void transpose_head(const float* X, int64_t ld, int64_t T, int64_t hd, float* Xt, int64_t ks) {
  transposed_blocks(
      T, hd,
      [&](int64_t j, int64_t d, F8* r) {
        for (int i = 0; i < 8; ++i) std::memcpy(&r[i], X + (j + i) * ld + d, sizeof r[i]);
      },
      [&](int64_t j, int64_t d, const F8* r) {
        for (int i = 0; i < 8; ++i) std::memcpy(Xt + (d + i) * ks + j, &r[i], sizeof r[i]);
      });
  for (int64_t j = T / 8 * 8; j < T; ++j)
    for (int64_t d = 0; d < hd; ++d) Xt[d * ks + j] = X[j * ld + d];
  for (int64_t d = 0; d < hd; ++d) std::fill(Xt + d * ks + T, Xt + (d + 1) * ks, 0.0f);
}

// The T rows of one head (leading dimension ld) packed together: read in place, rows KV·hd
// floats apart would share a few cache sets (512 bytes apart in the debug model: 8 of a
// 48 KiB L1's 64 sets).
void pack_head(const float* X, int64_t ld, int64_t T, int64_t hd, float* out) {
  for (int64_t j = 0; j < T; ++j) std::memcpy(out + j * hd, X + j * ld, hd * sizeof(float));
}

// S[r][j] = scale · a_r · Bt[·][j] for the rows of A and CB score vectors from vector c on.
template <class G, int HD, int CB>
inline void scores_block(const float* A, const float* Bt, int64_t ks, int64_t c, float scale, float* S) {
  using V = typename G::V;
  constexpr int R = G::kRows, L = G::kLanes;
  V acc[R][CB] = {};
  for (int d = 0; d < HD; ++d) {
    V b[CB];
    for (int i = 0; i < CB; ++i) b[i] = vld<G>(Bt + d * ks + (c + i) * L);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < CB; ++i) acc[r][i] += A[r * HD + d] * b[i];
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < CB; ++i) vst<G>(S + r * ks + (c + i) * L, acc[r][i] * scale);
}

// S[r][j] = scale · a_r · Bt[·][j] for the kRows rows of A (kRows × HD, contiguous) and the
// keys of `chunks` score vectors.
template <class G, int HD>
CTITAN_KERNEL void row_scores(const float* A, const float* Bt, int64_t ks, int64_t chunks, float scale, float* S) {
  constexpr int CB = G::kRows >= 8 ? 1 : 8 / G::kRows;  // eight independent chains
  int64_t c = 0;
  for (; c + CB <= chunks; c += CB) scores_block<G, HD, CB>(A, Bt, ks, c, scale, S);
  for (; c < chunks; ++c) scores_block<G, HD, 1>(A, Bt, ks, c, scale, S);
}

// The backward's two score strips in one pass: S = scale · q kᵀ and dP = dO vᵀ.
template <class G, int HD>
CTITAN_KERNEL void row_scores_pair(const float* Q, const float* Kt, const float* DO, const float* Vt, int64_t ks,
                                   int64_t chunks, float scale, float* S, float* DP) {
  using V = typename G::V;
  constexpr int R = G::kRows, L = G::kLanes;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j = c * L;
    V s[R] = {}, p[R] = {};
    for (int d = 0; d < HD; ++d) {
      const V kd = vld<G>(Kt + d * ks + j), vd = vld<G>(Vt + d * ks + j);
      for (int r = 0; r < R; ++r) {
        s[r] += Q[r * HD + d] * kd;
        p[r] += DO[r * HD + d] * vd;
      }
    }
    for (int r = 0; r < R; ++r) {
      vst<G>(S + r * ks + j, s[r] * scale);
      vst<G>(DP + r * ks + j, p[r]);
    }
  }
}

// Out[r] = Σ_j W[r][j] · X_j over keys j < n (rows of X with leading dimension ldx): P·V in
// the forward, dS·K in the backward. The head's vectors in blocks of at most kAcc / kRows.
template <class G, int HD>
CTITAN_KERNEL void weighted_rows(const float* W, int64_t ks, const float* X, int64_t ldx, int64_t n, float* Out) {
  using V = typename G::V;
  constexpr int R = G::kRows, L = G::kLanes, NV = HD / L;
  constexpr int DB = NV < G::kAcc / R ? NV : G::kAcc / R;
  static_assert(NV % DB == 0, "weighted_rows: whole blocks");
  for (int v0 = 0; v0 < NV; v0 += DB) {
    V o[R][DB] = {};
    for (int64_t j = 0; j < n; ++j) {
      V x[DB];
      for (int v = 0; v < DB; ++v) x[v] = vld<G>(X + j * ldx + (v0 + v) * L);
      for (int r = 0; r < R; ++r) {
        const float w = W[r * ks + j];
        for (int v = 0; v < DB; ++v) o[r][v] += w * x[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < DB; ++v) vst<G>(Out + r * HD + (v0 + v) * L, o[r][v]);
  }
}

// accumulate_keys on the C score vectors from vector c on, kKeyDims dimensions at a time.
template <class G, int HD, int C>
inline void key_block(const float* W, int64_t ks, const float* A, int64_t c, float* Dt) {
  using V = typename G::V;
  constexpr int R = G::kRows, L = G::kLanes, D = G::kKeyDims;
  for (int d0 = 0; d0 < HD; d0 += D) {
    V acc[D][C];
    for (int i = 0; i < D; ++i)
      for (int k = 0; k < C; ++k) acc[i][k] = vld<G>(Dt + (d0 + i) * ks + (c + k) * L);
    for (int r = 0; r < R; ++r) {
      V w[C];
      for (int k = 0; k < C; ++k) w[k] = vld<G>(W + r * ks + (c + k) * L);
      for (int i = 0; i < D; ++i) {
        const float a = A[r * HD + d0 + i];
        for (int k = 0; k < C; ++k) acc[i][k] += a * w[k];
      }
    }
    for (int i = 0; i < D; ++i)
      for (int k = 0; k < C; ++k) vst<G>(Dt + (d0 + i) * ks + (c + k) * L, acc[i][k]);
  }
}

// Dt[·][j] += Σ_r W[r][j] · A_r for the keys of `chunks` score vectors, into a transposed
// accumulator Dt [HD][ks] (a vector is consecutive keys of one dimension, so every dimension
// is a chain of its own): Pᵀ·dO into dVᵀ, dSᵀ·Q into dKᵀ. W's entries past a row's last
// visible key are zero.
// Each element's terms are added in row order, whatever the blocks.
template <class G, int HD>
CTITAN_KERNEL void accumulate_keys(const float* W, int64_t ks, const float* A, int64_t chunks, float* Dt) {
  using V = typename G::V;
  constexpr int R = G::kRows, L = G::kLanes, D = G::kKeyDims, C = G::kKeyChunks;
  static_assert(HD % D == 0, "accumulate_keys: whole blocks");
  if constexpr (C > 1) {
    int64_t c = 0;
    for (; c + C <= chunks; c += C) key_block<G, HD, C>(W, ks, A, c, Dt);
    for (; c < chunks; ++c) key_block<G, HD, 1>(W, ks, A, c, Dt);
    return;
  }
  // One score vector at a time: its kRows row vectors stay in registers across the dimension
  // blocks (AVX-512's 32 registers hold 8 of them and 8 accumulators).
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j = c * L;
    V w[R];
    for (int r = 0; r < R; ++r) w[r] = vld<G>(W + r * ks + j);
    for (int d0 = 0; d0 < HD; d0 += D) {
      V acc[D];
      for (int i = 0; i < D; ++i) acc[i] = vld<G>(Dt + (d0 + i) * ks + j);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < D; ++i) acc[i] += A[r * HD + d0 + i] * w[r];
      for (int i = 0; i < D; ++i) vst<G>(Dt + (d0 + i) * ks + j, acc[i]);
    }
  }
}

// X[j][d] += alpha · Xt[d][j] for the T rows of one head (leading dimension ld), in 8 × 8
// blocks as transpose_head.
CTITAN_KERNEL void add_transposed(const float* Xt, int64_t ks, int64_t T, int64_t hd, float alpha, float* X,
                                  int64_t ld) {
  transposed_blocks(
      T, hd,
      [&](int64_t j, int64_t d, F8* r) {
        for (int i = 0; i < 8; ++i) std::memcpy(&r[i], Xt + (d + i) * ks + j, sizeof r[i]);
      },
      [&](int64_t j, int64_t d, const F8* r) {
        for (int i = 0; i < 8; ++i) {
          F8 x;
          std::memcpy(&x, X + (j + i) * ld + d, sizeof x);
          x += alpha * r[i];
          std::memcpy(X + (j + i) * ld + d, &x, sizeof x);
        }
      });
  for (int64_t j = T / 8 * 8; j < T; ++j)
    for (int64_t d = 0; d < hd; ++d) X[j * ld + d] += alpha * Xt[d * ks + j];
}

// The lanes reduced in a fixed tree (a chain of dependent adds would wait on each).
template <class G>
inline float lanes_sum(typename G::V v) {
  for (int w = G::kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] += v[i + w];
  return v[0];
}
template <class G>
inline float lanes_max(typename G::V v) {
  for (int w = G::kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] = v[i + w] > v[i] ? v[i + w] : v[i];
  return v[0];
}

// Which lanes of score vector c a row that sees keys [0, vis) sees.
template <class G>
inline typename G::I seen_lanes(int64_t c, int64_t vis) {
  typename G::I lane;
  for (int i = 0; i < G::kLanes; ++i) lane[i] = i;
  return lane < static_cast<int32_t>(vis - c * G::kLanes);
}

// Score vector c with the lanes a row does not see at −inf.
template <class G>
inline typename G::V visible(const float* row, int64_t c, int64_t vis) {
  const auto v = vld<G>(row + c * G::kLanes);
  return seen_lanes<G>(c, vis) ? v : vsplat<G>(-std::numeric_limits<float>::infinity());
}

// e^x for x <= 0 (a score minus its row's maximum or log-sum-exp), the lanes a row does not
// see at 0: kernel::exp_held's degree 6 (|r| <= ln2/2: relative error below 1.3e-7), x held
// at -87 or above (e^-87 ~ 1.6e-38, the smallest value the exponent trick writes; against a
// row sum of at least 1). Fewer steps than kernel::exp_fast (degree 7, any sign): the
// softmax's exps are the most vector work per score after the products.
template <class G>
inline typename G::V exp_seen(typename G::V x, typename G::I seen) {
  x = x < -87.0f ? vsplat<G>(-87.0f) : x;
  return seen ? kernel::exp_held<6, typename G::V, typename G::U>(x) : typename G::V{};
}

// Forward softmax of a strip's rows in place: row r (query position t0 + r, r < nr) sees keys
// [0, t0 + r + 1); P = e^(S − m) there and 0 on every other key of its `chunks` vectors; rows
// from nr on are 0. m and l: each row's maximum and sum.
template <class G>
CTITAN_KERNEL void softmax_rows(float* S, int64_t ks, int64_t chunks, int64_t t0, int64_t nr, float* m, float* l) {
  using V = typename G::V;
  constexpr int L = G::kLanes;
  for (int64_t r = 0; r < G::kRows; ++r) {
    float* row = S + r * ks;
    if (r >= nr) {
      std::fill(row, row + chunks * L, 0.0f);
      continue;
    }
    const int64_t vis = t0 + r + 1;
    V mx = vsplat<G>(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < chunks; ++c) {
      const V v = visible<G>(row, c, vis);
      mx = v > mx ? v : mx;
    }
    const float mr = lanes_max<G>(mx);
    V sum = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const V p = exp_seen<G>(vld<G>(row + c * L) - mr, seen_lanes<G>(c, vis));
      vst<G>(row + c * L, p);
      sum += p;
    }
    m[r] = mr;
    l[r] = lanes_sum<G>(sum);
  }
}

// Backward of a strip's rows in place (rows and keys as softmax_rows): S → P = e^(S − lse),
// DP → dS = P ∘ (dP − Σ P ∘ dP); both 0 on the keys a row does not see and on rows from nr on.
template <class G>
CTITAN_KERNEL void softmax_backward_rows(float* S, float* DP, int64_t ks, int64_t chunks, int64_t t0, int64_t nr,
                                         const float* lse) {
  using V = typename G::V;
  constexpr int L = G::kLanes;
  for (int64_t r = 0; r < G::kRows; ++r) {
    float *s = S + r * ks, *dp = DP + r * ks;
    if (r >= nr) {
      std::fill(s, s + chunks * L, 0.0f);
      std::fill(dp, dp + chunks * L, 0.0f);
      continue;
    }
    const int64_t vis = t0 + r + 1;
    V dot = {};
    for (int64_t c = 0; c < chunks; ++c) {
      const V p = exp_seen<G>(vld<G>(s + c * L) - lse[r], seen_lanes<G>(c, vis));
      vst<G>(s + c * L, p);
      dot += p * vld<G>(dp + c * L);
    }
    const float D = lanes_sum<G>(dot);
    for (int64_t c = 0; c < chunks; ++c) {  // P = 0 where the key is not seen: dS = 0 there
      vst<G>(dp + c * L, vld<G>(s + c * L) * (vld<G>(dp + c * L) - D));
    }
  }
}

// Rows [t0, t0 + nr) of one head (leading dimension ld) into a kRows × hd block, the rows past
// nr zero.
void load_rows(const float* X, int64_t ld, int64_t t0, int64_t nr, int64_t hd, int64_t rows, float* out) {
  for (int64_t r = 0; r < nr; ++r) std::memcpy(out + r * hd, X + (t0 + r) * ld, hd * sizeof(float));
  std::fill(out + nr * hd, out + rows * hd, 0.0f);
}

// Rows [t0, t1) of one head (leading dimension ld), hd floats each, asked into the cache ahead
// of use (RW 1: to be written). The forward's query and output rows lie ld floats apart, one
// or a few cache lines each, and come cold from the projections in a training step. With 8
// lanes the forward asks for the next strip's rows while this one computes: on the Zen 3
// (calls alternating in one process, min of 40-60, caches flushed or not) it took 2-9% less
// time in eight runs at head dim 64 (4×512: 12.39 → 11.51 ms, say) and 5-20% less in four at
// 16 (8×512); results bitwise the same. Not measured with 16 lanes (no AVX-512 machine since),
// so that geometry does not. The backward computes longer per strip; there the same measured
// within its noise (one run of six slower), so it has none.
template <int RW>
inline void prefetch_rows(const float* X, int64_t ld, int64_t t0, int64_t t1, int64_t hd) {
  for (int64_t r = t0; r < t1; ++r)
    for (int64_t d = 0; d < hd; d += kLineFloats) __builtin_prefetch(X + r * ld + d, RW);
}

// The strip of query rows [t0, t0 + nr) sees keys [0, t0 + nr); its score rows are computed
// for whole vectors of keys.
template <class G>
struct Strip {
  int64_t t0, nr, keys, chunks;
  Strip(int64_t t0_, int64_t T) : t0(t0_), nr(std::min<int64_t>(G::kRows, T - t0_)), keys(t0 + nr) {
    chunks = (keys + G::kLanes - 1) / G::kLanes;
  }
};

template <class G, int HD>
void forward_hd(const Shape& s, float scale, const float* q, const float* k, const float* v, float* out, float* lse) {
  constexpr int R = G::kRows;
  const int64_t T = s.T, H = s.H, KV = s.KV, rep = H / KV, ks = key_stride(T);
  const int64_t ldq = H * HD, ldk = KV * HD;
  // One task per (batch item, query head): equal work, so two threads split the range evenly.
  at::parallel_for(0, s.B * H, 1, [&](int64_t begin, int64_t end) {
    torch::Tensor k1, k2, k3, k4, k5;
    float* Kt = scratch(k1, HD * ks);
    float* Vp = scratch(k5, HD * T);
    float* S = scratch(k2, R * ks);
    float* Q = scratch(k3, R * HD);
    float* O = scratch(k4, R * HD);
    float m[R], l[R];
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
      for (int64_t t0 = 0; t0 < T; t0 += R) {
        const Strip<G> strip(t0, T);
        load_rows(qh, ldq, t0, strip.nr, HD, R, Q);
        if constexpr (G::kLanes == 8) {
          const int64_t next = std::min(t0 + 2 * R, T);
          prefetch_rows<0>(qh, ldq, t0 + R, next, HD);
          prefetch_rows<1>(oh, ldq, t0 + R, next, HD);
        }
        row_scores<G, HD>(Q, Kt, ks, strip.chunks, scale, S);
        softmax_rows<G>(S, ks, strip.chunks, t0, strip.nr, m, l);
        weighted_rows<G, HD>(S, ks, Vp, HD, strip.keys, O);
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

template <class G, int HD>
void backward_hd(const Shape& s, float scale, const float* q, const float* k, const float* v, const float* dout,
                 const float* lse, float* dq, float* dk, float* dv) {
  constexpr int R = G::kRows;
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
    float* S = scratch(k3, R * ks);
    float* DP = scratch(k4, R * ks);
    float* Q = scratch(k5, R * HD);
    float* DO = scratch(k6, R * HD);
    float* DQ = scratch(k7, R * HD);
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
        for (int64_t t0 = 0; t0 < T; t0 += R) {
          const Strip<G> strip(t0, T);
          load_rows(q + qoff, ldq, t0, strip.nr, HD, R, Q);
          load_rows(dout + qoff, ldq, t0, strip.nr, HD, R, DO);
          if constexpr (G::kPairScores) {
            row_scores_pair<G, HD>(Q, Kt, DO, Vt, ks, strip.chunks, scale, S, DP);
          } else {  // the same products, one strip after the other
            using Sub = typename G::Sub;
            for (int r0 = 0; r0 < R; r0 += Sub::kRows) {
              row_scores<Sub, HD>(Q + r0 * HD, Kt, ks, strip.chunks, scale, S + r0 * ks);
              row_scores<Sub, HD>(DO + r0 * HD, Vt, ks, strip.chunks, 1.0f, DP + r0 * ks);
            }
          }
          softmax_backward_rows<G>(S, DP, ks, strip.chunks, t0, strip.nr, lse_h + t0);
          for (int r0 = 0; r0 < R; r0 += G::Sub::kRows)
            weighted_rows<typename G::Sub, HD>(DP + r0 * ks, ks, Kp, HD, strip.keys, DQ + r0 * HD);
          for (int64_t r = 0; r < strip.nr; ++r) {
            float* o = dq + qoff + (t0 + r) * ldq;
            for (int64_t d = 0; d < HD; ++d) o[d] = DQ[r * HD + d] * scale;
          }
          accumulate_keys<G, HD>(S, ks, DO, strip.chunks, dVt);
          accumulate_keys<G, HD>(DP, ks, Q, strip.chunks, dKt);
        }
      }
      add_transposed(dVt, ks, T, HD, 1.0f, dv + koff, ldk);
      add_transposed(dKt, ks, T, HD, scale, dk + koff, ldk);
    }
  });
}

// The geometry a call runs: lanes 16 or 8 forced, 0 the CPU's.
bool wide_geometry(int lanes) {
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "[models] attention_direct: lanes ", lanes, " (0, 8 or 16)");
  return lanes == 16 || (lanes == 0 && wide_vectors());
}

template <class G>
void forward_geometry(const Shape& s, float f, const float* q, const float* k, const float* v, float* out, float* lse) {
  switch (s.hd) {
    case 16: return forward_hd<G, 16>(s, f, q, k, v, out, lse);
    case 32: return forward_hd<G, 32>(s, f, q, k, v, out, lse);
    case 64: return forward_hd<G, 64>(s, f, q, k, v, out, lse);
    default: TORCH_CHECK(false, "[models] attention_direct: head dim ", s.hd, " not taken");
  }
}

template <class G>
void backward_geometry(const Shape& s, float f, const float* q, const float* k, const float* v, const float* dout,
                       const float* lse, float* dq, float* dk, float* dv) {
  switch (s.hd) {
    case 16: return backward_hd<G, 16>(s, f, q, k, v, dout, lse, dq, dk, dv);
    case 32: return backward_hd<G, 32>(s, f, q, k, v, dout, lse, dq, dk, dv);
    case 64: return backward_hd<G, 64>(s, f, q, k, v, dout, lse, dq, dk, dv);
    default: TORCH_CHECK(false, "[models] attention_direct: head dim ", s.hd, " not taken");
  }
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
  return 4 * head_dim * round_up(T, kLineFloats) * static_cast<int64_t>(sizeof(float));
}

bool wide_vectors() { return kernel::wide_lanes(); }

bool avx2_vectors() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}

int64_t working_set_limit_bytes(int64_t head_dim) {
  if (wide_vectors()) return l2_bytes() * 32 / std::max<int64_t>(head_dim, 1);
  if (avx2_vectors()) return 8 * l2_bytes();
  return 0;
}

bool preferred(int64_t head_dim, int64_t T) {
  return takes(head_dim) && working_set_bytes(head_dim, T) <= working_set_limit_bytes(head_dim);
}

void forward(const Shape& s, double scale, const float* q, const float* k, const float* v, float* out, float* lse,
             int lanes) {
  RECORD_FUNCTION("ctitan::attention_direct_forward", std::vector<c10::IValue>());
  const auto f = static_cast<float>(scale);
  if (wide_geometry(lanes)) return forward_geometry<Wide>(s, f, q, k, v, out, lse);
  return forward_geometry<Narrow>(s, f, q, k, v, out, lse);
}

void backward(const Shape& s, double scale, const float* q, const float* k, const float* v, const float* dout,
              const float* lse, float* dq, float* dk, float* dv, int lanes) {
  RECORD_FUNCTION("ctitan::attention_direct_backward", std::vector<c10::IValue>());
  const auto f = static_cast<float>(scale);
  if (wide_geometry(lanes)) return backward_geometry<Wide>(s, f, q, k, v, dout, lse, dq, dk, dv);
  return backward_geometry<NarrowBackward>(s, f, q, k, v, dout, lse, dq, dk, dv);
}

}  // namespace ctitan::attention_direct
