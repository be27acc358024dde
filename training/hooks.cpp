#include "training/hooks.h"

#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "components/preemption.h"
#include "config/errors.h"

namespace ctitan {
namespace {

void maybe_inject_oom(const RunProgress& at) {
  static const char* f = std::getenv("CTITAN_FAULT");
  if (!f || std::strncmp(f, "oom:", 4) != 0) return;
  long r = -1, s = -1;
  char phase[64] = {0};
  if (std::sscanf(f + 4, "%ld:%ld:%63[^\n]", &r, &s, phase) != 3) return;
  if (r != at.rank || s != at.step || at.phase != phase) return;
  (void)torch::empty({int64_t{1} << 48}, torch::kFloat);  // 2^48 floats = 1 PiB
}

}  // namespace

void enter_phase(RunProgress& at, int64_t step, std::string name) {
  at.step = step;
  at.phase = std::move(name);
  maybe_inject_oom(at);
}

void maybe_inject_fault(int64_t rank, int64_t step, double& loss, const std::vector<torch::Tensor>& params) {
  const char* f = std::getenv("CTITAN_FAULT");
  if (!f || !*f) return;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (attempt && std::atoi(attempt) > 0) return;
  char kind[16] = {0};
  long r = -1, s = -1;
  if (std::sscanf(f, "%15[^:]:%ld:%ld", kind, &r, &s) != 3 || r != rank || s != step) return;
  const std::string k = kind;
  if (k == "oom") return;  // maybe_inject_oom's
  if (k == "kill") raise(SIGKILL);
  if (k == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  if (k == "term" || k == "int" || k == "usr1") {
    request_stop_for_test(k == "term" ? SIGTERM : k == "int" ? SIGINT : SIGUSR1);
    return;
  }
  if (k == "nan" || k == "inf" || k == "spike") {
    loss = k == "nan" ? std::nan("") : k == "inf" ? HUGE_VAL : 10 * loss;
    return;
  }
  if (k == "nangrad") {
    for (const auto& p : params)
      if (p.grad().defined() && p.grad().numel() > 0) {
        p.grad().view(-1)[0] = std::nan("");
        return;
      }
  }
  throw RuntimeFailure("injected fault (CTITAN_FAULT=" + std::string(f) + ")");
}

void maybe_trace_batch(const Batch& b, int64_t rank, int64_t step) {
  static const char* prefix = std::getenv("CTITAN_TRACE_WINDOWS");
  if (!prefix || !*prefix) return;
  static std::ofstream out(std::string(prefix) + ".rank" + std::to_string(rank), std::ios::app);
  for (int64_t i = 0; i < b.batch; ++i) {
    out << step;
    for (int64_t t = 0; t < b.seq; ++t) out << ' ' << b.inputs[i * b.seq + t];
    out << ' ' << b.labels[i * b.seq + b.seq - 1] << '\n';
  }
  out.flush();
}

}  // namespace ctitan
