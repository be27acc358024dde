// Process groups and the collectives FSDP needs, with timeouts that become errors.
//
// Each group is a c10d Gloo Backend used directly (no ProcessGroup dispatcher in between),
// bf16 on the wire as bf16. all_gather_flat is Gloo's flat all-gather (_allgather_base)
// into one [N·S] buffer; reduce_scatter_sum is alltoall plus a local sum, which
// bench/comm_bench.sh measured ~2x faster than Gloo's own _reduce_scatter_base (fp32,
// 2 and 4 ranks); the flat all-gather measured within noise of a list all-gather.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "parallelisms/launch_env.h"

namespace ctitan {

// What error messages say about where the job was: set by the training loop.
struct CommContext {
  static void set_step(int64_t step);
  static int64_t step();
  // Every wait() gives up after this long (comm.init_timeout_seconds until the first
  // step finishes, comm.train_timeout_seconds after); NCCL groups alive get it too.
  static void set_timeout(std::chrono::milliseconds t);
  static std::chrono::milliseconds timeout();
};

// How a group's collectives run and are waited for.
//   Gloo (CPU tensors): wait() blocks the thread up to the CommContext timeout; a
//     reduce-scatter is an alltoall plus a local sum (measured faster than Gloo's own).
//   NCCL (GPU tensors, CUDA build): wait() makes the current CUDA stream wait for the
//     collective's stream and returns at once, so the CPU keeps queueing compute while the
//     collective runs (passing a timeout to a NCCL wait would block the thread until it ends);
//     the group's own timeout, enforced by ProcessGroupNCCL's watchdog, ends a job whose
//     collective hangs: comm.init_timeout_seconds until the first step ends, then
//     comm.train_timeout_seconds (CommContext::set_timeout passes it on). Reduce-scatter is
//     NCCL's own.
enum class CommKind { Gloo, Nccl };

// An issued collective; wait() blocks (up to the CommContext timeout; for NCCL see CommKind)
// and then runs the local post-processing (the sum of a reduce-scatter, say). Errors name the
// collective, the group, the step and the rank.
class PendingCollective {
 public:
  PendingCollective() = default;
  PendingCollective(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish, std::string what,
                    std::string where, bool thread_waits = true);
  void wait();
  bool pending() const { return static_cast<bool>(work_) || static_cast<bool>(finish_); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::string what_, where_;
  bool thread_waits_ = true;  // false: a stream-ordered wait (NCCL), no timeout passed
};

class Comm {
 public:
  // native_reduce_scatter: the backend's own _reduce_scatter_base instead of alltoall + sum
  // (always for NCCL; for Gloo only in tests, which check that both agree).
  Comm(c10::intrusive_ptr<c10d::Backend> pg, std::string name, int64_t global_rank, CommKind kind = CommKind::Gloo,
       bool native_reduce_scatter = false);
  // A group of one process and no backend: every collective is a local copy or a no-op.
  // Lets one process run FSDP's mixed-precision machinery (bf16 compute parameters, fp32
  // master weights and gradients) without a process group.
  static std::shared_ptr<Comm> single(std::string name);
  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  CommKind kind() const { return kind_; }

  // input [S] → out [N·S] (rank r's input lands at [r·S, (r+1)·S)).
  PendingCollective all_gather_flat(const at::Tensor& input, at::Tensor out, const std::string& tag);
  // input [N·S] (same shape on every rank) → out [S]: out = Σ_ranks input[rank·S:(rank+1)·S].
  PendingCollective reduce_scatter_sum(const at::Tensor& input, at::Tensor out, const std::string& tag);
  // In place, sum over the group.
  PendingCollective all_reduce_sum(at::Tensor t, const std::string& tag);
  void broadcast(at::Tensor t, int64_t root, const std::string& tag);
  void barrier(const std::string& tag);

  // A throwing wrapper used by the other collectives; public for tests and tools.
  [[noreturn]] void fail(const std::string& what, const std::string& reason) const;

 private:
  Comm() = default;
  c10::intrusive_ptr<c10d::Backend> pg_;
  std::string name_;
  int64_t global_rank_ = 0, rank_ = 0, size_ = 1;
  CommKind kind_ = CommKind::Gloo;
  bool native_reduce_scatter_ = false;
  PendingCollective pending(c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
                            const std::string& what) const;
};

// The world group plus the rendezvous store. Created once per process.
struct Distributed {
  LaunchEnv env;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<Comm> world;
  // Creates a sub-group of `ranks` (global ranks, ascending) — every rank of the world
  // must call it with the same arguments in the same order; returns nullptr on ranks
  // outside the group.
  std::shared_ptr<Comm> new_group(const std::vector<int64_t>& ranks, const std::string& name);
  // The same over NCCL, for FSDP's tensor collectives on GPUs (CUDA build; elsewhere it throws
  // RuntimeFailure). Same calling rule; the group's timeout is CommContext::timeout() now.
  std::shared_ptr<Comm> new_nccl_group(const std::vector<int64_t>& ranks, const std::string& name);

 private:
  int64_t group_counter_ = 0;
  // The group's rank of this process (-1 outside) and its store, under a key of its own.
  std::pair<int64_t, c10::intrusive_ptr<c10d::Store>> group_store(const std::vector<int64_t>& ranks);
};

// TCPStore rendezvous at MASTER_ADDR:MASTER_PORT + ProcessGroupGloo. Rank 0 serves the
// store, except under torchrun (env.agent_store), whose agent serves it to every rank and
// keeps it across restarts: there each attempt's keys live under a namespace its rank 0
// picks and confirms to every rank (comm.cpp says how). Throws RuntimeFailure naming the
// address when the rendezvous times out.
std::unique_ptr<Distributed> init_distributed(const LaunchEnv& env, std::chrono::milliseconds init_timeout);

}  // namespace ctitan
