#include "parallelisms/fsdp_stream_plan.h"

#include <map>
#include <stdexcept>

namespace ctitan {

const char* stream_name(PlanStream s) {
  switch (s) {
    case PlanStream::Compute: return "Compute";
    case PlanStream::AllGather: return "AllGather";
    case PlanStream::ReduceScatter: return "ReduceScatter";
  }
  return "?";
}

const char* op_name(PlanOp::Kind k) {
  switch (k) {
    case PlanOp::WaitEvent: return "wait";
    case PlanOp::RecordEvent: return "record";
    case PlanOp::AllGather: return "all_gather";
    case PlanOp::Forward: return "forward";
    case PlanOp::Backward: return "backward";
    case PlanOp::ReduceScatter: return "reduce_scatter";
    case PlanOp::FreeParams: return "free_params";
    case PlanOp::FreeGrads: return "free_grads";
    case PlanOp::OptimizerStep: return "optimizer_step";
  }
  return "?";
}

std::string describe(const PlanOp& op) {
  std::string s = std::string(stream_name(op.stream)) + ": " + op_name(op.kind);
  if (op.kind == PlanOp::WaitEvent || op.kind == PlanOp::RecordEvent) return s + " " + op.event;
  if (op.unit >= 0) s += " " + std::to_string(op.unit);
  return s;
}

namespace {

class Builder {
 public:
  explicit Builder(const StreamPlanOptions& o) : o_(o), gathered_(o.units, false) {}

  std::vector<PlanOp> build() {
    const int64_t n = o_.units;
    add(PlanOp::RecordEvent, PlanStream::Compute, -1, "step_start");
    add(PlanOp::WaitEvent, PlanStream::AllGather, -1, "step_start");
    for (int64_t u = 0; u < n; ++u) {
      gather_if_needed(u);
      if (o_.prefetch && u + 1 < n) gather_if_needed(u + 1);
      add(PlanOp::WaitEvent, PlanStream::Compute, u, last_gather_[u]);
      add(PlanOp::Forward, PlanStream::Compute, u);
      add(PlanOp::RecordEvent, PlanStream::Compute, u, "forward(" + std::to_string(u) + ")");
      if (o_.reshard_after_forward[u]) {
        add(PlanOp::FreeParams, PlanStream::Compute, u);
        gathered_[u] = false;
      }
    }
    for (int64_t u = n - 1; u >= 0; --u) {
      gather_if_needed(u);
      if (o_.prefetch && u > 0) gather_if_needed(u - 1);
      add(PlanOp::WaitEvent, PlanStream::Compute, u, last_gather_[u]);
      add(PlanOp::Backward, PlanStream::Compute, u);
      const std::string grads = "grads(" + std::to_string(u) + ")";
      add(PlanOp::RecordEvent, PlanStream::Compute, u, grads);
      add(PlanOp::FreeParams, PlanStream::Compute, u);
      gathered_[u] = false;
      add(PlanOp::WaitEvent, PlanStream::ReduceScatter, u, grads);
      add(PlanOp::ReduceScatter, PlanStream::ReduceScatter, u);
      const std::string reduced = "reduced(" + std::to_string(u) + ")";
      add(PlanOp::RecordEvent, PlanStream::ReduceScatter, u, reduced);
      add(PlanOp::FreeGrads, PlanStream::ReduceScatter, u);
    }
    for (int64_t u = 0; u < n; ++u)
      add(PlanOp::WaitEvent, PlanStream::Compute, u, "reduced(" + std::to_string(u) + ")");
    add(PlanOp::OptimizerStep, PlanStream::Compute, -1);
    return std::move(ops_);
  }

 private:
  void add(PlanOp::Kind k, PlanStream s, int64_t unit, std::string event = "") {
    ops_.push_back(PlanOp{k, s, unit, std::move(event)});
  }
  // An all-gather of a unit that is not gathered (nor being gathered): on AllGather, which
  // then records that gather's event. A gather in backward of a unit freed after forward
  // must not start before its forward compute is done with the memory the first gather
  // filled: AllGather waits forward(u) first.
  void gather_if_needed(int64_t u) {
    if (gathered_[u]) return;
    const int64_t nth = ++gathers_[u];
    if (nth > 1) add(PlanOp::WaitEvent, PlanStream::AllGather, u, "forward(" + std::to_string(u) + ")");
    add(PlanOp::AllGather, PlanStream::AllGather, u);
    last_gather_[u] = "gathered(" + std::to_string(u) + ")#" + std::to_string(nth);
    add(PlanOp::RecordEvent, PlanStream::AllGather, u, last_gather_[u]);
    gathered_[u] = true;
  }

  const StreamPlanOptions& o_;
  std::vector<bool> gathered_;
  std::map<int64_t, int64_t> gathers_;
  std::map<int64_t, std::string> last_gather_;
  std::vector<PlanOp> ops_;
};

}  // namespace

std::vector<PlanOp> fsdp_stream_plan(const StreamPlanOptions& o) {
  if (o.units <= 0 || static_cast<int64_t>(o.reshard_after_forward.size()) != o.units)
    throw std::invalid_argument("[fsdp] stream plan: " + std::to_string(o.units) + " units but " +
                                std::to_string(o.reshard_after_forward.size()) + " reshard-after-forward flags");
  return Builder(o).build();
}

}  // namespace ctitan
