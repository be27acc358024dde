// The stop-signal watcher; see preemption.h.
#include "components/preemption.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include <spdlog/spdlog.h>

namespace ctitan {
namespace {

std::atomic<int> g_signal{0};
std::atomic<bool> g_installed{false};
int g_pipe[2] = {-1, -1};  // the handler writes each signal number here, the watcher reads

const int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  for (int s : kStopSignals) sigaddset(&set, s);
  return set;
}

// Only for threads that existed before the watcher (OpenBLAS starts its workers when it
// is loaded, before main): async-signal-safe, it hands the signal to the watcher.
void on_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  (void)!write(g_pipe[1], &b, 1);
  errno = saved;
}

[[noreturn]] void die_by(int sig) {
  // Default action, unblocked in this thread, then raised here: the process ends as if it
  // had never caught the signal (status 128 + sig for a shell or launcher).
  signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  raise(sig);
  _exit(128 + sig);
}

void watch() {
  using Clock = std::chrono::steady_clock;
  Clock::time_point first;
  for (;;) {
    unsigned char b = 0;
    const ssize_t n = read(g_pipe[0], &b, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1) return;
    const int sig = b;
    if (g_signal.load() == 0) {
      first = Clock::now();
      g_signal.store(sig);
      spdlog::warn(
          "received {}: stopping at the end of this step (a checkpoint is saved when checkpoint.enable); "
          "send it again to exit at once",
          stop_signal_name(sig));
      continue;
    }
    if (std::chrono::duration<double>(Clock::now() - first).count() < kRepeatWindowSeconds) continue;
    // Written directly: the logger may be held by a thread that is stuck.
    char msg[128];
    const int len =
        std::snprintf(msg, sizeof msg, "received %s again: exiting now, without a checkpoint\n", stop_signal_name(sig));
    if (len > 0) (void)!write(STDERR_FILENO, msg, static_cast<size_t>(len));
    die_by(sig);
  }
}

}  // namespace

void install_stop_signal_watcher() {
  if (g_installed.exchange(true)) return;
  if (pipe2(g_pipe, O_CLOEXEC) != 0) return;  // no watcher: the signals keep their default
  fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);
  // Blocked in this thread and so in every thread it creates from now on; a handler (with
  // SA_RESTART) for the few that already exist. Either way the watcher gets the signal.
  const sigset_t set = stop_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread(watch).detach();
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART;
  sigfillset(&sa.sa_mask);
  for (int s : kStopSignals) sigaction(s, &sa, nullptr);
  // A signal blocked in every thread stays pending at the process; this one takes them.
  std::thread([set] {
    for (;;) {
      int sig = 0;
      if (sigwait(&set, &sig) == 0) on_signal(sig);
    }
  }).detach();
}

int stop_signal_received() { return g_signal.load(); }

void request_stop_for_test(int sig) {
  kill(getpid(), sig);  // process-directed: the watcher's sigwait takes it
  for (int i = 0; i < 200 && g_signal.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

const char* stop_signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return "a signal";
  }
}

}  // namespace ctitan
