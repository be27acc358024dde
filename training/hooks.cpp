#include "training/hooks.h"

#include <signal.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <thread>

#include "components/preemption.h"
#include "config/errors.h"
#include "util/env.h"

namespace ctitan {
namespace {

void maybe_inject_oom(const RunProgress& at) {
  const auto& hook = runtime_env().fault;
  if (!hook || hook->kind != "oom" || hook->detail.empty() || !hook->at(at.rank, at.step)) return;
  if (at.phase != hook->detail) return;
  (void)torch::empty({int64_t{1} << 48}, torch::kFloat);  // 2^48 floats = 1 PiB
}

}  // namespace

void enter_phase(RunProgress& at, int64_t step, std::string name) {
  at.step = step;
  at.phase = std::move(name);
  maybe_inject_oom(at);
}

void maybe_inject_fault(int64_t rank, int64_t step, torch::Tensor& loss, const std::vector<torch::Tensor>& params) {
  const auto& hook = runtime_env().fault;
  if (!hook || runtime_env().restart_count > 0 || !hook->at(rank, step)) return;
  const std::string& k = hook->kind;
  if (k == "oom") return;  // maybe_inject_oom's
  if (k == "kill") raise(SIGKILL);
  if (k == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  if (k == "term" || k == "int" || k == "usr1") {
    request_stop_for_test(k == "term" ? SIGTERM : k == "int" ? SIGINT : SIGUSR1);
    return;
  }
  if (k == "nan" || k == "inf" || k == "spike") {
    if (k == "spike")
      loss.mul_(10);
    else
      loss.fill_(k == "nan" ? std::nan("") : HUGE_VAL);
    return;
  }
  if (k == "nangrad") {
    for (const auto& p : params)
      if (p.grad().defined() && p.grad().numel() > 0) {
        p.grad().view(-1)[0] = std::nan("");
        return;
      }
  }
  throw RuntimeFailure("injected fault (CTITAN_FAULT=" + hook->spec + ")");
}

void maybe_trace_host_reads(int64_t rank, int64_t step, int64_t reads) {
  const std::string& prefix = runtime_env().trace_host_reads;
  if (prefix.empty()) return;
  static std::ofstream out(prefix + ".rank" + std::to_string(rank), std::ios::app);
  out << step << ' ' << reads << std::endl;
}

void maybe_trace_batch(const Batch& b, int64_t rank, int64_t step) {
  const std::string& prefix = runtime_env().trace_windows;
  if (prefix.empty()) return;
  static std::ofstream out(prefix + ".rank" + std::to_string(rank), std::ios::app);
  for (int64_t i = 0; i < b.batch; ++i) {
    out << step;
    for (int64_t t = 0; t < b.seq; ++t) out << ' ' << b.inputs[i * b.seq + t];
    out << ' ' << b.labels[i * b.seq + b.seq - 1] << '\n';
  }
  out.flush();
}

}  // namespace ctitan
