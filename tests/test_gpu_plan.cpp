// The GPU path's decisions that hold without a GPU (issue 17): which device a rank picks, the
// FSDP stream/event plan, the pinned staging buffer's bookkeeping; and, in the CUDA build
// only, that the NCCL process group is linked. Milliseconds: no rank is spawned.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "checkpoint/staging.h"
#include "config/errors.h"
#include "parallelisms/comm.h"
#include "parallelisms/device.h"
#include "parallelisms/fsdp_stream_plan.h"
#include "parallelisms/launch_env.h"

#ifdef CTITAN_WITH_CUDA
#include <cuda_runtime_api.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "kernels/fused_cuda.h"
#include "kernels/fused_ops.h"
#include "parallelisms/nccl.h"
#endif

using namespace ctitan;

// ---------------------------------------------------------------- device selection
TEST(DeviceChoice, CpuBuildAlwaysPicksTheCpu) {
  DeviceFacts f;
  f.built_with_cuda = false;
  f.visible_gpus = 8;  // a CPU build cannot use them
  f.local_rank = 3;
  f.local_world_size = 8;
  const auto c = choose_device(f);
  EXPECT_FALSE(c.cuda);
  EXPECT_EQ(c.name(), "cpu");
  EXPECT_EQ(c.why, "this build has no CUDA");
}

TEST(DeviceChoice, CudaBuildWithoutVisibleGpuPicksTheCpu) {
  DeviceFacts f;
  f.built_with_cuda = true;
  f.visible_gpus = 0;
  f.local_rank = 1;
  f.local_world_size = 2;
  EXPECT_EQ(choose_device(f).name(), "cpu");
  EXPECT_EQ(choose_device(f).why, "no GPU visible");
  f.cuda_visible_devices_set = true;  // CUDA_VISIBLE_DEVICES= : the CPU reference of gpu_check.sh
  EXPECT_EQ(choose_device(f).why, "no GPU visible (CUDA_VISIBLE_DEVICES is empty)");
}

TEST(DeviceChoice, LocalRankPicksItsGpu) {
  DeviceFacts f;
  f.built_with_cuda = true;
  f.visible_gpus = 4;
  f.local_world_size = 4;
  for (int64_t r = 0; r < 4; ++r) {
    f.local_rank = r;
    const auto c = choose_device(f);
    EXPECT_TRUE(c.cuda);
    EXPECT_EQ(c.index, r);
    EXPECT_EQ(c.name(), "cuda:" + std::to_string(r));
  }
  f.local_rank = 1;
  f.cuda_visible_devices_set = true;
  f.cuda_visible_devices = "4,5,6,7";
  EXPECT_EQ(choose_device(f).why, "LOCAL_RANK=1, 4 GPUs visible (CUDA_VISIBLE_DEVICES=4,5,6,7)");
}

TEST(DeviceChoice, MoreRanksThanGpusIsOneLineUserError) {
  DeviceFacts f;
  f.built_with_cuda = true;
  f.visible_gpus = 2;
  f.local_rank = 2;
  f.local_world_size = 4;
  f.cuda_visible_devices_set = true;
  f.cuda_visible_devices = "0,1";
  try {
    choose_device(f);
    FAIL() << "no error";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "device: LOCAL_RANK=2 of LOCAL_WORLD_SIZE=4 but only 2 GPUs visible (CUDA_VISIBLE_DEVICES=0,1); "
              "start at most 2 ranks per node (NPROC / --nproc-per-node) or make more GPUs visible");
  }
  // Rank 0 of the same node fails alike, so no rank of the job starts on a GPU another shares.
  f.local_rank = 0;
  EXPECT_THROW(choose_device(f), UserError);
}

TEST(DeviceChoice, FactsOfThisProcessComeFromTheLaunchEnvAndTheCudaRuntime) {
  const auto env = detect_launch_env({{"RANK", "5"},
                                      {"WORLD_SIZE", "8"},
                                      {"LOCAL_RANK", "1"},
                                      {"LOCAL_WORLD_SIZE", "4"},
                                      {"MASTER_ADDR", "127.0.0.1"},
                                      {"MASTER_PORT", "29500"}});
  const auto f = device_facts(env.local_rank, env.local_world_size);
  EXPECT_EQ(f.local_rank, 1);
  EXPECT_EQ(f.local_world_size, 4);
#ifdef CTITAN_WITH_CUDA
  EXPECT_TRUE(f.built_with_cuda);
#else
  EXPECT_FALSE(f.built_with_cuda);
#endif
  // LibTorch's own count (0 without CUDA in the build or without a GPU).
  EXPECT_EQ(f.visible_gpus, static_cast<int64_t>(torch::cuda::device_count()));
  if (f.visible_gpus == 0) {
    EXPECT_EQ(choose_device(f).name(), "cpu");
  }
}

// ---------------------------------------------------------------- FSDP stream plan
namespace {

std::vector<bool> default_reshard(int64_t n) {  // torchtitan: every unit but the last
  std::vector<bool> r(n, true);
  r.back() = false;
  return r;
}

std::vector<PlanOp> plan(int64_t n, std::vector<bool> reshard, bool prefetch) {
  StreamPlanOptions o;
  o.units = n;
  o.reshard_after_forward = std::move(reshard);
  o.prefetch = prefetch;
  return fsdp_stream_plan(o);
}

ptrdiff_t find(const std::vector<PlanOp>& ops, PlanOp::Kind k, int64_t unit, size_t from = 0) {
  for (size_t i = from; i < ops.size(); ++i)
    if (ops[i].kind == k && ops[i].unit == unit) return static_cast<ptrdiff_t>(i);
  return -1;
}

// Runs the plan as three streams would (each in its own order, a wait blocking until the
// event is recorded; compute and reduce-scatters take one time unit, all-gathers
// `gather_cost`, waits, records and frees none): the finish time, or -1 on a deadlock. Also checks, as it goes, that a unit's parameters are gathered
// whenever compute runs it, and that gradients exist when they are reduced.
struct Sim {
  double finish = -1;
  std::vector<std::string> errors;
};

Sim simulate(const std::vector<PlanOp>& ops, double gather_cost) {
  Sim sim;
  std::map<PlanStream, std::vector<const PlanOp*>> per;
  for (const auto& op : ops) per[op.stream].push_back(&op);
  std::map<PlanStream, size_t> pc;
  std::map<PlanStream, double> clock;
  std::map<std::string, double> recorded;
  std::map<int64_t, double> gathered_at, freed_at;  // unit → completion times
  bool progress = true;
  while (progress) {
    progress = false;
    for (auto& [s, list] : per) {
      while (pc[s] < list.size()) {
        const PlanOp& op = *list[pc[s]];
        if (op.kind == PlanOp::WaitEvent) {
          auto it = recorded.find(op.event);
          if (it == recorded.end()) break;  // blocked
          clock[s] = std::max(clock[s], it->second);
        } else if (op.kind == PlanOp::RecordEvent) {
          recorded[op.event] = clock[s];
        } else {
          const double start = clock[s];
          const bool free = op.kind == PlanOp::FreeParams || op.kind == PlanOp::FreeGrads;
          clock[s] += free ? 0.0 : op.kind == PlanOp::AllGather ? gather_cost : 1.0;
          if (op.kind == PlanOp::Forward || op.kind == PlanOp::Backward) {
            const bool ok = gathered_at.count(op.unit) && gathered_at[op.unit] <= start &&
                            (!freed_at.count(op.unit) || freed_at[op.unit] < gathered_at[op.unit]);
            if (!ok) sim.errors.push_back(describe(op) + " runs on parameters not gathered");
          }
          if (op.kind == PlanOp::AllGather) gathered_at[op.unit] = clock[s];
          if (op.kind == PlanOp::FreeParams) freed_at[op.unit] = clock[s];
        }
        ++pc[s];
        progress = true;
      }
    }
  }
  for (auto& [s, list] : per)
    if (pc[s] < list.size()) return sim;  // deadlock: finish stays -1
  sim.finish = 0;
  for (auto& [s, t] : clock) sim.finish = std::max(sim.finish, t);
  return sim;
}

}  // namespace

TEST(FsdpStreamPlan, EveryWaitIsForAnEventRecordedBeforeOnAnotherStream) {
  for (bool prefetch : {true, false}) {
    const auto ops = plan(5, default_reshard(5), prefetch);
    std::map<std::string, PlanStream> recorded;
    for (const auto& op : ops) {
      if (op.kind == PlanOp::RecordEvent) {
        EXPECT_FALSE(recorded.count(op.event)) << op.event << " recorded twice";
        recorded.emplace(op.event, op.stream);
      } else if (op.kind == PlanOp::WaitEvent) {
        // CUDA ignores a wait for an event not yet recorded: the order would be lost.
        ASSERT_TRUE(recorded.count(op.event)) << describe(op) << " before the event is recorded";
        EXPECT_NE(recorded.at(op.event), op.stream) << describe(op) << ": a stream waiting on itself";
      }
    }
  }
}

TEST(FsdpStreamPlan, CollectivesRunOnTheirOwnStreamsAndComputeWaitsForEachGather) {
  const int64_t n = 4;
  const auto ops = plan(n, default_reshard(n), true);
  std::string last_gather_event[n];
  for (size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    if (op.kind == PlanOp::AllGather) {
      EXPECT_EQ(op.stream, PlanStream::AllGather);
    }
    if (op.kind == PlanOp::ReduceScatter) {
      EXPECT_EQ(op.stream, PlanStream::ReduceScatter);
    }
    if (op.kind == PlanOp::Forward || op.kind == PlanOp::Backward || op.kind == PlanOp::OptimizerStep) {
      EXPECT_EQ(op.stream, PlanStream::Compute);
    }
    if (op.kind == PlanOp::RecordEvent && op.stream == PlanStream::AllGather && op.unit >= 0)
      last_gather_event[op.unit] = op.event;
    if (op.kind == PlanOp::Forward || op.kind == PlanOp::Backward) {
      // The compute op is immediately preceded by the wait for that unit's latest gather.
      ASSERT_GT(i, 0u);
      EXPECT_EQ(ops[i - 1].kind, PlanOp::WaitEvent) << describe(op);
      EXPECT_EQ(ops[i - 1].event, last_gather_event[op.unit]) << describe(op);
    }
  }
  // The all-gather stream reads shards only after the step started (optimizer writes done).
  const auto first_ag =
      std::find_if(ops.begin(), ops.end(), [](const PlanOp& o) { return o.stream == PlanStream::AllGather; });
  ASSERT_NE(first_ag, ops.end());
  EXPECT_EQ(first_ag->kind, PlanOp::WaitEvent);
  EXPECT_EQ(first_ag->event, "step_start");
}

TEST(FsdpStreamPlan, PrefetchIssuesTheNextUnitsGatherBeforeThisUnitsCompute) {
  const int64_t n = 6;
  const auto on = plan(n, default_reshard(n), true);
  const auto off = plan(n, default_reshard(n), false);
  for (int64_t u = 0; u + 1 < n; ++u) {
    EXPECT_LT(find(on, PlanOp::AllGather, u + 1), find(on, PlanOp::Forward, u)) << "forward, unit " << u;
    EXPECT_GT(find(off, PlanOp::AllGather, u + 1), find(off, PlanOp::Forward, u)) << "forward, unit " << u;
  }
  // Backward runs units n-1 … 0; the gathers for backward are the second of each freed unit.
  for (int64_t u = n - 1; u > 0; --u) {
    const ptrdiff_t bwd = find(on, PlanOp::Backward, u);
    const ptrdiff_t regather = find(on, PlanOp::AllGather, u - 1, find(on, PlanOp::Forward, u - 1));
    ASSERT_GE(regather, 0) << "unit " << u - 1 << " is freed after forward, so gathered again";
    EXPECT_LT(regather, bwd) << "backward, unit " << u;
  }
}

TEST(FsdpStreamPlan, FreesFollowTheLastUseAndEveryGatherIsFreed) {
  const int64_t n = 5;
  for (const auto& reshard : {default_reshard(n), std::vector<bool>(n, true), std::vector<bool>(n, false)}) {
    const auto ops = plan(n, reshard, true);
    int64_t gathers = 0, frees = 0;
    for (int64_t u = 0; u < n; ++u) {
      const ptrdiff_t fwd = find(ops, PlanOp::Forward, u), bwd = find(ops, PlanOp::Backward, u);
      const ptrdiff_t free1 = find(ops, PlanOp::FreeParams, u);
      ASSERT_GE(free1, 0);
      if (reshard[u]) {
        EXPECT_GT(free1, fwd);
        EXPECT_LT(free1, bwd);
      } else {
        EXPECT_GT(free1, bwd) << "unit " << u << " kept after forward is freed after backward only";
      }
      const ptrdiff_t rs = find(ops, PlanOp::ReduceScatter, u), fg = find(ops, PlanOp::FreeGrads, u);
      EXPECT_GT(rs, bwd);
      EXPECT_GT(fg, rs);
      EXPECT_EQ(ops[fg].stream, PlanStream::ReduceScatter);  // after the reduce-scatter, in its order
      // The reduce-scatter waits for this unit's gradients.
      EXPECT_EQ(ops[rs - 1].kind, PlanOp::WaitEvent);
      EXPECT_EQ(ops[rs - 1].event, "grads(" + std::to_string(u) + ")");
    }
    for (const auto& op : ops) {
      gathers += op.kind == PlanOp::AllGather;
      frees += op.kind == PlanOp::FreeParams;
    }
    const int64_t resharded = std::count(reshard.begin(), reshard.end(), true);
    EXPECT_EQ(gathers, n + resharded);  // once, and again for backward where freed after forward
    EXPECT_EQ(frees, gathers);          // nothing stays gathered after the step
  }
}

TEST(FsdpStreamPlan, OptimizerWaitsForEveryReduceScatter) {
  const int64_t n = 3;
  const auto ops = plan(n, default_reshard(n), true);
  const ptrdiff_t step = find(ops, PlanOp::OptimizerStep, -1);
  ASSERT_EQ(step, static_cast<ptrdiff_t>(ops.size()) - 1);
  std::set<std::string> waited;
  for (ptrdiff_t i = step - 1; i >= 0 && ops[i].kind == PlanOp::WaitEvent; --i) {
    EXPECT_EQ(ops[i].stream, PlanStream::Compute);
    waited.insert(ops[i].event);
  }
  EXPECT_EQ(waited, (std::set<std::string>{"reduced(0)", "reduced(1)", "reduced(2)"}));
}

TEST(FsdpStreamPlan, RunsWithoutDeadlockAlwaysOnGatheredParameters) {
  const int64_t n = 8;
  for (double gather_cost : {0.5, 3.0})
    for (bool prefetch : {true, false}) {
      const Sim sim = simulate(plan(n, default_reshard(n), prefetch), gather_cost);
      ASSERT_GT(sim.finish, 0) << "deadlock";
      EXPECT_TRUE(sim.errors.empty()) << sim.errors.front();
    }
  // Gathers cheaper than compute: the step is compute-bound (2n compute + optimizer), plus
  // the first gather and the last reduce-scatter, which nothing can hide.
  EXPECT_LE(simulate(plan(n, default_reshard(n), true), 0.5).finish, 2 * n + 1 + 0.5 + 1);
  // The simulator sees a missing wait: without compute's wait for unit 1's gather, slow
  // gathers leave forward(1) running on parameters not yet there.
  auto ops = plan(n, default_reshard(n), true);
  const ptrdiff_t fwd1 = find(ops, PlanOp::Forward, 1);
  ASSERT_EQ(ops[fwd1 - 1].kind, PlanOp::WaitEvent);
  ops.erase(ops.begin() + fwd1 - 1);
  const Sim broken = simulate(ops, 3.0);
  ASSERT_FALSE(broken.errors.empty());
  EXPECT_EQ(broken.errors.front(), "Compute: forward 1 runs on parameters not gathered");
}

TEST(FsdpStreamPlan, BadOptionsAreRefused) {
  StreamPlanOptions o;
  o.units = 3;
  o.reshard_after_forward = {true, false};
  EXPECT_THROW(fsdp_stream_plan(o), std::invalid_argument);
  o.units = 0;
  o.reshard_after_forward = {};
  EXPECT_THROW(fsdp_stream_plan(o), std::invalid_argument);
}

// ---------------------------------------------------------------- pinned staging
TEST(PinnedStaging, SlotsAreAlignedDisjointAndInOrder) {
  ckpt::StagingBuffer b;
  const std::vector<int64_t> sizes = {1000, 0, 4096, 7, 513};
  const auto l = b.begin(sizes);
  ASSERT_EQ(l.slots.size(), sizes.size());
  int64_t end = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(l.slots[i].bytes, sizes[i]);
    EXPECT_EQ(l.slots[i].offset % ckpt::StagingBuffer::kAlign, 0);
    EXPECT_GE(l.slots[i].offset, end);                                // after the previous one
    EXPECT_LT(l.slots[i].offset, end + ckpt::StagingBuffer::kAlign);  // no more padding than alignment
    end = l.slots[i].offset + l.slots[i].bytes;
  }
  EXPECT_EQ(l.bytes, end);
  EXPECT_TRUE(l.grow);
  EXPECT_EQ(b.capacity(), end);
  EXPECT_EQ(b.allocations(), 1);
}

TEST(PinnedStaging, ReusedWhileItFitsGrownOnlyWhenNot) {
  ckpt::StagingBuffer b;
  const auto first = b.begin({4096, 4096});
  b.finished();
  const auto same = b.begin({4096, 4096});
  EXPECT_FALSE(same.grow);
  b.finished();
  const auto smaller = b.begin({100});
  EXPECT_FALSE(smaller.grow);
  EXPECT_EQ(b.capacity(), first.bytes);
  b.finished();
  const auto larger = b.begin({4096, 4096, 1});
  EXPECT_TRUE(larger.grow);
  EXPECT_EQ(b.capacity(), larger.bytes);
  EXPECT_EQ(b.allocations(), 2);
}

TEST(PinnedStaging, NotReusedBeforeThePreviousWriterFinished) {
  ckpt::StagingBuffer b;
  b.begin({10});
  EXPECT_TRUE(b.in_use());
  EXPECT_THROW(b.begin({10}), std::logic_error);
  b.finished();
  EXPECT_FALSE(b.in_use());
  EXPECT_NO_THROW(b.begin({10}));
  EXPECT_THROW(b.begin({-1}), std::logic_error);  // still in use: refused before the sizes are read
  b.finished();
  EXPECT_THROW(b.begin({-1}), std::invalid_argument);
}

// ---------------------------------------------------------------- FSDP's NCCL groups
// train makes FSDP's groups over NCCL on GPUs (Distributed::new_nccl_group): a rank outside the
// group gets none, and where NCCL cannot be had the answer is one line naming why.
TEST(NcclGroups, OutsideTheGroupNoneElseANcclGroupOrOneLine) {
  Distributed d;
  d.env.rank = 0;
  d.env.world_size = 1;
  d.store = c10::make_intrusive<c10d::HashStore>();
  EXPECT_EQ(d.new_nccl_group({1}, "others"), nullptr);
  const bool gpu = visible_cuda_devices() > 0;
  try {
    auto g = d.new_nccl_group({0}, "dp_shard0_nccl");
    ASSERT_TRUE(gpu) << "an NCCL group where no GPU can run it";
    ASSERT_TRUE(g);
    EXPECT_EQ(g->kind(), CommKind::Nccl);
    EXPECT_EQ(g->size(), 1);
  } catch (const RuntimeFailure& e) {
    EXPECT_FALSE(gpu) << e.what();
#ifdef CTITAN_WITH_CUDA
    EXPECT_EQ(std::string(e.what()),
              "NCCL group: no GPU visible to this process (ProcessGroupNCCL needs one per rank)");
#else
    EXPECT_EQ(std::string(e.what()),
              "rank 0: process group dp_shard0_nccl over NCCL: this build has no CUDA (configure with "
              "-DCTITAN_WITH_CUDA=ON)");
#endif
  }
}

#ifdef CTITAN_WITH_CUDA
// ---------------------------------------------------------------- the CUDA build itself
TEST(CudaBuild, NcclProcessGroupIsLinkedAndCudaAnswers) {
  // Options of ProcessGroupNCCL: host code in libtorch_cuda, present only when PyTorch was
  // built with USE_C10D_NCCL; constructing them needs no GPU.
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  ASSERT_TRUE(opts);
  EXPECT_EQ(opts->backend, "nccl");
  EXPECT_EQ(torch::cuda::is_available(), torch::cuda::device_count() > 0);
}

TEST(CudaBuild, NcclGroupOfOneRankOrOneLineWithoutGpu) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  if (torch::cuda::device_count() == 0) {
    try {
      make_nccl_group(store, 0, 1, std::chrono::seconds(10));
      FAIL() << "an NCCL group without a GPU";
    } catch (const RuntimeFailure& e) {
      EXPECT_EQ(std::string(e.what()),
                "NCCL group: no GPU visible to this process (ProcessGroupNCCL needs one per rank)");
    }
  } else {
    auto g = make_nccl_group(store, 0, 1, std::chrono::seconds(10));
    ASSERT_TRUE(g);
    EXPECT_EQ(g->getBackendName(), "nccl");
  }
}

// ctitan's own CUDA kernels (kernels/fused_cuda.h) are linked and answer: without a GPU a launch
// returns CUDA's error instead of crashing (nothing is launched for no elements); with one,
// SwiGLU equals ATen's silu(a) · b bit for bit. ATen's route is the default.
TEST(CudaBuild, OwnKernelsAreLinkedAndAnswer) {
  EXPECT_FALSE(own_gpu_kernels()) << "CTITAN_GPU_KERNELS unset: ATen's route";
  EXPECT_EQ(gpu::swiglu_forward(gpu::Elem::BFloat16, nullptr, nullptr, nullptr, 0, nullptr), 0);
  if (torch::cuda::device_count() == 0) {
    const int rc = gpu::swiglu_forward(gpu::Elem::Float32, nullptr, nullptr, nullptr, 1000, nullptr);
    EXPECT_NE(rc, 0) << "a kernel launched without a GPU";
    EXPECT_FALSE(std::string(cudaGetErrorString(static_cast<cudaError_t>(rc))).empty());
  } else {
    const auto opts = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
    const auto a = torch::randn({37, 91}, opts), b = torch::randn({37, 91}, opts);
    EXPECT_TRUE(torch::equal(swiglu_cuda(a, b), torch::silu(a) * b));
  }
  // RoPE: nothing to rotate is no launch; an odd head size is refused before any launch.
  EXPECT_EQ(gpu::rope(gpu::Elem::Float32, false, nullptr, nullptr, nullptr, 0, 64, 4, 16, nullptr), 0);
  EXPECT_EQ(gpu::rope(gpu::Elem::BFloat16, true, nullptr, nullptr, nullptr, 8, 7, 4, 16, nullptr),
            static_cast<int>(cudaErrorInvalidValue));
  if (torch::cuda::device_count() == 0) {
    EXPECT_NE(gpu::rope(gpu::Elem::Float32, false, nullptr, nullptr, nullptr, 8, 64, 4, 16, nullptr), 0)
        << "a kernel launched without a GPU";
  } else {
    const auto x = torch::randn({2, 16, 4, 32}, torch::TensorOptions().device(torch::kCUDA));
    const auto angle = torch::outer(torch::arange(16.0), torch::rand({16})).to(torch::kCUDA);
    const auto table = torch::stack({torch::cos(angle), torch::sin(angle)}, -1);
    EXPECT_TRUE(torch::allclose(rotary_emb_cuda(x, table), rotary_emb_aten(x, table), 1e-6, 1e-6));
  }
}
#endif
