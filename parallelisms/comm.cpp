#include "parallelisms/comm.h"

#include <atomic>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "config/errors.h"

namespace ctitan {
namespace {
std::atomic<int64_t> g_step{0};
std::atomic<int64_t> g_timeout_ms{300000};
}  // namespace

void CommContext::set_step(int64_t step) { g_step = step; }
int64_t CommContext::step() { return g_step; }
void CommContext::set_timeout(std::chrono::milliseconds t) { g_timeout_ms = t.count(); }
std::chrono::milliseconds CommContext::timeout() {
  return std::chrono::milliseconds(g_timeout_ms.load());
}

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work,
                                     std::function<void()> finish, std::string what,
                                     std::string where)
    : work_(std::move(work)), finish_(std::move(finish)), what_(std::move(what)),
      where_(std::move(where)) {}

void PendingCollective::wait() {
  if (work_) {
    auto work = std::move(work_);
    work_.reset();
    try {
      work->wait(CommContext::timeout());
    } catch (const std::exception& e) {
      std::string reason = e.what();
      if (auto nl = reason.find('\n'); nl != std::string::npos) reason.resize(nl);
      if (reason.find("timed out") != std::string::npos || reason.find("Timed out") != std::string::npos)
        reason = "timed out after " + std::to_string(CommContext::timeout().count() / 1000) +
                 " s (a rank died or took a different path): " + reason;
      throw CollectiveFailure(where_ + ": " + what_ + " failed at step " +
                           std::to_string(CommContext::step()) + ": " + reason);
    }
  }
  if (finish_) {
    auto f = std::move(finish_);
    finish_ = nullptr;
    f();
  }
}

Comm::Comm(c10::intrusive_ptr<c10d::Backend> pg, std::string name, int64_t global_rank)
    : pg_(std::move(pg)), name_(std::move(name)), global_rank_(global_rank),
      rank_(pg_->getRank()), size_(pg_->getSize()) {}

std::shared_ptr<Comm> Comm::single(std::string name) {
  auto c = std::shared_ptr<Comm>(new Comm());
  c->name_ = std::move(name);
  c->global_rank_ = c->rank_ = 0;
  c->size_ = 1;
  return c;
}

void Comm::fail(const std::string& what, const std::string& reason) const {
  throw CollectiveFailure("rank " + std::to_string(global_rank_) + ": " + what + " on group " +
                       name_ + " failed at step " + std::to_string(CommContext::step()) + ": " +
                       reason);
}

static std::string where_of(int64_t global_rank, const std::string& group) {
  return "rank " + std::to_string(global_rank) + " (group " + group + ")";
}

PendingCollective Comm::all_gather_flat(const at::Tensor& input, at::Tensor out,
                                        const std::string& tag) {
  const int64_t S = input.numel();
  TORCH_CHECK(out.numel() == S * size_ && out.is_contiguous() && out.dtype() == input.dtype(),
              "[comm] all_gather_flat: output must be a contiguous [N*S] buffer of the input dtype");
  if (size_ == 1) {
    out.copy_(input.reshape({-1}));
    return {};
  }
  auto in = input.reshape({-1}).contiguous();
  auto flat = out.view({-1});
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg_->_allgather_base(flat, in);
  } catch (const std::exception& e) {
    fail("all_gather(" + tag + ")", e.what());
  }
  // Keep the input alive until the collective completes.
  return PendingCollective(work, [in] {}, "all_gather(" + tag + ")", where_of(global_rank_, name_));
}

PendingCollective Comm::reduce_scatter_sum(const at::Tensor& input, at::Tensor out,
                                           const std::string& tag) {
  const int64_t S = out.numel();
  TORCH_CHECK(input.numel() == S * size_, "[comm] reduce_scatter_sum: input has ", input.numel(),
              " elements, expected N*S = ", size_, "*", S);
  TORCH_CHECK(out.is_contiguous() && out.dtype() == input.dtype(),
              "[comm] reduce_scatter_sum: output must be contiguous, of the input dtype");
  if (size_ == 1) {
    out.copy_(input.reshape_as(out));
    return {};
  }
  // alltoall_base (rank r sends chunk j of its input to rank j) and a local sum of the N
  // received chunks, not Gloo's _reduce_scatter_base: bench/comm_bench.sh measured the latter
  // 2.2x slower in fp32 on 2 and 4 ranks (8.2 vs 19.5 ms, 19.7 vs 42.5 ms for 16 MiB). Each
  // rank sends and receives (N-1)/N of the buffer, the traffic of a ring reduce-scatter.
  auto send = input.reshape({-1}).contiguous();
  auto recv = at::empty({size_ * S}, input.options());
  std::vector<int64_t> splits(size_, S);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg_->alltoall_base(recv, send, splits, splits);
  } catch (const std::exception& e) {
    fail("reduce_scatter(" + tag + ")", e.what());
  }
  // recv[j] is rank j's contribution to this rank's chunk.
  auto finish = [send, recv, out, n = size_, S]() mutable {
    auto flat = out.view({S});
    at::sum_out(flat, recv.view({n, S}), {0});
  };
  return PendingCollective(work, finish, "reduce_scatter(" + tag + ")", where_of(global_rank_, name_));
}

PendingCollective Comm::all_reduce_sum(at::Tensor t, const std::string& tag) {
  if (size_ == 1) return {};
  std::vector<at::Tensor> ts{t};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg_->allreduce(ts);
  } catch (const std::exception& e) {
    fail("all_reduce(" + tag + ")", e.what());
  }
  return PendingCollective(work, [ts] {}, "all_reduce(" + tag + ")", where_of(global_rank_, name_));
}

void Comm::broadcast(at::Tensor t, int64_t root, const std::string& tag) {
  if (size_ == 1) return;
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = pg_->broadcast(ts, opts);
  } catch (const std::exception& e) {
    fail("broadcast(" + tag + ")", e.what());
  }
  PendingCollective(work, nullptr, "broadcast(" + tag + ")", where_of(global_rank_, name_)).wait();
}

void Comm::barrier(const std::string& tag) {
  if (size_ == 1) return;
  // Gloo's barrier is an all-reduce of a small tensor; use one so the timeout applies.
  auto t = at::zeros({1});
  all_reduce_sum(t, "barrier:" + tag).wait();
}

static c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                                        int64_t rank, int64_t size,
                                                        std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank),
                                                     static_cast<int>(size), opts);
}

std::shared_ptr<Comm> Distributed::new_group(const std::vector<int64_t>& ranks, const std::string& name) {
  const int64_t id = group_counter_++;
  auto it = std::find(ranks.begin(), ranks.end(), env.rank);
  if (it == ranks.end()) return nullptr;
  const int64_t group_rank = it - ranks.begin();
  std::string key = "group" + std::to_string(id) + "/";
  for (auto r : ranks) key += std::to_string(r) + ",";
  auto prefix = c10::make_intrusive<c10d::PrefixStore>(key, store);
  try {
    return std::make_shared<Comm>(
        make_gloo(prefix, group_rank, static_cast<int64_t>(ranks.size()), CommContext::timeout()),
        name, env.rank);
  } catch (const std::exception& e) {
    throw RuntimeFailure("rank " + std::to_string(env.rank) + ": creating process group " + name +
                         " failed: " + e.what());
  }
}

std::unique_ptr<Distributed> init_distributed(const LaunchEnv& env,
                                              std::chrono::milliseconds init_timeout) {
  auto d = std::make_unique<Distributed>();
  d->env = env;
  CommContext::set_timeout(init_timeout);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = static_cast<size_t>(env.world_size);
  so.waitWorkers = true;
  so.timeout = init_timeout;
  try {
    d->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    if (auto nl = reason.find('\n'); nl != std::string::npos) reason.resize(nl);
    throw RuntimeFailure("rank " + std::to_string(env.rank) + ": rendezvous at " + env.master_addr +
                         ":" + std::to_string(env.master_port) + " failed within " +
                         std::to_string(init_timeout.count() / 1000) +
                         " s (comm.init_timeout_seconds): " + reason);
  }
  std::vector<int64_t> all(env.world_size);
  for (int64_t r = 0; r < env.world_size; ++r) all[r] = r;
  d->world = d->new_group(all, "world");
  return d;
}

}  // namespace ctitan
