// FSDP2's stream design on a GPU, written down as data: which stream issues what for each
// unit, and which stream waits for which event, for one training step. The CUDA build runs
// a plan with c10::cuda streams and events; tests check the plan's ordering without a GPU
// (tests/test_fsdp.cpp, FsdpStreamPlan.*).
//
// Three streams, as torch.distributed.fsdp's FSDP2:
//   Compute        the default stream: forward, backward, the optimizer step;
//   AllGather      all-gathers of the unsharded parameters (and their copy-in from shards);
//   ReduceScatter  reduce-scatters of the unsharded gradients into gradient shards.
// Events (each recorded once per step and named by what it marks, per unit):
//   step_start     Compute reached the step: the shards the optimizer wrote are final;
//   gathered(u)    unit u's unsharded parameters are complete (AllGather);
//   forward(u)     unit u's forward compute was issued up to its end (Compute);
//   grads(u)       unit u's unsharded gradients are complete (Compute, end of its backward);
//   reduced(u)     unit u's gradient shards are complete (ReduceScatter).
// The rules the plan follows:
//   - an all-gather reads shards: AllGather waits step_start once, before the step's first;
//   - compute uses a unit only after waiting gathered(u) of that gather;
//   - prefetch: unit u+1's all-gather (forward) or u-1's (backward) is issued on AllGather
//     before unit u's compute, so it overlaps u's compute;
//   - the unsharded parameters are freed after their last use in the phase (Free, issued on
//     Compute after the unit's compute: the caching allocator reuses the memory only after
//     the work queued before the free), in forward only where reshard-after-forward holds;
//   - a reduce-scatter waits grads(u); the unsharded gradients are freed after reduced(u);
//   - before the optimizer step Compute waits reduced(u) of every unit.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ctitan {

enum class PlanStream { Compute, AllGather, ReduceScatter };
const char* stream_name(PlanStream s);

struct PlanOp {
  enum Kind {
    WaitEvent,      // `stream` waits for `event` (cudaStreamWaitEvent)
    RecordEvent,    // `stream` records `event`
    AllGather,      // unit's parameters gathered into unsharded storage
    Forward,        // unit's forward compute
    Backward,       // unit's backward compute (unsharded gradients produced)
    ReduceScatter,  // unit's unsharded gradients reduced into its gradient shards
    FreeParams,     // unit's unsharded parameter storage released
    FreeGrads,      // unit's unsharded gradient storage released
    OptimizerStep,  // every shard updated
  };
  Kind kind;
  PlanStream stream;
  int64_t unit = -1;  // -1: not about one unit (step_start, the optimizer)
  std::string event;  // WaitEvent / RecordEvent: "gathered(3)#2" (the 2nd gather of unit 3)
};
const char* op_name(PlanOp::Kind k);
std::string describe(const PlanOp& op);  // "AllGather: wait forward(2)" etc.

struct StreamPlanOptions {
  int64_t units = 0;
  // reshard_after_forward[u]: free unit u after its forward (then it is gathered again for
  // backward); torchtitan's default is every unit but the last.
  std::vector<bool> reshard_after_forward;
  bool prefetch = true;
};

// The ops of one training step (forward then backward of one micro-batch, the optimizer
// step), in the order the host issues them. Each stream executes its own ops in this order.
std::vector<PlanOp> fsdp_stream_plan(const StreamPlanOptions& options);

}  // namespace ctitan
