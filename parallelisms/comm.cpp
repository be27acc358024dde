#include "parallelisms/comm.h"

#include <unistd.h>

#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "config/errors.h"
#include "parallelisms/nccl.h"

namespace ctitan {
namespace {
std::atomic<int64_t> g_step{0};
std::atomic<int64_t> g_timeout_ms{300000};
// NCCL groups take their timeout from their own options (their watchdog enforces it):
// set_timeout passes the new one on to every group alive.
std::mutex g_nccl_mutex;
std::vector<c10::weak_intrusive_ptr<c10d::Backend>> g_nccl_groups;
}  // namespace

void CommContext::set_step(int64_t step) { g_step = step; }
int64_t CommContext::step() { return g_step; }
void CommContext::set_timeout(std::chrono::milliseconds t) {
  g_timeout_ms = t.count();
  std::lock_guard<std::mutex> lock(g_nccl_mutex);
  for (auto& weak : g_nccl_groups)
    if (auto pg = weak.lock()) pg->setTimeout(t);
}
std::chrono::milliseconds CommContext::timeout() { return std::chrono::milliseconds(g_timeout_ms.load()); }

PendingCollective::PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
                                     std::string what, std::string where, bool thread_waits)
    : work_(std::move(work)),
      finish_(std::move(finish)),
      what_(std::move(what)),
      where_(std::move(where)),
      thread_waits_(thread_waits) {}

void PendingCollective::wait() {
  if (work_) {
    auto work = std::move(work_);
    work_.reset();
    try {
      if (thread_waits_)
        work->wait(CommContext::timeout());
      else
        work->wait();
    } catch (const std::exception& e) {
      std::string reason = e.what();
      if (auto nl = reason.find('\n'); nl != std::string::npos) reason.resize(nl);
      if (reason.find("timed out") != std::string::npos || reason.find("Timed out") != std::string::npos)
        reason = "timed out after " + std::to_string(CommContext::timeout().count() / 1000) +
                 " s (a rank died or took a different path): " + reason;
      throw CollectiveFailure(where_ + ": " + what_ + " failed at step " + std::to_string(CommContext::step()) + ": " +
                              reason);
    }
  }
  if (finish_) {
    auto f = std::move(finish_);
    finish_ = nullptr;
    f();
  }
}

Comm::Comm(c10::intrusive_ptr<c10d::Backend> pg, std::string name, int64_t global_rank, CommKind kind,
           bool native_reduce_scatter)
    : pg_(std::move(pg)),
      name_(std::move(name)),
      global_rank_(global_rank),
      rank_(pg_->getRank()),
      size_(pg_->getSize()),
      kind_(kind),
      native_reduce_scatter_(native_reduce_scatter || kind == CommKind::Nccl) {}

std::shared_ptr<Comm> Comm::single(std::string name) {
  auto c = std::shared_ptr<Comm>(new Comm());
  c->name_ = std::move(name);
  c->global_rank_ = c->rank_ = 0;
  c->size_ = 1;
  return c;
}

void Comm::fail(const std::string& what, const std::string& reason) const {
  throw CollectiveFailure("rank " + std::to_string(global_rank_) + ": " + what + " on group " + name_ +
                          " failed at step " + std::to_string(CommContext::step()) + ": " + reason);
}

static std::string where_of(int64_t global_rank, const std::string& group) {
  return "rank " + std::to_string(global_rank) + " (group " + group + ")";
}

PendingCollective Comm::pending(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
                                const std::string& what) const {
  return PendingCollective(std::move(work), std::move(finish), what, where_of(global_rank_, name_),
                           kind_ == CommKind::Gloo);
}

PendingCollective Comm::all_gather_flat(const at::Tensor& input, at::Tensor out, const std::string& tag) {
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
  return pending(
      work, [in] {}, "all_gather(" + tag + ")");
}

PendingCollective Comm::reduce_scatter_sum(const at::Tensor& input, at::Tensor out, const std::string& tag) {
  const int64_t S = out.numel();
  TORCH_CHECK(input.numel() == S * size_, "[comm] reduce_scatter_sum: input has ", input.numel(),
              " elements, expected N*S = ", size_, "*", S);
  TORCH_CHECK(out.is_contiguous() && out.dtype() == input.dtype(),
              "[comm] reduce_scatter_sum: output must be contiguous, of the input dtype");
  if (size_ == 1) {
    out.copy_(input.reshape_as(out));
    return {};
  }
  if (native_reduce_scatter_) {
    auto in = input.reshape({-1}).contiguous();
    auto flat = out.view({S});
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = pg_->_reduce_scatter_base(flat, in, opts);
    } catch (const std::exception& e) {
      fail("reduce_scatter(" + tag + ")", e.what());
    }
    return pending(
        work, [in] {}, "reduce_scatter(" + tag + ")");
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
  return pending(work, finish, "reduce_scatter(" + tag + ")");
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
  return pending(
      work, [ts] {}, "all_reduce(" + tag + ")");
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
  pending(work, nullptr, "broadcast(" + tag + ")").wait();
}

void Comm::barrier(const std::string& tag) {
  if (size_ == 1) return;
  // Gloo's barrier is an all-reduce of a small tensor; use one so the timeout applies.
  auto t = at::zeros({1}, at::TensorOptions().device(kind_ == CommKind::Nccl ? at::kCUDA : at::kCPU));
  all_reduce_sum(t, "barrier:" + tag).wait();
}

static c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                                                   int64_t size, std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(rank), static_cast<int>(size), opts);
}

std::pair<int64_t, c10::intrusive_ptr<c10d::Store>> Distributed::group_store(const std::vector<int64_t>& ranks) {
  const int64_t id = group_counter_++;
  auto it = std::find(ranks.begin(), ranks.end(), env.rank);
  if (it == ranks.end()) return {-1, nullptr};
  std::string key = "group" + std::to_string(id) + "/";
  for (auto r : ranks) key += std::to_string(r) + ",";
  return {it - ranks.begin(), c10::make_intrusive<c10d::PrefixStore>(key, store)};
}

std::shared_ptr<Comm> Distributed::new_nccl_group(const std::vector<int64_t>& ranks, const std::string& name) {
  auto [group_rank, prefix] = group_store(ranks);
  if (group_rank < 0) return nullptr;
#ifdef CTITAN_WITH_CUDA
  auto pg =
      make_nccl_group(prefix, static_cast<int>(group_rank), static_cast<int>(ranks.size()), CommContext::timeout());
  {
    std::lock_guard<std::mutex> lock(g_nccl_mutex);
    g_nccl_groups.emplace_back(pg);
  }
  return std::make_shared<Comm>(pg, name, env.rank, CommKind::Nccl);
#else
  throw RuntimeFailure("rank " + std::to_string(env.rank) + ": process group " + name +
                       " over NCCL: this build has no CUDA (configure with -DCTITAN_WITH_CUDA=ON)");
#endif
}

std::shared_ptr<Comm> Distributed::new_group(const std::vector<int64_t>& ranks, const std::string& name) {
  auto [group_rank, prefix] = group_store(ranks);
  if (group_rank < 0) return nullptr;
  try {
    return std::make_shared<Comm>(
        make_gloo(prefix, group_rank, static_cast<int64_t>(ranks.size()), CommContext::timeout()), name, env.rank);
  } catch (const std::exception& e) {
    throw RuntimeFailure("rank " + std::to_string(env.rank) + ": creating process group " + name +
                         " failed: " + e.what());
  }
}

namespace {

std::string store_string(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key) {
  const std::vector<uint8_t> v = store->get(key);
  return std::string(v.begin(), v.end());
}

void store_set(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, const std::string& value) {
  store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// A token no other process of any attempt has drawn: random bits and this pid.
std::string fresh_token() {
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[48];
  std::snprintf(buf, sizeof buf, "%016llx-%d", static_cast<unsigned long long>(r), static_cast<int>(getpid()));
  return buf;
}

// torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True) and keeps serving
// the same one when it restarts the workers: the keys a dead attempt wrote are still there
// (Gloo's addresses of ranks that no longer exist, a checkpoint barrier half passed), and the
// agents of one job do not even agree on the restart count (TORCHELASTIC_RESTART_COUNT counts
// each agent's own restarts). So each attempt works under a namespace of its own, chosen by
// its rank 0 and confirmed to every other rank, which therefore never follows a stale key:
//   rank 0:  sets "ctitan/leader" = L (a fresh token), then for each rank r > 0 waits for
//            "ctitan/L/hello/r" = t_r and answers with the key "ctitan/L/welcome/r/t_r";
//   rank r:  reads "ctitan/leader", sets "ctitan/L/hello/r" = t_r (its own fresh token) and
//            waits for the welcome. A leader token from an attempt that died gets no answer;
//            rank r reads the leader key again meanwhile and says hello under a new one.
// Returns "ctitan/L/", the prefix of every key this attempt uses.
std::string join_agent_store_namespace(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                                       std::chrono::milliseconds timeout) {
  const std::string leader_key = "ctitan/leader";
  if (env.rank == 0) {
    const std::string leader = fresh_token();
    store_set(store, leader_key, leader);
    const std::string ns = "ctitan/" + leader + "/";
    for (int64_t r = 1; r < env.world_size; ++r) {
      const std::string hello = ns + "hello/" + std::to_string(r);
      store->wait({hello}, timeout);
      store_set(store, ns + "welcome/" + std::to_string(r) + "/" + store_string(store, hello), "1");
    }
    return ns;
  }
  const std::string mine = fresh_token();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string leader;
  while (std::chrono::steady_clock::now() < deadline) {
    if (store->check({leader_key})) {
      const std::string now = store_string(store, leader_key);
      if (now != leader) {
        leader = now;
        store_set(store, "ctitan/" + leader + "/hello/" + std::to_string(env.rank), mine);
      }
      if (store->check({"ctitan/" + leader + "/welcome/" + std::to_string(env.rank) + "/" + mine}))
        return "ctitan/" + leader + "/";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw std::runtime_error(
      "rank 0 of this attempt did not answer within the timeout" +
      (leader.empty() ? std::string(" (no rank 0 has joined the store)") : " (last leader token " + leader + ")"));
}

}  // namespace

std::unique_ptr<Distributed> init_distributed(const LaunchEnv& env, std::chrono::milliseconds init_timeout) {
  auto d = std::make_unique<Distributed>();
  d->env = env;
  CommContext::set_timeout(init_timeout);
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(env.master_port);
  so.timeout = init_timeout;
  if (env.agent_store) {
    // torchrun: its agent serves the store; every rank is a client.
    so.isServer = false;
    so.waitWorkers = false;
  } else {
    so.isServer = env.rank == 0;
    so.numWorkers = static_cast<size_t>(env.world_size);
    so.waitWorkers = true;
  }
  try {
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    d->store = tcp;
    if (env.agent_store)
      d->store = c10::make_intrusive<c10d::PrefixStore>(join_agent_store_namespace(tcp, env, init_timeout), tcp);
  } catch (const std::exception& e) {
    std::string reason = e.what();
    if (auto nl = reason.find('\n'); nl != std::string::npos) reason.resize(nl);
    throw RuntimeFailure("rank " + std::to_string(env.rank) + ": rendezvous at " + env.master_addr + ":" +
                         std::to_string(env.master_port) +
                         (env.agent_store ? " (the torchrun agent's store)" : std::string()) + " failed within " +
                         std::to_string(init_timeout.count() / 1000) + " s (comm.init_timeout_seconds): " + reason);
  }
  std::vector<int64_t> all(env.world_size);
  for (int64_t r = 0; r < env.world_size; ++r) all[r] = r;
  d->world = d->new_group(all, "world");
  return d;
}

}  // namespace ctitan
