// Where a run is (for the line an allocation failure ends with), and the test hooks the loop
// calls: faults injected on one rank at one step, and the trace of the windows a rank trains on.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "components/system.h"
#include "datasets/dataloader.h"

namespace ctitan {

// Where a run is, for the line an allocation failure ends with: the step (0 before the
// first) and the phase, plus what the start-up estimate said. Made when train_main begins:
// the first-batch time and the read count are taken from then, not from the process's start
// (a shell that built train and then exec'd it would count its build: 564 s, 15 GB).
struct RunProgress {
  int64_t step = 0;
  std::string phase = "start-up";
  int64_t rank = 0;
  double estimate_bytes = 0;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
  int64_t rchar_at_start = process_rchar();
};

// Enters a phase of a step (0: start-up); an allocation failure names the last one entered.
// Test hook: CTITAN_FAULT=oom:<rank>:<step>:<phase> makes that rank ask LibTorch for 1 PiB
// (more than any address space) when it enters that phase of that step (phase as
// RunProgress names it, e.g. "backward", "optimizer", "checkpoint save"; step 0 with a
// start-up phase such as "optimizer"), so tests see a real allocation failure reported.
void enter_phase(RunProgress& at, int64_t step, std::string name);

// Test hook: CTITAN_FAULT=<kind>:<rank>:<step> makes that rank misbehave mid-step, after its
// backward, so tests can check what the job does. kind: raise (an exception), kill (SIGKILL),
// hang (sleeps for an hour), term | int | usr1 (the process sends itself that stop signal),
// nan | inf (its loss becomes NaN / inf), nangrad (a gradient element becomes NaN), spike
// (its reported loss is multiplied by 10). Under torchrun only the first attempt meets it: the
// workers it restarts (TORCHELASTIC_RESTART_COUNT > 0) inherit the variable but run clean.
void maybe_inject_fault(int64_t rank, int64_t step, torch::Tensor& loss, const std::vector<torch::Tensor>& params);

// Test hook: CTITAN_TRACE_HOST_READS=<prefix> appends "<step> <reads>" to <prefix>.rank<r>
// after each step: the values that step (with its metrics, save and stop check) read back
// from the compute device to the host (read_to_host, kernels/device_route.h).
void maybe_trace_host_reads(int64_t rank, int64_t step, int64_t reads);

// Test hook: CTITAN_TRACE_WINDOWS=<prefix> appends every window this rank trains on to
// <prefix>.rank<r>, one line "<step> <token ids...>", so tests can check which data a run saw.
void maybe_trace_batch(const Batch& b, int64_t rank, int64_t step);

}  // namespace ctitan
