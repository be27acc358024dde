// LR schedule values at chosen steps (worked out by hand from torchtitan's formula),
// gradient clipping against a norm computed here, the metrics JSON line.
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <malloc.h>
#include <sys/resource.h>

#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "components/cpu_allocator.h"
#include "components/lr_scheduler.h"
#include "components/metrics.h"
#include "components/optimizer.h"
#include "components/system.h"

using namespace ctitan;

TEST(LRScheduler, WarmupStableLinearDecay) {
  // steps 10, warmup 2, decay_ratio 0.8 → decay 8, stable 10 + 1 - 2 - 8 = 1.
  LRScheduleSpec s;
  s.training_steps = 10;
  s.warmup_steps = 2;
  s.decay_ratio = 0.8;
  s.decay_type = "linear";
  LRScheduler lr(8e-4, s);
  EXPECT_EQ(lr.warmup_steps(), 2);
  EXPECT_EQ(lr.decay_steps(), 8);
  EXPECT_EQ(lr.stable_steps(), 1);
  EXPECT_DOUBLE_EQ(lr.lr_for_step(1), 8e-4 * 0.5);     // (0+1)/2
  EXPECT_DOUBLE_EQ(lr.lr_for_step(2), 8e-4);           // (1+1)/2
  EXPECT_DOUBLE_EQ(lr.lr_for_step(3), 8e-4);           // stable
  EXPECT_DOUBLE_EQ(lr.lr_for_step(4), 8e-4 * 0.875);   // progress (4-3)/8
  EXPECT_DOUBLE_EQ(lr.lr_for_step(10), 8e-4 * 0.125);  // progress 7/8: last step is not 0
}

TEST(LRScheduler, DecayStepsRoundHalvesToEvenAsPythonsRound) {
  // torchtitan: decay_steps = round(training.steps * decay_ratio), Python's round.
  LRScheduleSpec s;
  s.decay_ratio = 0.5;
  for (const auto& [steps, decay] : std::vector<std::pair<int64_t, int64_t>>{{5, 2}, {7, 4}, {9, 4}, {3, 2}, {6, 3}}) {
    s.training_steps = steps;  // 2.5 -> 2, 3.5 -> 4, 4.5 -> 4, 1.5 -> 2, 3 -> 3
    EXPECT_EQ(LRScheduler(1.0, s).decay_steps(), decay) << steps << " steps";
  }
  s.training_steps = 10;
  s.decay_ratio = 0.26;  // 2.6 -> 3, not a tie
  EXPECT_EQ(LRScheduler(1.0, s).decay_steps(), 3);
}

TEST(LRScheduler, CosineAndSqrtWithMinFactor) {
  LRScheduleSpec s;
  s.training_steps = 100;
  s.warmup_steps = 10;
  s.decay_ratio = std::nullopt;  // decay over everything after warmup: 90 steps, stable 1
  s.min_lr_factor = 0.1;
  s.decay_type = "cosine";
  LRScheduler c(1.0, s);
  EXPECT_EQ(c.decay_steps(), 90);
  EXPECT_EQ(c.stable_steps(), 1);
  // position 55: progress (56 - 11) / 90 = 0.5 → cos term 0.5 → 0.1 + 0.9 * 0.5.
  EXPECT_NEAR(c.factor(55), 0.55, 1e-12);
  s.decay_type = "sqrt";
  LRScheduler q(1.0, s);
  EXPECT_NEAR(q.factor(32), 0.1 + 0.9 * (1 - std::sqrt(22.0 / 90)), 1e-12);
}

TEST(LRScheduler, WarmupLongerThanTrainingIsCapped) {
  LRScheduleSpec s;
  s.training_steps = 5;
  s.warmup_steps = 50;
  LRScheduler lr(1.0, s);
  EXPECT_EQ(lr.warmup_steps(), 5);
  EXPECT_EQ(lr.decay_steps(), 0);
  EXPECT_DOUBLE_EQ(lr.lr_for_step(5), 1.0);
}

TEST(Optimizer, ClipGradNormMatchesManualNorm) {
  auto a = torch::randn({3, 4}, torch::requires_grad());
  auto b = torch::randn({5}, torch::requires_grad());
  (a.pow(2).sum() * 3 + b.sum() * 2).backward();
  const double manual = std::sqrt(a.grad().pow(2).sum().item<double>() + b.grad().pow(2).sum().item<double>());
  auto ga = a.grad().clone();
  const double n = clip_grad_norm({a, b}, manual / 2);
  EXPECT_NEAR(n, manual, 1e-5 * manual);
  const double after = std::sqrt(a.grad().pow(2).sum().item<double>() + b.grad().pow(2).sum().item<double>());
  EXPECT_NEAR(after, manual / 2, 1e-4 * manual);
  EXPECT_TRUE(torch::allclose(a.grad(), ga * (manual / 2) / (manual + 1e-6), 1e-5, 1e-6));
}

TEST(Optimizer, AdamWStepMatchesFormula) {
  // One AdamW step from zero state: p ← p·(1 − lr·wd) − lr · m̂ / (sqrt(v̂) + eps), m̂ = g, v̂ = g².
  auto p = torch::tensor({1.0f, -2.0f}, torch::requires_grad());
  auto opt = build_optimizer({p}, OptimizerSpec{"AdamW", 0.1, 0.9, 0.95, 1e-8, 0.1});
  p.mutable_grad() = torch::tensor({0.5f, -0.25f});
  opt->step();
  EXPECT_NEAR(p[0].item<float>(), 1.0 * (1 - 0.01) - 0.1 * 1.0, 1e-6);
  EXPECT_NEAR(p[1].item<float>(), -2.0 * (1 - 0.01) + 0.1 * 1.0, 1e-6);
  set_learning_rate(*opt, 0.5);
  EXPECT_DOUBLE_EQ(opt->param_groups()[0].options().get_lr(), 0.5);
}

// ctitan's AdamW is a one-pass fused kernel; torch::optim::AdamW is the reference: several
// steps with changing learning rates, weight decay and uneven sizes (chunk boundaries).
TEST(Optimizer, FusedAdamWMatchesTorchAdamW) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> mine, ref;
  for (int64_t n : {7, 65536 + 13, 3 * 65536}) {
    auto p = torch::randn({n});
    mine.push_back(p.clone().requires_grad_(true));
    ref.push_back(p.clone().requires_grad_(true));
  }
  auto opt = build_optimizer(mine, OptimizerSpec{"AdamW", 1e-2, 0.9, 0.95, 1e-8, 0.1});
  torch::optim::AdamW torch_opt(ref, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  for (int step = 1; step <= 6; ++step) {
    set_learning_rate(*opt, 1e-2 * step);
    for (auto& g : torch_opt.param_groups()) g.options().set_lr(1e-2 * step);
    for (size_t i = 0; i < mine.size(); ++i) {
      auto g = torch::randn(mine[i].sizes()) * static_cast<double>(i + 1);
      mine[i].mutable_grad() = g.clone();
      ref[i].mutable_grad() = g.clone();
    }
    opt->step();
    torch_opt.step();
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    const double scale = ref[i].abs().max().item<double>();
    EXPECT_LT((mine[i] - ref[i]).abs().max().item<double>() / scale, 1e-6) << "param " << i;
    EXPECT_FALSE(torch::equal(mine[i], mine[i].detach().clone().zero_()));
  }
  // Same state objects as torch's (what checkpoints save): step count and both moments.
  ASSERT_EQ(opt->state().size(), torch_opt.state().size());
  for (size_t i = 0; i < mine.size(); ++i) {
    const auto& a = static_cast<torch::optim::AdamWParamState&>(*opt->state().at(mine[i].unsafeGetTensorImpl()));
    const auto& b = static_cast<torch::optim::AdamWParamState&>(*torch_opt.state().at(ref[i].unsafeGetTensorImpl()));
    EXPECT_EQ(a.step(), 6);
    for (const auto& [x, y] : {std::pair{a.exp_avg(), b.exp_avg()}, std::pair{a.exp_avg_sq(), b.exp_avg_sq()}})
      EXPECT_LT((x - y).abs().max().item<double>() / y.abs().max().item<double>(), 1e-6) << "moment of " << i;
  }
}

// step_unless: a true flag leaves parameters, moments and step counts exactly as they were
// (what training.on_nonfinite = "skip" saves); a false one is the plain step, bitwise. The
// same for torch::optim::Adam, which reads the flag on the host. clip_grad_norm_tensor is
// clip_grad_norm's norm, bitwise, and clips the same.
TEST(Optimizer, StepUnlessSkipsTheWholeUpdateAndOtherwiseIsTheStep) {
  for (const char* name : {"AdamW", "Adam"}) {
    torch::manual_seed(5);
    auto init = torch::randn({70000});
    auto a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
    auto opt_a = build_optimizer({a}, OptimizerSpec{name, 1e-2, 0.9, 0.95, 1e-8, 0.1});
    auto opt_b = build_optimizer({b}, OptimizerSpec{name, 1e-2, 0.9, 0.95, 1e-8, 0.1});
    for (int step = 1; step <= 4; ++step) {
      auto g = torch::randn({70000});
      a.mutable_grad() = g.clone();
      b.mutable_grad() = g.clone();
      const auto before = a.detach().clone();
      if (step == 2) {
        step_unless(*opt_a, torch::tensor(true));
        EXPECT_TRUE(torch::equal(a, before)) << name << ": a skipped step changed the parameter";
        continue;  // b skips step 2 by not stepping at all
      }
      step_unless(*opt_a, torch::tensor(false));
      opt_b->step();
      EXPECT_TRUE(torch::equal(a, b)) << name << " step " << step;
    }
    auto state = [](torch::optim::Optimizer& o) -> torch::optim::OptimizerParamState& {
      return *o.state().begin()->second;
    };
    if (std::string(name) == "AdamW") {
      const auto& sa = static_cast<torch::optim::AdamWParamState&>(state(*opt_a));
      const auto& sb = static_cast<torch::optim::AdamWParamState&>(state(*opt_b));
      EXPECT_EQ(sa.step(), 3);
      EXPECT_EQ(sa.step(), sb.step());
      EXPECT_TRUE(torch::equal(sa.exp_avg(), sb.exp_avg()) && torch::equal(sa.exp_avg_sq(), sb.exp_avg_sq()));
    } else {
      EXPECT_EQ(static_cast<torch::optim::AdamParamState&>(state(*opt_a)).step(), 3);
    }
  }
  auto x = torch::randn({3, 5}, torch::requires_grad()), y = torch::randn({3, 5}, torch::requires_grad());
  x.mutable_grad() = torch::randn({3, 5}) * 4;
  y.mutable_grad() = x.grad().clone();
  const auto n = clip_grad_norm_tensor({x}, 1.0);
  EXPECT_EQ(n.scalar_type(), torch::kFloat64);
  EXPECT_EQ(n.item<double>(), clip_grad_norm({y}, 1.0));
  EXPECT_TRUE(torch::equal(x.grad(), y.grad()));
}

// The GPU step's clip: grad_norm_for_step leaves GPU gradients alone and returns the factor
// torch's fused AdamW divides them by (its grad_scale). Both halves run here on CPU tensors:
// ATen's _fused_adamw_ has a CPU kernel with the same contract, and step_unless's fallback
// (any optimizer) divides before stepping; each must equal clipping first, then stepping.
TEST(Optimizer, ClipAsTheFusedAdamWsGradScaleIsTheClipThenTheStep) {
  torch::manual_seed(6);
  const auto init = torch::randn({5000});
  const auto g = torch::randn({5000}) * 3;  // norm ~212: clipped to 1
  // Reference: the clip as the CPU applies it, then AdamW.
  auto ref = init.clone().requires_grad_(true);
  ref.mutable_grad() = g.clone();
  const double norm = clip_grad_norm({ref}, 1.0);
  auto ref_opt = build_optimizer({ref}, OptimizerSpec{"AdamW", 1e-2, 0.9, 0.95, 1e-8, 0.1});
  ref_opt->step();
  // The factor, as grad_norm_for_step computes it on the device: (norm + 1e-6) / max_norm.
  const auto scale = torch::tensor((norm + 1e-6) / 1.0, torch::kFloat);
  // torch's fused kernel with grad_scale, on the unclipped gradient.
  auto p = init.clone(), m = torch::zeros({5000}), v = torch::zeros({5000}), step = torch::zeros({});
  auto graw = g.clone();
  step.add_(1);
  at::_fused_adamw_({p}, {graw}, {m}, {v}, {}, {step}, 1e-2, 0.9, 0.95, 0.1, 1e-8, false, false, scale, std::nullopt);
  EXPECT_LT((p - ref.detach()).abs().max().item<double>(), 1e-6);
  EXPECT_GT((p - init).abs().max().item<double>(), 1e-3);  // it did move
  // step_unless's own division (a non-fused optimizer here: plain Adam).
  auto a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
  a.mutable_grad() = g.clone();
  b.mutable_grad() = g / scale;
  auto opt_a = build_optimizer({a}, OptimizerSpec{"Adam", 1e-2, 0.9, 0.95, 1e-8, 0.1});
  auto opt_b = build_optimizer({b}, OptimizerSpec{"Adam", 1e-2, 0.9, 0.95, 1e-8, 0.1});
  step_unless(*opt_a, torch::tensor(false), scale);
  opt_b->step();
  EXPECT_TRUE(torch::equal(a, b));
}

// The CPU step's clip: grad_norm_for_step leaves CPU gradients as they are and returns the
// factor clip_grad_norm multiplies them by; step_unless applies it inside the fused AdamW's
// pass (or, for other optimizers, to the gradients first). Either way the update is bitwise the
// clip-then-step one, and with no clip (norm under max_norm) the factor is exactly 1.
// bf16 gradients (FSDP over one rank keeps the compute dtype's gradients): the norm and the
// AdamW step read them widened, which is exact, so both are bitwise those of the float32 cast,
// clipped or not, over several steps (the moments carry every difference forward). A
// gradient rounded to bf16 differs from the float32 one, so the float32 side gets the cast.
TEST(Optimizer, Bf16GradientsGiveBitwiseTheStepOfTheirFloat32Cast) {
  torch::manual_seed(8);
  const auto init = torch::randn({70001});  // more than one chunk of the fused loop, and a tail
  for (const double scale : {3.0, 1e-4}) {  // clipped; not
    auto a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
    auto opt_a = build_optimizer({a}, OptimizerSpec{"AdamW", 1e-2, 0.9, 0.95, 1e-8, 0.1});
    auto opt_b = build_optimizer({b}, OptimizerSpec{"AdamW", 1e-2, 0.9, 0.95, 1e-8, 0.1});
    for (int step = 1; step <= 3; ++step) {
      const auto g16 = (torch::randn({70001}) * scale).to(torch::kBFloat16);
      a.mutable_grad() = g16.clone();
      b.mutable_grad() = g16.to(torch::kFloat);
      const GradNorm na = grad_norm_for_step({a}, 1.0), nb = grad_norm_for_step({b}, 1.0);
      EXPECT_EQ(na.norm.item<double>(), nb.norm.item<double>()) << "step " << step;
      EXPECT_EQ(na.cpu_grad_coef, nb.cpu_grad_coef);
      // The norm is the float64 one of the values (not of a bf16-rounded sum).
      EXPECT_NEAR(na.norm.item<double>(), g16.to(torch::kFloat64).norm().item<double>(),
                  1e-12 * na.norm.item<double>());
      step_unless(*opt_a, torch::tensor(false), na.grad_scale, na.cpu_grad_coef);
      step_unless(*opt_b, torch::tensor(false), nb.grad_scale, nb.cpu_grad_coef);
      EXPECT_EQ(a.grad().scalar_type(), torch::kBFloat16);  // read as it is, not replaced by a cast
      EXPECT_TRUE(torch::equal(a, b)) << "step " << step << " scale " << scale;
    }
    EXPECT_GT((a - init).abs().max().item<double>(), 1e-3);  // it did move
  }
}

TEST(Optimizer, CpuClipInsideTheStepIsBitwiseTheClipThenTheStep) {
  torch::manual_seed(7);
  const auto init = torch::randn({70001});  // not a multiple of the fused loop's chunk
  for (const char* name : {"AdamW", "Adam"}) {
    for (const double scale : {3.0, 1e-4}) {  // norm ~794: clipped; norm ~0.03: not
      auto a = init.clone().requires_grad_(true), b = init.clone().requires_grad_(true);
      auto opt_a = build_optimizer({a}, OptimizerSpec{name, 1e-2, 0.9, 0.95, 1e-8, 0.1});
      auto opt_b = build_optimizer({b}, OptimizerSpec{name, 1e-2, 0.9, 0.95, 1e-8, 0.1});
      for (int step = 1; step <= 3; ++step) {
        const auto g = torch::randn({70001}) * scale;
        a.mutable_grad() = g.clone();
        b.mutable_grad() = g.clone();
        const GradNorm gn = grad_norm_for_step({a}, 1.0);
        EXPECT_FALSE(gn.grad_scale.defined());
        EXPECT_EQ(gn.norm.item<double>(), clip_grad_norm({b}, 1.0)) << name;
        if (scale > 1) {
          EXPECT_LT(gn.cpu_grad_coef, 1e-2) << name;
          if (std::string(name) == "AdamW") {
            EXPECT_TRUE(torch::equal(a.grad(), g)) << "the gradient was clipped before the fused step";
          }
        } else {
          EXPECT_EQ(gn.cpu_grad_coef, 1.0) << name;
        }
        step_unless(*opt_a, torch::tensor(false), gn.grad_scale, gn.cpu_grad_coef);
        opt_b->step();
        EXPECT_TRUE(torch::equal(a, b)) << name << " step " << step << " scale " << scale;
      }
      if (std::string(name) == "AdamW") {
        const auto& x = static_cast<torch::optim::AdamWParamState&>(*opt_a->state().at(a.unsafeGetTensorImpl()));
        const auto& y = static_cast<torch::optim::AdamWParamState&>(*opt_b->state().at(b.unsafeGetTensorImpl()));
        EXPECT_TRUE(torch::equal(x.exp_avg(), y.exp_avg()) && torch::equal(x.exp_avg_sq(), y.exp_avg_sq()));
      }
    }
  }
}

TEST(Metrics, JsonLineHasTheContractFields) {
  StepMetrics m;
  m.step = 3;
  m.loss = 7.25;
  m.extra = {{"load_balance_loss", 0.5}};
  const std::string j = MetricsLogger::to_json(m);
  for (const char* k : {"\"step\": 3", "\"loss\": 7.25", "\"grad_norm\"", "\"lr\"", "\"tps\"", "\"tflops\"", "\"mfu\"",
                        "\"memory_gib\"", "\"data_loading_s\"", "\"elapsed_s\"", "\"load_balance_loss\": 0.5"})
    EXPECT_NE(j.find(k), std::string::npos) << k << " in " << j;
  EXPECT_EQ(format_duration(3725), "1h02m");
  EXPECT_EQ(format_duration(185), "3m05s");
}

// A spike is a loss above factor × the mean of the previous (up to) 20 finite losses, once
// 5 are known; non-finite losses are ignored; factor 0 never warns.
TEST(Metrics, LossSpikeDetector) {
  LossSpikeDetector d(3.0);
  EXPECT_EQ(d.observe(2.0), 0.0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(d.observe(100.0), 0.0) << "fewer than 5 losses known";
  EXPECT_EQ(d.observe(std::nan("")), 0.0);  // ignored, not recorded
  EXPECT_EQ(d.observe(2.0), 0.0);           // 5th value: still fewer than 5 before it
  // History 2, 100, 100, 100, 2: mean 60.8.
  EXPECT_EQ(d.observe(182.0), 0.0);                                     // < 3 × 60.8 = 182.4
  EXPECT_DOUBLE_EQ(d.observe(250.0), (2 + 100 * 3 + 2 + 182.0) / 6.0);  // > 3 × 81
  // The window keeps the last 20: after 20 ones the mean is exactly 1.
  for (int i = 0; i < 20; ++i) d.observe(1.0);
  EXPECT_EQ(d.observe(2.9), 0.0);
  EXPECT_DOUBLE_EQ(d.observe(3.3), (19 + 2.9) / 20.0);  // 3.3 > 3 × 1.095
  LossSpikeDetector never(0.0);
  for (int i = 0; i < 10; ++i) never.observe(1.0);
  EXPECT_EQ(never.observe(1e9), 0.0);
}

TEST(System, BlasIsDetectedAndMemoryIsRead) {
  auto info = detect_blas();
  EXPECT_FALSE(info.library.empty());  // Debian's LibTorch resolves sgemm_ from libblas.so.3
  EXPECT_GT(peak_rss_gib(), 0.0);
  EXPECT_GE(peak_rss_gib(), current_rss_gib() * 0.99);
}

// ---------------------------------------------------------------------------------------
// The caching CPU allocator (components/cpu_allocator.h). ctest runs every TEST in its own
// process, so each starts with LibTorch's default allocator.
namespace {
int64_t minor_faults() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}
// A clean cache with room, whatever a test before this one in the same process left.
void fresh_cache() {
  ASSERT_TRUE(install_caching_cpu_allocator());
  set_max_cached_cpu_bytes(int64_t{1} << 30);
  release_cached_cpu_memory();
}
// Allocates and touches `rounds` tensors of `bytes` one after the other; minor page faults.
int64_t faults_of_alloc_loop(int64_t bytes, int rounds) {
  const int64_t before = minor_faults();
  for (int i = 0; i < rounds; ++i) {
    auto t = torch::empty({bytes}, torch::kUInt8);
    t.fill_(static_cast<uint8_t>(i));
  }
  return minor_faults() - before;
}
}  // namespace

TEST(CpuAllocator, ReusesLargeBlocksWithoutNewPageFaults) {
  mallopt(M_MMAP_THRESHOLD, 1 << 20);  // as the train executable sets it
  torch::set_num_threads(1);
  const int64_t bytes = 16 << 20, pages = bytes / 4096;
  const int rounds = 20;
  // Reference: LibTorch's default allocator maps and faults every page of every round.
  const int64_t system_faults = faults_of_alloc_loop(bytes, rounds);
  EXPECT_GE(system_faults, rounds * pages * 9 / 10);

  ASSERT_TRUE(install_caching_cpu_allocator());
  ASSERT_TRUE(cpu_allocator_stats().installed);
  faults_of_alloc_loop(bytes, 1);  // first use maps the block
  const auto s0 = cpu_allocator_stats();
  const int64_t cached_faults = faults_of_alloc_loop(bytes, rounds);
  const auto s1 = cpu_allocator_stats();
  EXPECT_LT(cached_faults, pages / 4) << "system allocator: " << system_faults;
  EXPECT_EQ(s1.hits - s0.hits, rounds);
  EXPECT_EQ(s1.misses, s0.misses);
  EXPECT_EQ(s1.cached_bytes, bytes);
  EXPECT_EQ(s1.live_bytes, 0);
}

TEST(CpuAllocator, SizeToleranceBoundAndRelease) {
  fresh_cache();
  const int64_t mib = 1 << 20;
  void* p8 = nullptr;
  {
    auto a = torch::empty({8 * mib}, torch::kUInt8);
    p8 = a.data_ptr();
  }
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 8 * mib);
  {
    // 7.5 MiB: within 1/8 of the cached 8 MiB block, which serves it.
    auto b = torch::empty({15 * mib / 2}, torch::kUInt8);
    EXPECT_EQ(b.data_ptr(), p8);
    EXPECT_EQ(cpu_allocator_stats().cached_bytes, 0);
    // 4 MiB while the block is taken, and 4 MiB would waste half of it anyway: new memory.
    auto c = torch::empty({4 * mib}, torch::kUInt8);
    EXPECT_NE(c.data_ptr(), p8);
  }
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 12 * mib);
  {
    auto d = torch::empty({4 * mib}, torch::kUInt8);  // the 8 MiB block is 2x too large
    EXPECT_NE(d.data_ptr(), p8);
    EXPECT_EQ(cpu_allocator_stats().cached_bytes, 8 * mib);
  }
  // Cached blocks are malloc'ed but hold no tensor: heap_in_use_gib does not count them.
  const double in_use = heap_in_use_gib();
  const struct mallinfo2 mi = mallinfo2();
  const double malloc_in_use = static_cast<double>(mi.uordblks + mi.hblkhd) / (1 << 30);
  EXPECT_NEAR(malloc_in_use - in_use, 12.0 * mib / (1 << 30), 1e-9);
  // A bound below what is cached releases the largest blocks until the rest fits.
  set_max_cached_cpu_bytes(5 * mib);
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 4 * mib);
  {
    auto e = torch::empty({2 * mib}, torch::kUInt8);  // does not fit beside 4 MiB: freed
  }
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 4 * mib);
  release_cached_cpu_memory();
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 0);
  EXPECT_EQ(cpu_allocator_stats().cached_blocks, 0);
  // raw_allocate / raw_deallocate (oneDNN's bf16 matmuls use them) go through the cache too.
  auto* cpu = c10::GetCPUAllocator();
  void* raw = cpu->raw_allocate(3 * mib);
  EXPECT_EQ(cpu_allocator_stats().live_bytes, 3 * mib);
  cpu->raw_deallocate(raw);
  EXPECT_EQ(cpu_allocator_stats().live_bytes, 0);
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 3 * mib);
  release_cached_cpu_memory();
  // Small tensors bypass the cache.
  { auto f = torch::empty({1000}, torch::kFloat); }
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 0);
}

// A request the system cannot meet: the cache's blocks go back first, then c10's
// out-of-memory error names the bytes asked for (train's failure line quotes them).
TEST(CpuAllocator, OutOfMemoryReleasesTheCacheAndNamesTheSize) {
  fresh_cache();
  { auto a = torch::empty({8 << 20}, torch::kUInt8); }
  ASSERT_EQ(cpu_allocator_stats().cached_bytes, 8 << 20);
  const int64_t huge = int64_t{1} << 50;  // 1 PiB: more than any address space
  try {
    auto t = torch::empty({huge}, torch::kUInt8);
    FAIL() << "1 PiB was allocated";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("CPU allocator: out of memory: tried to allocate " + std::to_string(huge) +
                        " bytes after releasing 8 MiB of cached blocks"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_EQ(cpu_allocator_stats().cached_bytes, 0);
  EXPECT_EQ(cpu_allocator_stats().live_bytes, 0);
  auto ok = torch::ones({4 << 20}, torch::kUInt8);  // and the allocator still works
  EXPECT_EQ(ok.sum().item<int64_t>(), 4 << 20);
}

TEST(CpuAllocator, ConcurrentTensorsNeverShareMemory) {
  fresh_cache();
  const auto s0 = cpu_allocator_stats();
  const std::vector<int64_t> sizes = {1 << 20, 3 << 19, 2 << 20, 3 << 20, 5 << 20};
  std::atomic<int> corrupt{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 150; ++i) {
        const int64_t n = sizes[(i * 7 + t) % sizes.size()] / 4;
        auto a = torch::full({n}, static_cast<float>(t * 1000 + i));
        auto b = torch::full({n / 2 + 1}, static_cast<float>(-t - 1));
        std::this_thread::yield();
        if (!a.eq(static_cast<float>(t * 1000 + i)).all().item<bool>()) ++corrupt;
        if (!b.eq(static_cast<float>(-t - 1)).all().item<bool>()) ++corrupt;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupt.load(), 0);
  const auto s = cpu_allocator_stats();
  EXPECT_EQ(s.live_bytes, 0);
  EXPECT_GT(s.hits - s0.hits, 0);
  EXPECT_LE(s.misses - s0.misses, 4 * 2 * static_cast<int64_t>(sizes.size()) * 2);
}
