// Tests for models/: Llama 3 args and flavors, parameter names and counts, FLOPs, the
// transformer block against an independent plain-ATen reference (forward and backward),
// RoPE convention, causality, torchtitan's initialisation, and the fused causal attention
// against the naive masked-softmax formula (fp32 and bf16, GQA, several tilings).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "config/errors.h"
#include "kernels/attention_direct.h"
#include "kernels/flash_attention.h"
#include "kernels/fused_ops.h"
#include "kernels/gemm.h"
#include "kernels/sdpa_choice.h"
#include "models/init.h"
#include "kernels/kernel_math.h"
#include "models/layers.h"
#include "models/llama/args.h"
#include "models/llama/model.h"
#include "models/mixtral/model.h"

using namespace ctitan;
using namespace ctitan::llama;

// Two intra-op threads in every test here, as training runs (train sets them from the
// cores): LibTorch 1.13's own default on this 2-core machine is one thread
// (torch.get_num_threads() prints 1), which would leave the kernels' parallel paths untested.
class TwoThreads : public ::testing::Environment {
 public:
  void SetUp() override { at::set_num_threads(2); }
};
const auto* const kTwoThreads = ::testing::AddGlobalTestEnvironment(new TwoThreads);

namespace {

TransformerModelArgs small_args() {
  TransformerModelArgs a;
  a.dim = 64;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = 97;
  a.multiple_of = 32;
  a.rope_theta = 10000;
  a.max_seq_len = 32;
  return a;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

// ---- Independent reference of one block, plain ATen ops, written from the math. --------
struct RefWeights {
  torch::Tensor wq, wk, wv, wo, w1, w2, w3, attn_norm, ffn_norm;
};

torch::Tensor ref_rmsnorm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return x / torch::sqrt((x * x).mean(-1, true) + eps) * w;
}

// x [B, T, h, hd]; rotate pair (2i, 2i+1) at position t by angle whose cos/sin are
// cos[t, i], sin[t, i].
torch::Tensor ref_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t T = x.size(1), hd = x.size(3);
  std::vector<torch::Tensor> cols;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const auto a = x.select(3, 2 * i), b = x.select(3, 2 * i + 1);  // [B, T, h]
    const auto c = cos.select(1, i).view({1, T, 1}), s = sin.select(1, i).view({1, T, 1});
    cols.push_back(a * c - b * s);
    cols.push_back(a * s + b * c);
  }
  return torch::stack(cols, 3);
}

torch::Tensor ref_block(const torch::Tensor& x, const RefWeights& w, int64_t n_heads, int64_t n_kv_heads, double eps,
                        const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / n_heads;
  const auto xn = ref_rmsnorm(x, w.attn_norm, eps);
  auto q = torch::matmul(xn, w.wq.t()).view({B, T, n_heads, hd});
  auto k = torch::matmul(xn, w.wk.t()).view({B, T, n_kv_heads, hd});
  auto v = torch::matmul(xn, w.wv.t()).view({B, T, n_kv_heads, hd});
  q = ref_rope(q, cos, sin);
  k = ref_rope(k, cos, sin);
  const int64_t group = n_heads / n_kv_heads;
  std::vector<torch::Tensor> heads;
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t kvh = h / group;  // consecutive query heads share one kv head
    std::vector<torch::Tensor> rows;
    for (int64_t t = 0; t < T; ++t) {
      const auto qt = q.select(1, t).select(1, h);                                 // [B, hd]
      const auto ks = k.narrow(1, 0, t + 1).select(2, kvh);                        // [B, t+1, hd]
      const auto vs = v.narrow(1, 0, t + 1).select(2, kvh);                        // [B, t+1, hd]
      const auto scores = (ks * qt.unsqueeze(1)).sum(-1) / std::sqrt(double(hd));  // [B, t+1]
      const auto e = torch::exp(scores - std::get<0>(scores.max(-1, true)));
      const auto p = e / e.sum(-1, true);
      rows.push_back((p.unsqueeze(-1) * vs).sum(1));  // [B, hd]
    }
    heads.push_back(torch::stack(rows, 1));  // [B, T, hd]
  }
  const auto attn = torch::stack(heads, 2).reshape({B, T, D});
  const auto h1 = x + torch::matmul(attn, w.wo.t());
  const auto hn = ref_rmsnorm(h1, w.ffn_norm, eps);
  const auto a1 = torch::matmul(hn, w.w1.t());
  const auto gate = a1 / (1 + torch::exp(-a1));  // silu
  const auto ff = torch::matmul(gate * torch::matmul(hn, w.w3.t()), w.w2.t());
  return h1 + ff;
}

void check_block_parity(torch::ScalarType dtype, double fwd_tol, double grad_tol) {
  torch::manual_seed(1234);
  TransformerModelArgs args = small_args();  // dim 64, 4 heads, 2 kv heads
  const int64_t B = 2, T = 9;
  TransformerBlock block(0, args);
  block->to(dtype);
  {
    torch::NoGradGuard ng;
    for (auto& p : block->parameters()) p.copy_(torch::randn(p.sizes(), dtype) * 0.2);
    block->attention_norm->weight.copy_(1 + 0.3 * torch::randn({args.dim}, dtype));
    block->ffn_norm->weight.copy_(1 + 0.3 * torch::randn({args.dim}, dtype));
  }
  const auto table = precompute_freqs_cis(args.head_dim(), args.max_seq_len, args.rope_theta, args.rope_scaling);
  const auto cos = table.narrow(0, 0, T).select(-1, 0).to(dtype);
  const auto sin = table.narrow(0, 0, T).select(-1, 1).to(dtype);

  const auto x0 = torch::randn({B, T, args.dim}, dtype);
  const auto g = torch::randn({B, T, args.dim}, dtype);

  auto x = x0.clone().requires_grad_(true);
  const auto y = block->forward(x, table);
  (y * g).sum().backward();

  // Reference with its own leaf copies of every weight.
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  RefWeights w{leaf(block->attention->wq->weight),    leaf(block->attention->wk->weight),
               leaf(block->attention->wv->weight),    leaf(block->attention->wo->weight),
               leaf(block->feed_forward->w1->weight), leaf(block->feed_forward->w2->weight),
               leaf(block->feed_forward->w3->weight), leaf(block->attention_norm->weight),
               leaf(block->ffn_norm->weight)};
  auto xr = x0.clone().requires_grad_(true);
  const auto yr = ref_block(xr, w, args.n_heads, args.kv_heads(), args.norm_eps, cos, sin);
  (yr * g).sum().backward();

  ASSERT_EQ(y.sizes(), yr.sizes());
  ASSERT_EQ(y.scalar_type(), dtype);
  // Relative to the largest value (|y| reaches ~20 here): fp32 rounding, summed in another
  // order by another GEMM, differs in proportion to the magnitudes.
  const double y_scale = std::max(1.0, yr.abs().max().item<double>());
  EXPECT_LT(max_abs_diff(y, yr) / y_scale, fwd_tol) << "output, largest |y| " << y_scale;
  const double gx_scale = std::max(1.0, xr.grad().abs().max().item<double>());
  EXPECT_LT(max_abs_diff(x.grad(), xr.grad()) / gx_scale, grad_tol) << "input grad, largest " << gx_scale;
  const std::vector<std::pair<std::string, torch::Tensor>> pairs = {
      {"attention.wq.weight", w.wq},    {"attention.wk.weight", w.wk},          {"attention.wv.weight", w.wv},
      {"attention.wo.weight", w.wo},    {"feed_forward.w1.weight", w.w1},       {"feed_forward.w2.weight", w.w2},
      {"feed_forward.w3.weight", w.w3}, {"attention_norm.weight", w.attn_norm}, {"ffn_norm.weight", w.ffn_norm}};
  auto named = block->named_parameters();
  ASSERT_EQ(named.size(), pairs.size());
  for (const auto& [name, ref] : pairs) {
    const auto& p = named[name];
    ASSERT_TRUE(p.grad().defined()) << name;
    const double scale = std::max(1.0, ref.grad().abs().max().item<double>());
    EXPECT_LT(max_abs_diff(p.grad(), ref.grad()) / scale, grad_tol) << name;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------
TEST(LlamaArgs, FlavorsMatchTorchtitan) {
  const auto names = llama3_flavor_names();
  EXPECT_EQ(names, (std::vector<std::string>{"debugmodel", "debugmodel_gqa", "33M", "150M", "8B", "70B", "405B"}));
  EXPECT_EQ(llama3_flavor("debugmodel_gqa").kv_heads(), 8);
  EXPECT_EQ(llama3_flavor("debugmodel_gqa").dim, 256);

  const auto d = llama3_flavor("debugmodel");
  EXPECT_EQ(d.dim, 256);
  EXPECT_EQ(d.n_layers, 6);
  EXPECT_EQ(d.n_heads, 16);
  EXPECT_FALSE(d.n_kv_heads.has_value());
  EXPECT_EQ(d.kv_heads(), 16);
  EXPECT_EQ(d.vocab_size, 2048);
  EXPECT_EQ(d.rope_theta, 500000);
  EXPECT_EQ(d.multiple_of, 256);
  EXPECT_TRUE(d.rope_scaling.has_value());

  const auto b8 = llama3_flavor("8B");
  EXPECT_EQ(b8.dim, 4096);
  EXPECT_EQ(b8.n_layers, 32);
  EXPECT_EQ(b8.n_heads, 32);
  EXPECT_EQ(b8.kv_heads(), 8);
  EXPECT_EQ(b8.multiple_of, 1024);
  EXPECT_DOUBLE_EQ(*b8.ffn_dim_multiplier, 1.3);
  EXPECT_EQ(b8.vocab_size, 128256);

  const auto b70 = llama3_flavor("70B");
  EXPECT_EQ(b70.dim, 8192);
  EXPECT_EQ(b70.n_layers, 80);
  EXPECT_EQ(b70.n_heads, 64);
  const auto b405 = llama3_flavor("405B");
  EXPECT_EQ(b405.dim, 16384);
  EXPECT_EQ(b405.n_layers, 126);
  EXPECT_EQ(b405.n_heads, 128);
  EXPECT_DOUBLE_EQ(*b405.ffn_dim_multiplier, 1.2);
}

TEST(LlamaArgs, BadFlavorErrorText) {
  try {
    llama3_flavor("7B");
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(),
                 "unknown model.flavor \"7B\" for llama3; valid: debugmodel, debugmodel_gqa, 33M, 150M, 8B, 70B, 405B");
  }
}

TEST(LlamaArgs, ValidateNamesValues) {
  auto a = small_args();
  a.n_kv_heads = 3;
  try {
    validate(a);
    FAIL() << "expected UserError";
  } catch (const UserError& e) {
    EXPECT_STREQ(e.what(), "[llama3] n_heads=4 is not a multiple of n_kv_heads=3");
  }
  a = small_args();
  a.dim = 66;
  EXPECT_THROW(validate(a), UserError);
  EXPECT_THROW(Transformer{a}, UserError);
  EXPECT_NO_THROW(validate(small_args()));
}

TEST(LlamaArgs, FfnHiddenDim) {
  // 4*256=1024 -> int(2048/3)=682 -> round up to 256: 768
  EXPECT_EQ(ffn_hidden_dim(llama3_flavor("debugmodel")), 768);
  // 16384 -> 10922 -> int(1.3*10922)=14198 -> 14336
  EXPECT_EQ(ffn_hidden_dim(llama3_flavor("8B")), 14336);
  // 32768 -> 21845 -> 28398 -> 28672
  EXPECT_EQ(ffn_hidden_dim(llama3_flavor("70B")), 28672);
  // 65536 -> 43690 -> 52428 -> 53248
  EXPECT_EQ(ffn_hidden_dim(llama3_flavor("405B")), 53248);
  EXPECT_EQ(ffn_hidden_dim(small_args()), 192);  // 256 -> 170 -> 192
}

TEST(LlamaArgs, CountParamsLargeFlavors) {
  // 8B: torchtitan logs 8,030,261,248 parameters (vocab 128256).
  const auto c8 = count_params(llama3_flavor("8B"));
  EXPECT_EQ(c8.total, 8030261248LL);
  EXPECT_EQ(c8.embedding, 128256LL * 4096);
  // By hand: per block 2*8192^2 + 2*8192*1024 + 3*8192*28672 + 2*8192, x80,
  // + 2*128256*8192 + 8192.
  const auto c70 = count_params(llama3_flavor("70B"));
  EXPECT_EQ(c70.total, 70553706496LL);
  EXPECT_NEAR(double(c70.total), 70.6e9, 0.005 * 70.6e9);
  const auto c405 = count_params(llama3_flavor("405B"));
  EXPECT_EQ(c405.total, 405853388800LL);
  EXPECT_NEAR(double(c405.total), 405.9e9, 0.005 * 405.9e9);
}

TEST(LlamaArgs, FlopsPerTokenDebugmodel) {
  const auto a = llama3_flavor("debugmodel");
  // N = 6*(4*256*256 + 3*256*768 + 2*256) + 2*2048*256 + 256 = 6,163,712; N_emb = 524,288.
  // 6*(N - N_emb) + 12*L*H*hd*T with L=6, H=16, hd=16, T=2048.
  const double expected = 6.0 * (6163712.0 - 524288.0) + 12.0 * 6 * 16 * 16 * 2048;
  EXPECT_EQ(count_params(a).total, 6163712);
  EXPECT_DOUBLE_EQ(flops_per_token(a, 2048), expected);
  EXPECT_DOUBLE_EQ(flops_per_token(a, 2048), 71585280.0);
}

// ---------------------------------------------------------------------------------------
TEST(LlamaModel, ParameterNamesAndCountDebugmodel) {
  auto a = llama3_flavor("debugmodel");
  a.max_seq_len = 64;  // keeps the RoPE buffer small; no parameter depends on it
  Transformer model(a);
  std::vector<std::string> expected = {"tok_embeddings.weight"};
  for (int i = 0; i < 6; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    for (const char* n : {"attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                          "feed_forward.w2", "feed_forward.w3", "attention_norm", "ffn_norm"})
      expected.push_back(p + n + ".weight");
  }
  expected.push_back("norm.weight");
  expected.push_back("output.weight");

  std::vector<std::string> names;
  int64_t numel = 0;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
    numel += item.value().numel();
  }
  EXPECT_EQ(names, expected);
  EXPECT_EQ(numel, count_params(a).total);
  EXPECT_EQ(numel, 6163712);

  const auto buffers = model->named_buffers();
  ASSERT_EQ(buffers.size(), 1u);
  EXPECT_EQ(buffers.begin()->key(), "freqs_cis");
  EXPECT_EQ(buffers.begin()->value().sizes(), (std::vector<int64_t>{64, 8, 2}));

  auto params = model->named_parameters();
  EXPECT_EQ(params["layers.3.attention.wk.weight"].sizes(), (std::vector<int64_t>{256, 256}));
  EXPECT_EQ(params["layers.3.feed_forward.w2.weight"].sizes(), (std::vector<int64_t>{256, 768}));
  EXPECT_EQ(params["output.weight"].sizes(), (std::vector<int64_t>{2048, 256}));
  EXPECT_EQ(model->n_layers(), 6);
  EXPECT_EQ(model->layers()->size(), 6u);
  EXPECT_EQ(model->block(5)->layer_id, 5);
}

TEST(LlamaModel, GqaShapes) {
  Transformer model(small_args());
  auto p = model->named_parameters();
  EXPECT_EQ(p["layers.0.attention.wq.weight"].sizes(), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(p["layers.0.attention.wk.weight"].sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(p["layers.0.attention.wv.weight"].sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(p["layers.0.attention.wo.weight"].sizes(), (std::vector<int64_t>{64, 64}));
  int64_t numel = 0;
  for (const auto& t : model->parameters()) numel += t.numel();
  EXPECT_EQ(numel, count_params(small_args()).total);
}

TEST(LlamaModel, BlockMatchesReferenceFloat32) { check_block_parity(torch::kFloat, 2e-6, 1e-5); }

TEST(LlamaModel, BlockMatchesReferenceFloat64) { check_block_parity(torch::kDouble, 1e-12, 1e-11); }

TEST(LlamaModel, BlockRunsInBfloat16) {
  // Mixed precision feeds bf16 parameters and activations; the RoPE table stays float32.
  torch::manual_seed(9);
  auto args = small_args();
  TransformerBlock block(1, args);
  block->init_weights();
  const auto table = precompute_freqs_cis(args.head_dim(), args.max_seq_len, args.rope_theta, args.rope_scaling);
  const auto x = torch::randn({2, 9, args.dim});
  torch::NoGradGuard ng;
  const auto y32 = block->forward(x, table);
  block->to(torch::kBFloat16);
  const auto y16 = block->forward(x.to(torch::kBFloat16), table);
  EXPECT_EQ(y16.scalar_type(), torch::kBFloat16);
  EXPECT_LT(max_abs_diff(y16, y32), 0.05 * y32.abs().max().item<double>());
}

// ---------------------------------------------------------------------------------------
TEST(Rope, InterleavedPairsHandComputed) {
  // head_dim 4, theta 100: pair 0 frequency 1, pair 1 frequency 100^(-2/4) = 0.1.
  // No scaling: both wavelengths (2pi, 20pi) are far below the scaled band anyway.
  const auto table = precompute_freqs_cis(4, 3, 100.0);
  ASSERT_EQ(table.sizes(), (std::vector<int64_t>{3, 2, 2}));
  // x at position 1, one head: dims (0,1) = (1, 0), dims (2,3) = (0, 1).
  auto x = torch::zeros({1, 2, 1, 4});
  x[0][1][0][0] = 1.0;
  x[0][1][0][3] = 1.0;
  x[0][0][0][1] = 2.0;  // position 0: identity rotation
  const auto y = apply_rotary_emb(x, table);
  // Pair (0,1) rotated by 1 rad: (cos 1, sin 1). Pair (2,3) = (0,1) rotated by 0.1 rad:
  // (-sin 0.1, cos 0.1). A half-split convention would mix dims 0 and 2 instead.
  EXPECT_NEAR(y[0][1][0][0].item<float>(), std::cos(1.0), 1e-6);
  EXPECT_NEAR(y[0][1][0][1].item<float>(), std::sin(1.0), 1e-6);
  EXPECT_NEAR(y[0][1][0][2].item<float>(), -std::sin(0.1), 1e-6);
  EXPECT_NEAR(y[0][1][0][3].item<float>(), std::cos(0.1), 1e-6);
  EXPECT_NEAR(y[0][0][0][0].item<float>(), 0.0, 1e-7);
  EXPECT_NEAR(y[0][0][0][1].item<float>(), 2.0, 1e-7);
}

TEST(Rope, TableMatchesFormulaWithLlama31Scaling) {
  // debugmodel geometry: hd 16, theta 5e5. Frequencies f_i = theta^(-2i/16) and their
  // wavelengths 2pi/f_i; Llama 3.1 scaling (factor 8, low 1, high 4, original 8192) keeps
  // wavelengths < 2048, divides those > 8192 by 8 and interpolates in between.
  const int64_t hd = 16, T = 40;
  const double theta = 500000;
  const auto table = precompute_freqs_cis(hd, T, theta, RoPEScalingArgs{});
  ASSERT_EQ(table.scalar_type(), torch::kFloat);
  int kept = 0, scaled = 0, band = 0;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double f = std::pow(theta, -2.0 * i / hd);
    const double wl = 2 * M_PI / f;
    double g;
    if (wl < 2048) {
      g = f;
      ++kept;
    } else if (wl > 8192) {
      g = f / 8;
      ++scaled;
    } else {
      const double smooth = (8192 / wl - 1) / (4 - 1);
      g = (1 - smooth) * f / 8 + smooth * f;
      ++band;
    }
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_NEAR(table[t][i][0].item<float>(), std::cos(t * g), 2e-5) << t << "," << i;
      EXPECT_NEAR(table[t][i][1].item<float>(), std::sin(t * g), 2e-5) << t << "," << i;
    }
  }
  // The scaling really is exercised by the debugmodel geometry.
  EXPECT_EQ(kept, 4);
  EXPECT_EQ(band, 1);
  EXPECT_EQ(scaled, 3);
  // Unscaled table differs exactly in the scaled pairs.
  const auto plain = precompute_freqs_cis(hd, T, theta);
  EXPECT_TRUE(torch::equal(plain.narrow(1, 0, 4), table.narrow(1, 0, 4)));
  EXPECT_FALSE(torch::allclose(plain.narrow(1, 4, 4), table.narrow(1, 4, 4)));
}

// ---------------------------------------------------------------------------------------
TEST(LlamaModel, ForwardShapeAndCausality) {
  torch::manual_seed(0);
  Transformer model(small_args());
  model->init_weights();
  const int64_t B = 2, T = 10, t_changed = 6;
  auto tokens = torch::randint(0, 97, {B, T}, torch::kLong);
  torch::NoGradGuard ng;
  const auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{B, T, 97}));
  EXPECT_EQ(logits.scalar_type(), torch::kFloat);
  auto tokens2 = tokens.clone();
  tokens2.select(1, t_changed).add_(1).remainder_(97);
  const auto logits2 = model->forward(tokens2);
  EXPECT_LT(max_abs_diff(logits.narrow(1, 0, t_changed), logits2.narrow(1, 0, t_changed)), 1e-6);
  for (int64_t t = t_changed; t < T; ++t) EXPECT_GT(max_abs_diff(logits.select(1, t), logits2.select(1, t)), 1e-4) << t;
  EXPECT_THROW(model->forward(torch::zeros({1, 33}, torch::kLong)), c10::Error);
}

TEST(LlamaModel, UnitWrapperSeesEveryUnitAndCanReplay) {
  torch::manual_seed(3);
  Transformer model(small_args());
  model->init_weights();
  const auto tokens = torch::randint(0, 97, {2, 7}, torch::kLong);
  torch::NoGradGuard ng;
  const auto plain = model->forward(tokens);

  std::vector<std::string> units;
  std::vector<UnitFn> fns;
  std::vector<torch::Tensor> inputs, outputs;
  model->set_unit_wrapper([&](const std::string& unit, const UnitFn& fn, const torch::Tensor& in) {
    units.push_back(unit);
    fns.push_back(fn);
    inputs.push_back(in);
    outputs.push_back(fn(in));
    return outputs.back();
  });
  const auto wrapped = model->forward(tokens);
  EXPECT_TRUE(torch::equal(plain, wrapped));
  EXPECT_EQ(units, (std::vector<std::string>{"tok_embeddings", "layers.0", "layers.1", "output"}));
  // Re-running a unit after forward returned (what activation checkpointing does).
  for (size_t i = 0; i < fns.size(); ++i) EXPECT_TRUE(torch::equal(fns[i](inputs[i]), outputs[i])) << units[i];
  model->set_unit_wrapper(nullptr);
  EXPECT_TRUE(torch::equal(plain, model->forward(tokens)));
}

// ---------------------------------------------------------------------------------------
TEST(Init, SameSeedBitwiseEqual) {
  auto a = llama3_flavor("debugmodel");
  a.max_seq_len = 64;
  Transformer m1(a), m2(a);
  torch::manual_seed(42);
  m1->init_weights();
  torch::manual_seed(42);
  m2->init_weights();
  auto p2 = m2->named_parameters();
  for (const auto& item : m1->named_parameters()) EXPECT_TRUE(torch::equal(item.value(), p2[item.key()])) << item.key();
  torch::manual_seed(43);
  m2->init_weights();
  EXPECT_FALSE(torch::equal(m1->named_parameters()["layers.0.attention.wq.weight"],
                            m2->named_parameters()["layers.0.attention.wq.weight"]));
}

TEST(Init, DrawOrderIsTorchtitans) {
  // torchtitan draws: tok_embeddings normal; per layer wq, wk, wv, wo, w1, w2, w3 (norms
  // take no randomness); output truncated normal. Replay that order into fresh tensors.
  auto a = small_args();
  a.n_layers = 3;
  Transformer m(a);
  torch::manual_seed(11);
  m->init_weights();
  torch::manual_seed(11);
  auto p = m->named_parameters();
  auto expect_next = [&](const std::string& name, auto draw) {
    auto t = torch::empty_like(p[name]);
    draw(t);
    EXPECT_TRUE(torch::equal(t, p[name])) << name;
  };
  expect_next("tok_embeddings.weight", [](torch::Tensor& t) { t.normal_(0.0, 1.0); });
  for (int i = 0; i < 3; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    const double init_std = 0.02 / std::sqrt(2.0 * (i + 1));
    auto tn = [](double sd) { return [sd](torch::Tensor& t) { trunc_normal_(t, 0.0, sd); }; };
    expect_next(l + "attention.wq.weight", tn(0.02));
    expect_next(l + "attention.wk.weight", tn(0.02));
    expect_next(l + "attention.wv.weight", tn(0.02));
    expect_next(l + "attention.wo.weight", tn(init_std));
    expect_next(l + "feed_forward.w1.weight", tn(0.02));
    expect_next(l + "feed_forward.w2.weight", tn(init_std));
    expect_next(l + "feed_forward.w3.weight", tn(init_std));
  }
  const double s = std::pow(64.0, -0.5);
  expect_next("output.weight", [s](torch::Tensor& t) { trunc_normal_(t, 0.0, s, -3 * s, 3 * s); });
}

TEST(Init, StatisticsMatchTorchtitan) {
  auto a = llama3_flavor("debugmodel");
  a.max_seq_len = 64;
  Transformer m(a);
  {
    torch::NoGradGuard ng;
    for (auto& p : m->parameters()) p.fill_(7.0);  // init must overwrite everything
  }
  torch::manual_seed(0);
  m->init_weights();
  auto p = m->named_parameters();
  auto stdev = [](const torch::Tensor& t) { return t.to(torch::kDouble).std().item<double>(); };

  const auto emb = p["tok_embeddings.weight"];
  EXPECT_NEAR(stdev(emb), 1.0, 0.01);
  EXPECT_NEAR(emb.mean().item<double>(), 0.0, 0.01);
  for (int i = 0; i < 6; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    const double init_std = 0.02 / std::sqrt(2.0 * (i + 1));
    for (const char* n : {"attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"})
      EXPECT_NEAR(stdev(p[l + n + ".weight"]), 0.02, 0.02 * 0.03) << l << n;
    for (const char* n : {"attention.wo", "feed_forward.w2", "feed_forward.w3"})
      EXPECT_NEAR(stdev(p[l + n + ".weight"]), init_std, init_std * 0.03) << l << n;
    EXPECT_TRUE(torch::equal(p[l + "attention_norm.weight"], torch::ones({256})));
    EXPECT_TRUE(torch::equal(p[l + "ffn_norm.weight"], torch::ones({256})));
  }
  EXPECT_TRUE(torch::equal(p["norm.weight"], torch::ones({256})));

  // Output: N(0, 1/256) truncated at +-3 std. Std of a standard normal truncated at +-3:
  // sqrt(1 - 2*3*phi(3) / (Phi(3) - Phi(-3))).
  const double s = std::pow(256.0, -0.5);
  const double phi3 = std::exp(-4.5) / std::sqrt(2 * M_PI);
  const double mass = std::erf(3 / std::sqrt(2.0));
  const double trunc_factor = std::sqrt(1 - 6 * phi3 / mass);
  const auto out = p["output.weight"];
  EXPECT_NEAR(stdev(out), s * trunc_factor, s * 0.01);
  EXPECT_LE(out.abs().max().item<double>(), 3 * s);
  EXPECT_GT(out.abs().max().item<double>(), 2.9 * s);  // the tail is populated up to the cut

  // depth_init = false: every block uses 0.02/sqrt(2L).
  a.depth_init = false;
  Transformer flat(a);
  flat->init_weights();
  for (int i : {0, 5}) {
    const double init_std = 0.02 / std::sqrt(12.0);
    EXPECT_NEAR(flat->block(i)->weight_init_std, init_std, 1e-15);
    EXPECT_NEAR(stdev(flat->block(i)->attention->wo->weight), init_std, init_std * 0.03);
  }
}

TEST(Init, TruncNormalBoundsAndMean) {
  // Absolute bounds [a, b] = [-0.5, 1.5] for N(0.2, 1): mean of the truncated normal is
  // mu + sigma (phi(alpha) - phi(beta)) / (Phi(beta) - Phi(alpha)).
  torch::manual_seed(5);
  auto t = torch::empty({400000}, torch::kDouble);
  trunc_normal_(t, 0.2, 1.0, -0.5, 1.5);
  EXPECT_GE(t.min().item<double>(), -0.5);
  EXPECT_LE(t.max().item<double>(), 1.5);
  auto phi = [](double x) { return std::exp(-x * x / 2) / std::sqrt(2 * M_PI); };
  auto Phi = [](double x) { return 0.5 * (1 + std::erf(x / std::sqrt(2.0))); };
  const double alpha = -0.7, beta = 1.3;
  const double mean = 0.2 + (phi(alpha) - phi(beta)) / (Phi(beta) - Phi(alpha));
  EXPECT_NEAR(t.mean().item<double>(), mean, 0.004);
  // Default bounds are absolute +-2: with std 0.02 nothing is cut, std stays 0.02.
  auto w = torch::empty({200000});
  trunc_normal_(w, 0.0, 0.02);
  EXPECT_NEAR(w.to(torch::kDouble).std().item<double>(), 0.02, 0.0003);
}

// ---- Fused causal attention (kernels/flash_attention.h) ---------------------------------
namespace {

struct AttnCase {
  int64_t B, T, H, KV, hd;
  FlashAttentionBlocks blocks;
};

struct AttnResult {
  torch::Tensor out, dq, dk, dv;
};

// The naive formula: repeat kv heads, full masked T×T softmax (layers.cpp's causal_attention).
AttnResult naive_attention(const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0,
                           const torch::Tensor& g) {
  auto q = q0.detach().clone().requires_grad_(true);
  auto k = k0.detach().clone().requires_grad_(true);
  auto v = v0.detach().clone().requires_grad_(true);
  const int64_t rep = q.size(2) / k.size(2);
  const auto out =
      causal_attention(q.transpose(1, 2), repeat_kv(k, rep).transpose(1, 2), repeat_kv(v, rep).transpose(1, 2))
          .transpose(1, 2);
  (out.to(torch::kFloat) * g).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

AttnResult fused_attention(const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0,
                           const torch::Tensor& g, FlashAttentionBlocks blocks) {
  auto q = q0.detach().clone().requires_grad_(true);
  auto k = k0.detach().clone().requires_grad_(true);
  auto v = v0.detach().clone().requires_grad_(true);
  const auto out = flash_causal_attention(q, k, v, blocks);
  (out.to(torch::kFloat) * g).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

struct AttnInputs {
  torch::Tensor q, k, v, g;
};

AttnInputs attn_inputs(const AttnCase& c, torch::ScalarType dtype) {
  torch::manual_seed(c.T * 131 + c.H * 7 + c.KV);
  return {torch::randn({c.B, c.T, c.H, c.hd}).to(dtype), torch::randn({c.B, c.T, c.KV, c.hd}).to(dtype),
          torch::randn({c.B, c.T, c.KV, c.hd}).to(dtype), torch::randn({c.B, c.T, c.H, c.hd})};
}

double rel_err(const torch::Tensor& a, const torch::Tensor& ref) {
  return max_abs_diff(a, ref) / std::max(1e-12, ref.to(torch::kDouble).abs().max().item<double>());
}

const std::vector<AttnCase>& attn_cases() {
  static const std::vector<AttnCase> cases = {
      {2, 37, 4, 2, 16, {8, 16}},       // GQA 2, ragged last tiles, online softmax over 3 key tiles
      {1, 64, 4, 4, 8, {}},             // MHA, one tile per query block (the default tiling)
      {2, 50, 8, 1, 16, {5, 7}},        // MQA (8 query heads on one kv head), odd tiles
      {1, 96, 16, 8, 16, {32, 32}},     // the debug model's head layout
      {2, 256, 16, 8, 16, {128, 512}},  // ... at the default tiling, 16 batch items over the threads
  };
  return cases;
}

}  // namespace

// float32 heads the direct kernels are built for (16, 32, 64), each path forced: ragged last
// strips (T not a multiple of 8 or 16), MHA, GQA and MQA, and one key vector or less.
const std::vector<AttnCase>& direct_cases() {
  static const std::vector<AttnCase> cases = {
      {2, 37, 4, 2, 16, {8, 16}}, {1, 13, 2, 2, 32, {}}, {2, 50, 8, 1, 16, {}},  {1, 96, 16, 8, 16, {32, 32}},
      {1, 70, 4, 2, 64, {}},      {3, 5, 2, 1, 16, {}},  {1, 129, 4, 4, 32, {}},
  };
  return cases;
}

FlashAttentionBlocks with_path(FlashAttentionBlocks b, FlashAttentionBlocks::Path path) {
  b.path = path;
  return b;
}

void expect_matches_naive_float32(const AttnCase& c, FlashAttentionBlocks blocks) {
  const auto in = attn_inputs(c, torch::kFloat);
  const auto ref = naive_attention(in.q, in.k, in.v, in.g);
  const auto got = fused_attention(in.q, in.k, in.v, in.g, blocks);
  SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " KV=" + std::to_string(c.KV) +
               " hd=" + std::to_string(c.hd) + " path " + std::to_string(static_cast<int>(blocks.path)) + " lanes " +
               std::to_string(blocks.direct_lanes));
  ASSERT_EQ(got.out.sizes(), ref.out.sizes());
  EXPECT_LT(rel_err(got.out, ref.out), 2e-6);
  EXPECT_LT(rel_err(got.dq, ref.dq), 2e-5);
  EXPECT_LT(rel_err(got.dk, ref.dk), 2e-5);
  EXPECT_LT(rel_err(got.dv, ref.dv), 2e-5);
}

TEST(FlashAttention, MatchesNaiveFormulaFloat32) {
  using Path = FlashAttentionBlocks::Path;
  for (const auto& c : attn_cases())
    for (const Path p : {Path::Rule, Path::Tiles}) expect_matches_naive_float32(c, with_path(c.blocks, p));
}

// The direct kernels (kernels/attention_direct.h) in both vector widths and the tiles, each
// forced, on the head sizes the direct ones are built for.
TEST(FlashAttention, DirectKernelsMatchNaiveFormulaFloat32) {
  using Path = FlashAttentionBlocks::Path;
  for (const auto& c : direct_cases()) {
    ASSERT_TRUE(attention_direct::takes(c.hd));
    expect_matches_naive_float32(c, with_path(c.blocks, Path::Tiles));
    for (const int64_t lanes : {16, 8}) {
      auto blocks = with_path(c.blocks, Path::Direct);
      blocks.direct_lanes = lanes;
      expect_matches_naive_float32(c, blocks);
    }
  }
}

// The direct path's sums run in a fixed order per task: one thread or two give the same bits,
// and so does a second call.
void expect_direct_thread_count_independent(int64_t lanes) {
  const AttnCase c{3, 45, 4, 2, 16, {}};
  const auto in = attn_inputs(c, torch::kFloat);
  auto blocks = with_path({}, FlashAttentionBlocks::Path::Direct);
  blocks.direct_lanes = lanes;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = fused_attention(in.q, in.k, in.v, in.g, blocks);
  at::set_num_threads(2);
  const auto two = fused_attention(in.q, in.k, in.v, in.g, blocks);
  const auto again = fused_attention(in.q, in.k, in.v, in.g, blocks);
  at::set_num_threads(threads);
  for (const auto& [a, b] : {std::pair{one.out, two.out}, std::pair{one.dq, two.dq}, std::pair{one.dk, two.dk},
                             std::pair{one.dv, two.dv}, std::pair{two.dk, again.dk}})
    EXPECT_TRUE(torch::equal(a, b));
}

TEST(FlashAttention, DirectKernelsDoNotDependOnTheThreadCount) {
  for (const int64_t lanes : {16, 8}) {
    SCOPED_TRACE("lanes " + std::to_string(lanes));
    expect_direct_thread_count_independent(lanes);
  }
}

// The rule takes the direct kernels while a backward task's working set (4 · hd · T floats)
// is within the limit of the CPU's vectors (L2 · 32 / hd with AVX-512, eight times the L2 with
// AVX2, never with neither), and never for a head size they are not built for.
TEST(FlashAttention, DirectKernelsRuleFollowsTheVectorsAndTheL2) {
  const int64_t l2 = attention_direct::l2_bytes();
  ASSERT_GT(l2 / 2, 4 * 64 * 16 * 4) << "an L2 smaller than the smallest working set";
  // The vectors as the kernel's /proc/cpuinfo says them, against the rule's own probes.
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line) && line.rfind("flags", 0) != 0) {
  }
  std::istringstream words(line);
  std::set<std::string> flags{std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
  const bool avx512 =
      flags.count("avx512f") && flags.count("avx512bw") && flags.count("avx512dq") && flags.count("avx512vl");
  const bool avx2 = flags.count("avx2") && flags.count("fma");
  EXPECT_EQ(attention_direct::wide_vectors(), avx512) << "cpuinfo flags: " << line;
  EXPECT_EQ(attention_direct::avx2_vectors(), avx2) << "cpuinfo flags: " << line;
  for (const int64_t hd : {16, 32, 64}) {
    const int64_t limit = avx512 ? l2 * 32 / hd : avx2 ? 8 * l2 : 0;
    EXPECT_EQ(attention_direct::working_set_limit_bytes(hd), limit) << "hd " << hd;
    for (const int64_t T : {16, 512, 2048, 4096, 8192, 16384, 32768})
      EXPECT_EQ(attention_direct::preferred(hd, T), 16 * hd * T <= limit) << "hd " << hd << " T " << T;
  }
  EXPECT_FALSE(attention_direct::takes(8));
  EXPECT_FALSE(attention_direct::preferred(8, 16));
  EXPECT_FALSE(attention_direct::preferred(128, 16));
}

// bf16: the truth is the formula in float64 on the same (bf16-rounded) inputs; the fused
// kernel must be at least about as accurate as the naive formula computed in bf16.
TEST(FlashAttention, Bfloat16AsAccurateAsNaiveBfloat16) {
  for (const auto& c : attn_cases()) {
    const auto in = attn_inputs(c, torch::kBFloat16);
    const auto truth = naive_attention(in.q.to(torch::kDouble), in.k.to(torch::kDouble), in.v.to(torch::kDouble),
                                       in.g.to(torch::kDouble));
    const auto naive = naive_attention(in.q, in.k, in.v, in.g);
    const auto got = fused_attention(in.q, in.k, in.v, in.g, c.blocks);
    SCOPED_TRACE("T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " KV=" + std::to_string(c.KV));
    ASSERT_EQ(got.out.scalar_type(), torch::kBFloat16);
    ASSERT_EQ(got.dk.scalar_type(), torch::kBFloat16);
    const std::vector<std::pair<torch::Tensor, torch::Tensor>> fused_naive = {
        {got.out, naive.out}, {got.dq, naive.dq}, {got.dk, naive.dk}, {got.dv, naive.dv}};
    const std::vector<torch::Tensor> truths = {truth.out, truth.dq, truth.dk, truth.dv};
    const char* names[] = {"out", "dq", "dk", "dv"};
    for (size_t i = 0; i < truths.size(); ++i) {
      const double e_fused = rel_err(fused_naive[i].first, truths[i]);
      const double e_naive = rel_err(fused_naive[i].second, truths[i]);
      EXPECT_LT(e_fused, 2e-2) << names[i];
      EXPECT_LT(e_fused, 1.5 * e_naive + 4e-3) << names[i] << " naive bf16 error " << e_naive;
    }
  }
}

TEST(FlashAttention, DeterministicAndCausal) {
  for (const AttnCase& c : {AttnCase{1, 40, 4, 2, 8, {8, 8}}, AttnCase{1, 40, 4, 2, 16, {}}}) {
    SCOPED_TRACE("hd " + std::to_string(c.hd));
    const auto in = attn_inputs(c, torch::kFloat);
    const auto a = flash_causal_attention(in.q, in.k, in.v, c.blocks);
    const auto b = flash_causal_attention(in.q, in.k, in.v, c.blocks);
    EXPECT_TRUE(torch::equal(a, b));
    // Changing keys/values at position 30 leaves every output before 30 unchanged.
    auto k2 = in.k.clone(), v2 = in.v.clone();
    k2.select(1, 30).add_(5.0);
    v2.select(1, 30).add_(5.0);
    const auto d = flash_causal_attention(in.q, k2, v2, c.blocks);
    EXPECT_TRUE(torch::equal(d.narrow(1, 0, 30), a.narrow(1, 0, 30)));
    EXPECT_GT((d.narrow(1, 30, 10) - a.narrow(1, 30, 10)).abs().max().item<double>(), 1e-3);
  }
}

// The kernel never materialises the T×T scores: every op output of forward and backward,
// observed through a RecordFunction callback, stays below one [B·H, T, T] score tensor
// (at most a strip of block.q query rows × T keys per head, in the backward).
namespace {
thread_local int64_t tl_max_output_numel = 0;
std::unique_ptr<at::ObserverContext> attn_op_start(const at::RecordFunction&) { return nullptr; }
void attn_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  for (const auto& o : fn.outputs())
    if (o.isTensor() && o.toTensor().defined())
      tl_max_output_numel = std::max(tl_max_output_numel, o.toTensor().numel());
}
}  // namespace

TEST(FlashAttention, NeverMaterialisesTheScoreMatrix) {
  const AttnCase c{2, 256, 4, 2, 16, {32, 64}};
  const auto in = attn_inputs(c, torch::kFloat);
  const int64_t full_scores = c.B * c.H * c.T * c.T;
  const int64_t strip = c.B * c.H * c.blocks.q * c.T;  // = full_scores / 8 here
  using Path = FlashAttentionBlocks::Path;
  for (const Path p : {Path::Tiles, Path::Direct}) {
    auto q = in.q.clone().requires_grad_(true), k = in.k.clone().requires_grad_(true),
         v = in.v.clone().requires_grad_(true);
    tl_max_output_numel = 0;
    auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(attn_op_start, attn_op_end).needsOutputs(true));
    const auto out = flash_causal_attention(q, k, v, with_path(c.blocks, p));
    (out * in.g).sum().backward();
    at::removeCallback(handle);
    EXPECT_GT(tl_max_output_numel, 0) << "the observer saw no op";
    EXPECT_LE(tl_max_output_numel, std::max(strip, c.B * c.T * c.H * c.hd));
    EXPECT_LT(tl_max_output_numel, full_scores / 4);
  }
  // The naive formula, observed the same way, does build [B, H, T, T].
  tl_max_output_numel = 0;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(attn_op_start, attn_op_end).needsOutputs(true));
  naive_attention(in.q, in.k, in.v, in.g);
  at::removeCallback(handle);
  EXPECT_GE(tl_max_output_numel, full_scores);
}

// ---- Fused element-wise layers (kernels/fused_ops.h) against their ATen formulas ---------
namespace {

// The formulas the fused loops replace, in plain ATen ops (float32 math for bf16 inputs).
torch::Tensor aten_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const auto xc = x.scalar_type() == torch::kDouble ? x : x.to(torch::kFloat);
  return (xc * torch::rsqrt(xc.pow(2).mean(-1, true) + eps)).to(x.scalar_type()) * w;
}
torch::Tensor aten_rope(const torch::Tensor& x, const torch::Tensor& table) {
  const auto dt = x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  const int64_t T = x.size(1);
  const auto cos = table.narrow(0, 0, T).select(-1, 0).unsqueeze(1).to(dt);
  const auto sin = table.narrow(0, 0, T).select(-1, 1).unsqueeze(1).to(dt);
  const auto p = x.to(dt).reshape({x.size(0), T, x.size(2), -1, 2});
  const auto a = p.select(-1, 0), b = p.select(-1, 1);
  return torch::stack({a * cos - b * sin, a * sin + b * cos}, -1).flatten(3).to(x.scalar_type());
}

// Runs f on leaf copies of the inputs; returns the output and the inputs' gradients for
// the upstream gradient g.
std::vector<torch::Tensor> value_and_grads(const std::function<torch::Tensor(std::vector<torch::Tensor>&)>& f,
                                           const std::vector<torch::Tensor>& inputs, const torch::Tensor& g) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(true));
  const auto y = f(leaves);
  (y.to(torch::kDouble) * g.to(torch::kDouble)).sum().backward();
  std::vector<torch::Tensor> out{y.detach()};
  for (const auto& l : leaves) out.push_back(l.grad());
  return out;
}

void expect_fused_matches(const char* what, const std::function<torch::Tensor(std::vector<torch::Tensor>&)>& fused,
                          const std::function<torch::Tensor(std::vector<torch::Tensor>&)>& ref,
                          const std::vector<torch::Tensor>& inputs, const torch::Tensor& g, double tol) {
  const auto a = value_and_grads(fused, inputs, g), b = value_and_grads(ref, inputs, g);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].scalar_type(), b[i].scalar_type()) << what << " #" << i;
    ASSERT_EQ(a[i].sizes(), b[i].sizes()) << what << " #" << i;
    const double scale = std::max(1e-6, b[i].to(torch::kDouble).abs().max().item<double>());
    EXPECT_LT(max_abs_diff(a[i], b[i]) / scale, tol) << what << (i ? " gradient of input " : " output ") << i;
  }
}

}  // namespace

TEST(FusedOps, MatchAtenFormulasInEveryDtype) {
  const auto table = precompute_freqs_cis(16, 64, 10000.0);
  // bf16: one rounding of the result (2^-8) may differ where the formulas round in between.
  for (auto [dt, tol] :
       {std::pair{torch::kDouble, 1e-12}, std::pair{torch::kFloat, 2e-6}, std::pair{torch::kBFloat16, 1.6e-2}}) {
    torch::manual_seed(11);
    const auto x = torch::randn({3, 37, 96}).to(dt), w = (1 + 0.3 * torch::randn({96})).to(dt);
    const auto g = torch::randn({3, 37, 96});
    expect_fused_matches(
        "rms_norm", [](auto& v) { return fused_rms_norm(v[0], v[1], 1e-5); },
        [](auto& v) { return aten_rms_norm(v[0], v[1], 1e-5); }, {x, w}, g, tol);
    const auto q = torch::randn({2, 33, 4, 16}).to(dt), gq = torch::randn({2, 33, 4, 16});
    expect_fused_matches(
        "rope", [&](auto& v) { return fused_rotary_emb(v[0], table); }, [&](auto& v) { return aten_rope(v[0], table); },
        {q}, gq, tol);
    // SwiGLU gate: a spread wide enough to reach the saturated ends of σ.
    const auto a = (torch::randn({5, 29, 64}) * 6).to(dt), b = torch::randn({5, 29, 64}).to(dt);
    const auto gs = torch::randn({5, 29, 64});
    expect_fused_matches(
        "swiglu", [](auto& v) { return fused_swiglu(v[0], v[1]); }, [](auto& v) { return torch::silu(v[0]) * v[1]; },
        {a, b}, gs, tol);
  }
}

TEST(FusedOps, RmsNormWeightGradientIsReproducible) {
  // Rows split into fixed chunks: the same sums in the same order on 1 or 2 threads.
  torch::manual_seed(5);
  const auto x = torch::randn({300, 64}), w = torch::randn({64}), g = torch::randn({300, 64});
  auto grad_w = [&](int threads) {
    at::set_num_threads(threads);
    auto wl = w.clone().requires_grad_(true);
    (fused_rms_norm(x, wl, 1e-5) * g).sum().backward();
    return wl.grad();
  };
  const int before = at::get_num_threads();
  const auto one = grad_w(1), two = grad_w(2);
  at::set_num_threads(before);
  EXPECT_TRUE(torch::equal(one, two));
}

TEST(FusedOps, CrossEntropyMatchesAten) {
  torch::manual_seed(9);
  const int64_t N = 37, V = 301;
  const auto labels = torch::randint(0, V, {N}, torch::kLong);
  for (auto [dt, tol] : {std::pair{torch::kFloat, 2e-6}, std::pair{torch::kBFloat16, 1e-2}}) {
    const auto x0 = (torch::randn({N, V}) * 3).to(dt);
    auto a = x0.clone().requires_grad_(true), b = x0.clone().requires_grad_(true);
    const auto mine = fused_cross_entropy(a, labels, 1.0 / N);
    const auto ref =
        torch::nn::functional::cross_entropy(b.to(torch::kFloat), labels,
                                             torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum)) /
        N;
    (mine * 2.5).backward();
    (ref * 2.5).backward();
    EXPECT_NEAR(mine.item<double>(), ref.item<double>(), 1e-6 * std::abs(ref.item<double>()));
    ASSERT_EQ(a.grad().scalar_type(), dt);
    const double scale = b.grad().to(torch::kDouble).abs().max().item<double>();
    EXPECT_LT(max_abs_diff(a.grad(), b.grad()) / scale, tol);
  }
  EXPECT_THROW(fused_cross_entropy(torch::randn({2, 5}), torch::tensor({0, 5}, torch::kLong), 1.0), c10::Error);
}

// The GPU routes (ATen ops, so they run here too) against the formulas they replaced.
TEST(FusedOps, GpuRouteRopeIsTheRealPairFormula) {
  const auto table = precompute_freqs_cis(32, 24, 10000.0);  // head dim 32, 24 positions
  for (auto [dt, tol] : {std::pair{torch::kFloat, 2e-6}, std::pair{torch::kBFloat16, 1.6e-2}}) {
    torch::manual_seed(12);
    // q as the model makes it: a [B, T, h, hd] view of a wider projection (not contiguous)
    const auto wide = torch::randn({2, 21, 6, 32}).to(dt);
    const auto q = wide.narrow(2, 1, 4), g = torch::randn({2, 21, 4, 32});
    ASSERT_FALSE(q.is_contiguous());
    expect_fused_matches(
        "rope (complex)", [&](auto& v) { return rotary_emb_aten(v[0], table); },
        [&](auto& v) { return aten_rope(v[0], table); }, {q}, g, tol);
  }
}

TEST(FusedOps, GpuRouteChunkedCrossEntropyIsTheFloat32Loss) {
  torch::manual_seed(13);
  const int64_t N = 41, V = 257;
  const auto labels = torch::randint(0, V, {N}, torch::kLong);
  for (auto [dt, tol] : {std::pair{torch::kFloat, 2e-6}, std::pair{torch::kBFloat16, 1e-2}}) {
    const auto x0 = (torch::randn({N, V}) * 3).to(dt);
    // rows per chunk: one, an uneven split (41 = 4·10 + 1), all at once, and the default
    for (int64_t rows : {int64_t{1}, int64_t{10}, N, int64_t{0}}) {
      auto a = x0.clone().requires_grad_(true), b = x0.clone().requires_grad_(true);
      const auto mine = chunked_cross_entropy(a, labels, 1.0 / N, rows);
      const auto ref = at::cross_entropy_loss(b.to(torch::kFloat), labels, {}, at::Reduction::Sum) / N;
      ASSERT_EQ(mine.scalar_type(), torch::kFloat);
      (mine * 2.5).backward();
      (ref * 2.5).backward();
      EXPECT_NEAR(mine.item<double>(), ref.item<double>(), 1e-6 * std::abs(ref.item<double>())) << rows;
      ASSERT_EQ(a.grad().scalar_type(), dt);
      const double scale = b.grad().to(torch::kDouble).abs().max().item<double>();
      EXPECT_LT(max_abs_diff(a.grad(), b.grad()) / scale, tol) << rows;
    }
  }
}

// model.sdpa_backend's measurement, on the CPU, where ATen's attention has its own flash
// kernel and math only: the candidates ATen's checks refuse are listed as not usable (cuDNN
// also with k and v repeated), the one it takes is timed and chosen, and ATen's priority order
// is left as it was; use_sdpa then puts the choice first.
TEST(SdpaChoice, TimesWhatATenTakesAndLeavesItsOrder) {
  auto& ctx = at::globalContext();
  const auto before = ctx.sDPPriorityOrder();
  ctitan::SdpaShape s;
  s.batch = 1, s.seq = 32, s.heads = 4, s.kv_heads = 2, s.head_dim = 16;
  const auto c = ctitan::choose_sdpa(
      s, {at::SDPBackend::cudnn_attention, at::SDPBackend::flash_attention, at::SDPBackend::efficient_attention}, 1);
  ASSERT_EQ(c.tried.size(), 4u);
  EXPECT_EQ(c.tried[0].name, "cudnn");
  EXPECT_EQ(c.tried[1].name, "cudnn (kv repeated)");
  EXPECT_FALSE(c.tried[0].usable || c.tried[1].usable);
  EXPECT_EQ(c.tried[2].name, "flash");
  EXPECT_TRUE(c.tried[2].usable);
  EXPECT_GT(c.tried[2].ms, 0.0);
  EXPECT_FALSE(c.tried[3].usable);
  EXPECT_EQ(c.backend, at::SDPBackend::flash_attention);
  EXPECT_FALSE(c.repeat_kv);
  EXPECT_EQ(c.name(), "flash");
  EXPECT_NE(c.summary().find("efficient: not usable"), std::string::npos) << c.summary();
  EXPECT_EQ(ctx.sDPPriorityOrder(), before);
  ctitan::SdpaChoice math;
  math.backend = at::SDPBackend::math;
  ctitan::use_sdpa(math);
  EXPECT_EQ(ctx.sDPPriorityOrder()[0], at::SDPBackend::math);
  EXPECT_EQ(ctitan::current_sdpa().backend, at::SDPBackend::math);
  ctitan::SdpaChoice flash;  // ATen's own order again (flash first)
  ctitan::use_sdpa(flash);
  EXPECT_EQ(ctx.sDPPriorityOrder(), before);
}

// ---- kernel_math.h: the 16-lane forms of the kernels' helpers -----------------------------
// Each lane must compute exactly what the scalar helper computes for its element, so the
// vectorised softmax / cross-entropy loops give the bits a scalar loop would — in both index
// forms: Lanes (compares in 8-lane halves, the AVX2 clone's) and WideLanes (whole 16-lane
// compares, the AVX-512 clone's; select_less in kernel_math.h says why there are two).
namespace {

uint32_t float_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

template <class Index>
void expect_lanes_as_scalars(const std::vector<float>& x) {
  using namespace kernel;
  SCOPED_TRACE((std::is_same_v<Index, WideLanes> ? "WideLanes" : "Lanes"));
  std::vector<c10::BFloat16> h(x.size()), h_ref(x.size());
  std::vector<float> e(x.size()), back(x.size());
  for (size_t j = 0; j < x.size(); j += 16) {
    const auto v = ld(x.data(), Index{static_cast<int64_t>(j)});
    st(e.data(), Index{static_cast<int64_t>(j)}, exp_fast(v));
    st(h.data(), Index{static_cast<int64_t>(j)}, v);
  }
  for (size_t j = 0; j < x.size(); j += 16)
    st(back.data(), Index{static_cast<int64_t>(j)}, ld(h.data(), Index{static_cast<int64_t>(j)}));
  int exp_mismatch = 0, bf16_mismatch = 0, widen_mismatch = 0;
  for (size_t j = 0; j < x.size(); ++j) {
    const float want = exp_fast(x[j]);
    exp_mismatch += !(float_bits(e[j]) == float_bits(want) || (std::isnan(e[j]) && std::isnan(want)));
    st(h_ref.data(), static_cast<int64_t>(j), x[j]);
    bf16_mismatch += h[j].x != h_ref[j].x;
    widen_mismatch += float_bits(back[j]) != float_bits(widen(h_ref[j]));
  }
  EXPECT_EQ(exp_mismatch, 0);
  EXPECT_EQ(bf16_mismatch, 0);
  EXPECT_EQ(widen_mismatch, 0);
  // The groups' max against a scalar loop with the same rule (a NaN never replaces the
  // maximum), lane by lane; the groups' sum against the lanes' own float sums.
  const auto load = [&](auto j) { return ld(x.data(), j); };
  int64_t j = 0;
  const int64_t n = static_cast<int64_t>(x.size());
  const lanes16f mx = max_groups<Index>(n, j, -std::numeric_limits<float>::infinity(), load);
  EXPECT_EQ(j, n);
  // (the sum over the sweep alone, elements 32 to 415: finite, so every lane's bits count)
  const int64_t sum_from = 32, sum_n = 384;
  j = 0;
  const lanes16f sm = sum_groups<Index>(sum_n, j, [&](auto i) { return ld(x.data() + sum_from, i); });
  for (int k = 0; k < 16; ++k) {
    float want_max = -std::numeric_limits<float>::infinity(), want_sum = 0.0f;
    for (int64_t i = k; i < n; i += 16) want_max = x[i] > want_max ? x[i] : want_max;
    for (int64_t i = k; i < sum_n; i += 16) want_sum += x[sum_from + i];
    EXPECT_EQ(float_bits(mx[k]), float_bits(want_max)) << "lane " << k;
    EXPECT_EQ(float_bits(sm[k]), float_bits(want_sum)) << "lane " << k;
  }
}

}  // namespace

TEST(KernelMath, LanesComputeExactlyWhatTheScalarHelpersDo) {
  using namespace kernel;
  std::vector<float> x;  // the exp's special ranges, a sweep, then random bit patterns
  for (float v : {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(), -87.5f, -87.0f,
                  -86.99f, 0.0f, -0.0f, 1e-30f, 87.9f, 88.0f, 88.5f, 0.5f, -0.5f, 0.34657359f, 1.0f})
    x.push_back(v);
  for (int i = 0; i < 400; ++i) x.push_back(-100.0f + 0.47f * static_cast<float>(i));
  uint32_t state = 12345u;
  for (int i = 0; i < 4000; ++i) {
    state = state * 1664525u + 1013904223u;
    float v;
    std::memcpy(&v, &state, sizeof v);
    x.push_back(v);
  }
  x.resize(x.size() / 16 * 16);
  expect_lanes_as_scalars<Lanes>(x);
  expect_lanes_as_scalars<WideLanes>(x);
  // lane_max (the form wide_lanes() picks) against a scalar loop, on the whole sweep and on a
  // tail that is not a whole number of 16-lane groups.
  for (const int64_t n : {static_cast<int64_t>(x.size()), int64_t{37}}) {
    float want = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) want = x[j] > want ? x[j] : want;
    const float got =
        lane_max<float>(n, -std::numeric_limits<float>::infinity(), [&](auto j) { return ld(x.data(), j); });
    EXPECT_EQ(float_bits(got), float_bits(want)) << "n " << n;
  }
  // The scalar helpers themselves: e^x within a few ulp where it is representable, 0 below
  // the cut-off, bf16 rounding to nearest even, NaN kept NaN.
  for (float v : {-80.0f, -10.0f, -1.0f, -0.01f, 0.0f, 0.7f, 5.0f, 80.0f})
    EXPECT_NEAR(exp_fast(v), std::exp(v), 4e-7 * std::exp(v)) << v;
  EXPECT_EQ(exp_fast(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(exp_fast(-90.0f), 0.0f);
  EXPECT_EQ(narrow_to<c10::BFloat16>(1.0f + 1.0f / 256).x, narrow_to<c10::BFloat16>(1.0f).x);  // tie → even
  EXPECT_EQ(narrow_to<c10::BFloat16>(1.0f + 3.0f / 256).x, narrow_to<c10::BFloat16>(1.0f + 1.0f / 64).x);
  EXPECT_TRUE(std::isnan(widen(narrow_to<c10::BFloat16>(std::numeric_limits<float>::quiet_NaN()))));
  // The reductions: partial lanes over full groups plus a scalar tail.
  const int64_t n = 37;
  const float mx =
      lane_max<float>(n, -std::numeric_limits<float>::infinity(), [&](auto j) { return ld(x.data() + 100, j); });
  const float sm = lane_sum<float>(n, [&](auto j) { return ld(x.data() + 16, j); });
  float mx_ref = -std::numeric_limits<float>::infinity();
  double sm_ref = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    mx_ref = std::max(mx_ref, x[100 + j]);
    sm_ref += x[16 + j];
  }
  EXPECT_EQ(mx, mx_ref);
  EXPECT_NEAR(sm, sm_ref, 1e-5 * std::abs(sm_ref) + 1e-4);
  int visited = 0;
  for_lanes<float>(n, [&](auto j) {
    if constexpr (is_lanes_v<decltype(j)>)
      visited += 16;
    else
      visited += 1;
  });
  EXPECT_EQ(visited, n);
}

// ---- GEMM (kernels/gemm.h) against at::mm / at::linear -------------------------------------
namespace {

// op(M) as a [rows, cols] view of a row-major buffer with leading dimension ld (> the row
// length, so the padding is never read).
torch::Tensor op_view(const torch::Tensor& buf, int64_t rows, int64_t cols, int64_t ld, bool trans) {
  return trans ? buf.as_strided({rows, cols}, {1, ld}) : buf.as_strided({rows, cols}, {ld, 1});
}

}  // namespace

// The MFU reference's timing picks the product size from the speed: a slow product (25 ms, as
// bf16 emulated at 2048^3 would be many seconds) is timed at 256 only and briefly; a fast one
// grows to the largest size; the rate is the best of the timed runs. And the real GEMM's.
TEST(Gemm, PeakRateTimesASizeThatFitsTheSpeed) {
  std::vector<int64_t> sizes;
  const auto t0 = std::chrono::steady_clock::now();
  const double slow = gemm::best_product_rate(2048, [&sizes](int64_t n) -> std::function<void()> {
    sizes.push_back(n);
    return [] { std::this_thread::sleep_for(std::chrono::milliseconds(25)); };
  });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(sizes, std::vector<int64_t>({256}));
  EXPECT_LT(took, 2.0);
  EXPECT_LE(slow, 2.0 * 256 * 256 * 256 / 0.025);
  EXPECT_GT(slow, 2.0 * 256 * 256 * 256 / 0.25);
  sizes.clear();
  gemm::best_product_rate(2048, [&sizes](int64_t n) -> std::function<void()> {
    sizes.push_back(n);
    return [] {};
  });
  EXPECT_EQ(sizes, std::vector<int64_t>({256, 512, 1024, 2048}));
  EXPECT_GT(gemm::peak_flops(torch::kFloat, 512), 1e8);  // any CPU of the last decades
}

TEST(Gemm, TheLibraryIsChosenByTheRule) {
  const char* env = std::getenv("CTITAN_GEMM");
  const std::string want = env != nullptr ? env : "";
  if (want == "aten") {
    EXPECT_EQ(gemm::backend(), gemm::Backend::ATen);
    return;
  }
  // The GEMM entry points in the process: oneDNN's (PyPI's libdnnl linked by CMake, or a
  // LibTorch linking libdnnl, as Debian's) and MKL's (PyTorch's x86-64 wheels link MKL
  // statically and export it). Both: MKL on an Intel CPU, oneDNN elsewhere. ATen only when
  // neither is there.
  auto has = [](const char* s) { return dlsym(RTLD_DEFAULT, s) != nullptr; };
  const bool dnnl = has("dnnl_sgemm") && has("dnnl_gemm_bf16bf16f32");
  const bool mkl = has("sgemm_") && has("cblas_gemm_bf16bf16f32");
  __builtin_cpu_init();
  const bool intel = __builtin_cpu_is("intel");
  const auto expected = want == "onednn" ? gemm::Backend::OneDNN
                        : want == "mkl"  ? gemm::Backend::MKL
                        : dnnl && mkl    ? (intel ? gemm::Backend::MKL : gemm::Backend::OneDNN)
                        : dnnl           ? gemm::Backend::OneDNN
                        : mkl            ? gemm::Backend::MKL
                                         : gemm::Backend::ATen;
  EXPECT_EQ(gemm::backend(), expected) << gemm::backend_choice();
  const std::string choice = gemm::backend_choice();
  EXPECT_EQ(choice.rfind(gemm::backend_name(expected), 0), 0u) << choice;
  if (want.empty() && dnnl && mkl) {
    EXPECT_NE(choice.find(intel ? "an Intel CPU" : "not an Intel CPU"), std::string::npos) << choice;
    // Off Intel the small weights' gradients go to MKL (gemm.cpp's weight_grad), and the log says so.
    EXPECT_EQ(choice.find("MKL's for the weight gradients") != std::string::npos, !intel) << choice;
  }
#if defined(__x86_64__)
  // Every LibTorch ctitan is built and tested on here (PyTorch 2.13's wheel) exports MKL's.
  EXPECT_TRUE(mkl);
#endif
#ifdef CTITAN_ONEDNN
  EXPECT_TRUE(dnnl) << "CMake linked PyPI's libdnnl.so.3";
#endif
}

// PyPI's oneDNN is built on libgomp.so.1, as LibTorch's wheel is: linking it must not bring a
// second OpenMP runtime (a second thread pool fighting the first for the cores).
TEST(Gemm, OneOpenMPRuntimeInTheProcess) {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> gomps, dnnls;
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string base = path.substr(path.rfind('/') + 1);
    if (base.rfind("libgomp", 0) == 0 || base.rfind("libiomp", 0) == 0) gomps.insert(path);
    if (base.rfind("libdnnl", 0) == 0) dnnls.insert(path);
  }
  EXPECT_EQ(gomps.size(), 1u) << "OpenMP runtimes mapped: " << gomps.size();
#ifdef CTITAN_ONEDNN
  EXPECT_EQ(dnnls.size(), 1u);
#endif
}

TEST(Gemm, MatchesMatmulInEveryLayoutAlphaBeta) {
  const int64_t m = 37, n = 45, k = 29, pad = 3;
  for (auto type : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
    const auto ctype = type == torch::kDouble ? torch::kDouble : torch::kFloat;
    // bf16 too: exact products summed in fp32, on either backend
    const double tol = type == torch::kDouble ? 1e-13 : 2e-6;
    for (int layout = 0; layout < 4; ++layout) {
      for (double beta : {0.0, 1.5}) {
        const bool ta = layout & 1, tb = layout & 2;
        torch::manual_seed(layout * 10 + static_cast<int>(beta));
        const int64_t lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
        const auto abuf = torch::randn({(ta ? k : m) * lda}).to(type);
        const auto bbuf = torch::randn({(tb ? n : k) * ldb}).to(type);
        auto cbuf = torch::randn({m * ldc}).to(ctype);
        if (beta == 0.0) cbuf.fill_(std::numeric_limits<double>::quiet_NaN());  // must not be read
        const auto a = op_view(abuf, m, k, lda, ta), b = op_view(bbuf, k, n, ldb, tb);
        const auto c0 = op_view(cbuf, m, n, ldc, false).clone();
        const auto padding0 = cbuf.view({m, ldc}).narrow(1, n, pad).clone();
        const auto want = 0.5 * a.to(torch::kDouble).mm(b.to(torch::kDouble)) +
                          (beta == 0.0 ? torch::zeros({m, n}, torch::kDouble) : beta * c0.to(torch::kDouble));
        gemm::gemm(type, m, n, k, 0.5, {abuf.data_ptr(), lda, ta}, {bbuf.data_ptr(), ldb, tb}, beta, cbuf.data_ptr(),
                   ldc);
        const auto got = op_view(cbuf, m, n, ldc, false);
        SCOPED_TRACE(std::string(c10::toString(type)) + " layout " + std::to_string(layout) + " beta " +
                     std::to_string(beta));
        EXPECT_LT(rel_err(got, want), tol);
        // The padding between rows of C is left alone.
        EXPECT_TRUE(torch::allclose(cbuf.view({m, ldc}).narrow(1, n, pad), padding0, 0, 0, /*equal_nan=*/true));
      }
    }
  }
  // k = 0: the product is empty, C = beta · C.
  auto c = torch::ones({2, 3});
  gemm::gemm(torch::kFloat, 2, 3, 0, 1.0, {nullptr, 1, false}, {nullptr, 3, false}, 2.0, c.data_ptr(), 3);
  EXPECT_TRUE(torch::equal(c, torch::full({2, 3}, 2.0)));
}

TEST(Gemm, LinearMatchesAtenLinearAndItsGradients) {
  for (auto type : {torch::kFloat, torch::kBFloat16}) {
    for (bool strided_x : {false, true}) {
      torch::manual_seed(strided_x ? 5 : 6);
      // x [2, 7, 24], or the same shape viewing a transposed [24, 14]: not row-major (clone
      // keeps the strides)
      const auto x0 =
          strided_x ? torch::randn({24, 14}).to(type).t().reshape({2, 7, 24}) : torch::randn({2, 7, 24}).to(type);
      ASSERT_EQ(x0.is_contiguous(), !strided_x);
      const auto w0 = torch::randn({12, 24}).to(type);
      const auto g = torch::randn({2, 7, 12}).to(type);
      auto x = x0.detach().clone().requires_grad_(true), w = w0.detach().clone().requires_grad_(true);
      ASSERT_EQ(x.is_contiguous(), !strided_x);
      const auto y = gemm::linear(x, w);
      (y.to(torch::kFloat) * g.to(torch::kFloat)).sum().backward();
      // Reference: at::linear in float64 on the same values.
      auto xr = x0.to(torch::kDouble).requires_grad_(true), wr = w0.to(torch::kDouble).requires_grad_(true);
      const auto yr = at::linear(xr, wr);
      (yr * g.to(torch::kDouble)).sum().backward();
      SCOPED_TRACE(std::string(c10::toString(type)) + (strided_x ? " strided x" : ""));
      ASSERT_EQ(y.sizes(), yr.sizes());
      EXPECT_EQ(y.scalar_type(), type);
      EXPECT_EQ(w.grad().scalar_type(), type);
      const double tol = type == torch::kFloat ? 2e-6 : 1e-2;  // bf16: the result's own rounding
      EXPECT_LT(rel_err(y, yr), tol);
      EXPECT_LT(rel_err(x.grad(), xr.grad()), tol);
      EXPECT_LT(rel_err(w.grad(), wr.grad()), tol);
    }
  }
  // Only what needs a gradient gets one; under no_grad nothing is recorded.
  auto x = torch::randn({5, 8}), w = torch::randn({3, 8}).requires_grad_(true);
  gemm::linear(x, w).sum().backward();
  EXPECT_FALSE(x.grad().defined());
  EXPECT_TRUE(torch::allclose(w.grad(), x.sum(0).expand({3, 8}), 1e-5, 1e-5));
  torch::NoGradGuard ng;
  EXPECT_FALSE(gemm::linear(x, w).requires_grad());
}

// ---- incremental decoding (generate) -------------------------------------------------------

namespace {

// Logits of `tokens` [B, T] through forward_cached: a prefill of `prefill` positions, then one
// position at a time, concatenated -> [B, T, V].
template <class Model>
torch::Tensor cached_logits(Model& model, const torch::Tensor& tokens, int64_t prefill) {
  torch::NoGradGuard no_grad;
  const int64_t B = tokens.size(0), T = tokens.size(1);
  KVCache cache = model->new_cache(B, T, torch::kFloat);
  std::vector<torch::Tensor> parts{model->forward_cached(tokens.narrow(1, 0, prefill), cache)};
  for (int64_t t = prefill; t < T; ++t) parts.push_back(model->forward_cached(tokens.narrow(1, t, 1), cache));
  EXPECT_EQ(cache.pos, T);
  return torch::cat(parts, 1);
}

}  // namespace

// The KV-cache path computes what the training forward computes: every position's logits,
// whether it came in the prefill or one at a time, equal the full causal forward's (float32
// rounding apart), for grouped-query attention with RoPE scaling, on a batch of 2.
TEST(KVCache, LlamaDecodingOneTokenAtATimeMatchesTheFullForward) {
  auto a = llama3_flavor("debugmodel_gqa");  // 16 query heads, 8 kv heads, llama3 RoPE scaling
  a.n_layers = 2;
  a.vocab_size = 97;
  a.max_seq_len = 24;
  torch::manual_seed(5);
  Transformer model(a);
  model->init_weights();
  model->eval();
  const auto tokens = torch::randint(0, a.vocab_size, {2, 24}, torch::kLong);
  torch::Tensor full;
  {
    torch::NoGradGuard no_grad;
    full = model->forward(tokens);
  }
  for (int64_t prefill : {1, 7}) {
    const auto got = cached_logits(model, tokens, prefill);
    ASSERT_EQ(got.sizes(), full.sizes());
    EXPECT_LT((got - full).abs().max().item<double>(), 2e-5) << "prefill " << prefill;
    EXPECT_TRUE(torch::equal(got.argmax(-1), full.argmax(-1)));
  }
  // A cache too short for the positions asked for is an error, not a silent overwrite.
  torch::NoGradGuard no_grad;
  KVCache small = model->new_cache(2, 4, torch::kFloat);
  EXPECT_THROW(model->forward_cached(tokens.narrow(1, 0, 5), small), c10::Error);
}

TEST(KVCache, MixtralDecodingOneTokenAtATimeMatchesTheFullForward) {
  auto a = mixtral::mixtral_flavor("debugmodel");
  a.n_layers = 2;
  a.n_kv_heads = 4;
  a.vocab_size = 97;
  a.max_seq_len = 20;
  torch::manual_seed(6);
  mixtral::Transformer model(a);
  model->init_weights();
  model->eval();
  const auto tokens = torch::randint(0, a.vocab_size, {2, 20}, torch::kLong);
  torch::Tensor full;
  {
    torch::NoGradGuard no_grad;
    full = model->forward(tokens);
  }
  const auto got = cached_logits(model, tokens, 5);
  ASSERT_EQ(got.sizes(), full.sizes());
  EXPECT_LT((got - full).abs().max().item<double>(), 2e-5);
  EXPECT_TRUE(torch::equal(got.argmax(-1), full.argmax(-1)));
}
