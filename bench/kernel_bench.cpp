// ctitan's own kernels against what LibTorch itself offers for the same layer, forward +
// backward, on the shapes of the 33M model (dim 512, 8 heads, 4 kv heads, vocab 8192) at
// seq 512 × batch 4 and seq 2048 × batch 1, fp32 and bf16, same threads, same process:
//
//   attention  flash_causal_attention      vs at::scaled_dot_product_attention (causal, GQA)
//   rms_norm   fused_rms_norm              vs at::rms_norm
//   rope       fused_rotary_emb            vs the complex-multiply formula (torchtitan's)
//   swiglu     fused_swiglu                vs at::silu(a) * b
//   xent       fused_cross_entropy         vs at::cross_entropy on float32 logits
//   adamw      ctitan's AdamW step         vs at::_fused_adamw_ (torch.optim.AdamW(fused=True))
//
// Each pair runs alternately (ctitan, ATen, ctitan, ATen, ...), the median of each side is
// kept, and the outputs are compared (max |Δ| relative to max |ATen output|), so a faster
// kernel that computes something else shows up. Prints a Markdown table.
//
//   ./build/kernel_bench [reps]        (bench/perf.sh PARTS=kernels runs it)
//   ./build/kernel_bench 5 direct [16|8]  (the direct attention table alone; 16 or 8 lanes forced)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "components/optimizer.h"
#include "kernels/attention_direct.h"
#include "kernels/flash_attention.h"
#include "kernels/fused_ops.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Pair {
  double ctitan_ms = 0, aten_ms = 0;
};

// Runs both sides `reps` times, alternately, after one warm-up each.
Pair time_pair(const std::function<void()>& ours, const std::function<void()>& theirs, int reps) {
  ours();
  theirs();
  std::vector<double> a, b;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    ours();
    auto t1 = Clock::now();
    theirs();
    auto t2 = Clock::now();
    a.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    b.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  return {median(a), median(b)};
}

double rel_diff(const torch::Tensor& ours, const torch::Tensor& ref) {
  const auto r = ref.to(torch::kFloat64);
  const double scale = std::max(r.abs().max().item<double>(), 1e-30);
  return (ours.to(torch::kFloat64) - r).abs().max().item<double>() / scale;
}

// extra: one more column's text (none if null).
void row(const std::string& kernel, const std::string& shape, torch::ScalarType dt, const Pair& p, double diff,
         const char* extra = nullptr) {
  std::printf("| %s | %s | %s | %.2f | %.2f | **%.2fx** | %.1e |%s%s\n", kernel.c_str(), shape.c_str(),
              dt == torch::kBFloat16 ? "bf16" : "fp32", p.ctitan_ms, p.aten_ms, p.aten_ms / p.ctitan_ms, diff,
              extra ? " " : "", extra ? (std::string(extra) + " |").c_str() : "");
  std::fflush(stdout);
}

// Forward + backward of f on leaf copies of `inputs` with upstream gradient `gy`; returns
// the output followed by every input's gradient.
std::vector<torch::Tensor> fwd_bwd(const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& f,
                                   const std::vector<torch::Tensor>& inputs, const torch::Tensor& gy) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().requires_grad_(true));
  auto y = f(leaves);
  if (gy.defined())
    y.backward(gy);
  else
    y.backward();
  std::vector<torch::Tensor> out{y.detach()};
  for (const auto& l : leaves) out.push_back(l.grad());
  return out;
}

void bench_layer(const std::string& name, const std::string& shape, torch::ScalarType dt,
                 const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& ours,
                 const std::function<torch::Tensor(const std::vector<torch::Tensor>&)>& theirs,
                 const std::vector<torch::Tensor>& inputs, const torch::Tensor& gy, int reps,
                 const char* extra = nullptr) {
  const auto a = fwd_bwd(ours, inputs, gy);
  const auto b = fwd_bwd(theirs, inputs, gy);
  double diff = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].defined() && b[i].defined()) diff = std::max(diff, rel_diff(a[i], b[i]));
  const Pair p = time_pair([&] { fwd_bwd(ours, inputs, gy); }, [&] { fwd_bwd(theirs, inputs, gy); }, reps);
  row(name, shape, dt, p, diff, extra);
}

torch::Tensor rope_complex(const torch::Tensor& x, const torch::Tensor& freqs_cis) {
  // x [B, T, h, hd] as hd/2 complex pairs times (cos + i sin), torchtitan's apply_rotary_emb.
  const auto T = x.size(1);
  auto xc = torch::view_as_complex(x.to(torch::kFloat32).reshape({x.size(0), T, x.size(2), -1, 2}));
  auto f = torch::view_as_complex(freqs_cis.slice(0, 0, T).contiguous()).view({1, T, 1, -1});
  return torch::view_as_real(xc * f).flatten(3).to(x.scalar_type());
}

// Causal GQA attention [B, T, heads, hd]: ctitan's fused kernel against ATen's SDPA.
void bench_attention(const std::string& name, const std::string& shape, at::ScalarType dt, int64_t B, int64_t T,
                     int64_t H, int64_t KV, int64_t hd, int reps) {
  const auto opts = torch::TensorOptions().dtype(dt);
  const auto q = torch::randn({B, T, H, hd}, opts), k = torch::randn({B, T, KV, hd}, opts),
             v = torch::randn({B, T, KV, hd}, opts), go = torch::randn({B, T, H, hd}, opts);
  bench_layer(
      name, shape, dt, [](const auto& in) { return ctitan::flash_causal_attention(in[0], in[1], in[2]); },
      [](const auto& in) {
        return at::scaled_dot_product_attention(in[0].transpose(1, 2), in[1].transpose(1, 2), in[2].transpose(1, 2), {},
                                                0.0, /*is_causal=*/true, std::nullopt, /*enable_gqa=*/true)
            .transpose(1, 2);
      },
      {q, k, v}, go, reps);
}

// float32 attention two ways inside ctitan: the direct kernels (kernels/attention_direct.h) that
// flash_causal_attention runs for the heads they take, against the tiled GEMM path it runs
// for every other head — which heads go direct is chosen from this table.
void bench_direct_attention(int reps, int64_t lanes) {
  std::printf("\nfloat32 attention, ctitan's direct kernels (%s) against its tiled GEMM path (same threads):\n\n",
              lanes == 16                                ? "16 lanes, forced"
              : lanes == 8                               ? "8 lanes, forced"
              : ctitan::attention_direct::wide_vectors() ? "this CPU's: 16 lanes"
                                                         : "this CPU's: 8 lanes");
  std::printf(
      "| heads × head dim (kv heads) | shape | dtype | direct ms | tiles ms | tiles / direct | max rel. Δ | rule "
      "takes |\n");
  std::printf("|---|---|---|---:|---:|---:|---:|---|\n");
  struct Case {
    int64_t B, T, H, KV, hd;
  };
  for (const Case c :
       {Case{8, 512, 16, 8, 16}, Case{8, 512, 8, 4, 32}, Case{4, 512, 8, 4, 64}, Case{1, 2048, 16, 8, 16},
        Case{1, 2048, 8, 4, 32}, Case{1, 2048, 8, 4, 64}, Case{1, 4096, 16, 8, 16}, Case{1, 4096, 8, 4, 32},
        Case{1, 4096, 8, 4, 64}, Case{1, 8192, 16, 8, 16}, Case{1, 8192, 8, 4, 32}, Case{1, 8192, 8, 4, 64},
        Case{1, 16384, 16, 8, 16}, Case{1, 16384, 8, 4, 32}}) {
    torch::manual_seed(2);
    const auto q = torch::randn({c.B, c.T, c.H, c.hd}), k = torch::randn({c.B, c.T, c.KV, c.hd}),
               v = torch::randn({c.B, c.T, c.KV, c.hd}), go = torch::randn({c.B, c.T, c.H, c.hd});
    ctitan::FlashAttentionBlocks direct, tiles;
    direct.path = ctitan::FlashAttentionBlocks::Path::Direct;
    direct.direct_lanes = lanes;
    tiles.path = ctitan::FlashAttentionBlocks::Path::Tiles;
    bench_layer(
        std::to_string(c.H) + " × " + std::to_string(c.hd) + " (" + std::to_string(c.KV) + ")",
        std::to_string(c.B) + "×" + std::to_string(c.T), torch::kFloat32,
        [direct](const auto& in) { return ctitan::flash_causal_attention(in[0], in[1], in[2], direct); },
        [tiles](const auto& in) { return ctitan::flash_causal_attention(in[0], in[1], in[2], tiles); }, {q, k, v}, go,
        reps, ctitan::attention_direct::preferred(c.hd, c.T) ? "direct" : "tiles");
  }
}

void bench_adamw(int64_t numel, int reps) {
  torch::manual_seed(0);
  std::vector<torch::Tensor> p1, p2, g, m, v, steps;
  const int64_t chunk = 512 * 1536;  // a 33M MLP weight
  for (int64_t done = 0; done < numel; done += chunk) {
    const int64_t n = std::min(chunk, numel - done);
    auto p = torch::randn({n});
    p1.push_back(p.clone().requires_grad_(true));
    p2.push_back(p.clone());
    g.push_back(torch::randn({n}) * 1e-2);
    m.push_back(torch::zeros({n}));
    v.push_back(torch::zeros({n}));
    steps.push_back(torch::zeros({}));
  }
  for (size_t i = 0; i < p1.size(); ++i) p1[i].mutable_grad() = g[i].clone();
  ctitan::OptimizerSpec spec;
  auto opt = ctitan::build_optimizer(p1, spec);
  auto ours = [&] {
    torch::NoGradGuard ng;
    opt->step();
  };
  auto theirs = [&] {
    torch::NoGradGuard ng;
    for (auto& s : steps) s.add_(1);
    at::_fused_adamw_(p2, g, m, v, {}, steps, spec.lr, spec.beta1, spec.beta2, spec.weight_decay, spec.eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  };
  // Same number of steps on both sides before comparing.
  ours();
  theirs();
  double diff = 0;
  for (size_t i = 0; i < p1.size(); ++i) diff = std::max(diff, rel_diff(p1[i].detach(), p2[i]));
  const Pair p = time_pair(ours, theirs, reps);
  row("adamw step", std::to_string(numel / 1000000) + "M params", torch::kFloat32, p, diff);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
  // `kernel_bench N direct [16|8]`: the second table alone (the direct attention kernels against
  // the tiles), for work on those kernels; 16 or 8 forces their vector width.
  if (argc > 2 && std::string(argv[2]) == "direct") {
    std::printf("LibTorch %s, %d intra-op threads, median of %d alternating runs, forward + backward\n", TORCH_VERSION,
                at::get_num_threads(), reps);
    bench_direct_attention(reps, argc > 3 ? std::atoi(argv[3]) : 0);
    return 0;
  }
  std::printf("LibTorch %s, %d intra-op threads, median of %d alternating runs, forward + backward\n\n", TORCH_VERSION,
              at::get_num_threads(), reps);
  std::printf("| kernel | shape | dtype | ctitan ms | ATen ms | ATen / ctitan | max rel. Δ |\n");
  std::printf("|---|---|---|---:|---:|---:|---:|\n");
  const int64_t D = 512, H = 8, KV = 4, hd = 64, V = 8192, F = 1536;
  struct Shape {
    int64_t B, T;
  };
  for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
    for (const Shape s : {Shape{4, 512}, Shape{1, 2048}}) {
      torch::manual_seed(1);
      const auto opts = torch::TensorOptions().dtype(dt);
      const std::string shape = std::to_string(s.B) + "×" + std::to_string(s.T);
      const auto q = torch::randn({s.B, s.T, H, hd}, opts), go = torch::randn({s.B, s.T, H, hd}, opts);
      bench_attention("attention", shape, dt, s.B, s.T, H, KV, hd, reps);

      const auto x = torch::randn({s.B, s.T, D}, opts), w = torch::rand({D}, opts) + 0.5,
                 gx = torch::randn({s.B, s.T, D}, opts);
      bench_layer(
          "rms_norm", shape, dt, [](const auto& in) { return ctitan::fused_rms_norm(in[0], in[1], 1e-5); },
          [D](const auto& in) { return at::rms_norm(in[0], {D}, in[1], 1e-5); }, {x, w}, gx, reps);

      auto freqs = torch::randn({s.T, hd / 2, 2});
      freqs = freqs / freqs.norm(2, -1, true);
      bench_layer(
          "rope", shape, dt, [freqs](const auto& in) { return ctitan::fused_rotary_emb(in[0], freqs); },
          [freqs](const auto& in) { return rope_complex(in[0], freqs); }, {q}, go, reps);

      const auto a = torch::randn({s.B, s.T, F}, opts), b = torch::randn({s.B, s.T, F}, opts),
                 ga = torch::randn({s.B, s.T, F}, opts);
      bench_layer(
          "swiglu", shape, dt, [](const auto& in) { return ctitan::fused_swiglu(in[0], in[1]); },
          [](const auto& in) { return at::silu(in[0]) * in[1]; }, {a, b}, ga, reps);

      const auto logits = torch::randn({s.B * s.T, V}, opts) * 3;
      const auto labels = torch::randint(V, {s.B * s.T}, torch::kLong);
      const double scale = 1.0 / static_cast<double>(s.B * s.T);
      bench_layer(
          "cross_entropy", shape, dt,
          [labels, scale](const auto& in) { return ctitan::fused_cross_entropy(in[0], labels, scale); },
          [labels, scale](const auto& in) {
            return at::cross_entropy_loss(in[0].to(torch::kFloat32), labels, {}, at::Reduction::Sum) * scale;
          },
          {logits}, torch::Tensor(), reps);
    }
  }
  // The debug model's attention: 16 heads of 16 (8 kv heads), batch 8 × 512.
  for (const auto dt : {torch::kFloat32, torch::kBFloat16}) {
    torch::manual_seed(1);
    bench_attention("attention (debug, hd 16)", "8×512", dt, 8, 512, 16, 8, 16, reps);
  }
  bench_adamw(33'000'000, reps);
  bench_direct_attention(reps, 0);
  return 0;
}
